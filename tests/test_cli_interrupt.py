"""Ctrl-C in the ``hookax`` command: SIGINT at several moments (while JAX loads, while XLA
compiles, while a harvest writes) ends every subcommand with status 130, one line on stderr,
no traceback and never SIGSEGV; an interrupted harvest resumes exactly.

The commands run as ``python -m hookax`` subprocesses: that is where the signal and the exit
happen. In-process, ``main`` returns 130 with the same line (the last test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hookax._cli.main import main
from tests.test_harvest import assert_same_store

ROOT = Path(__file__).resolve().parents[1]
MOMENTS = (0.5, 1.5, 3.0)  # seconds after the start: JAX loading, the model, compiling


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return env


def start(*argv: str, cwd: Path) -> subprocess.Popen[bytes]:
    """``python -m hookax ARGV`` in ``cwd``, started."""
    return subprocess.Popen(
        [sys.executable, "-m", "hookax", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=_env(),
    )


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """``python -m hookax ARGV`` in ``cwd``, to its end."""
    cmd = [sys.executable, "-m", "hookax", *argv]
    return subprocess.run(cmd, capture_output=True, cwd=cwd, env=_env(), timeout=300)


def interrupted(p: subprocess.Popen[bytes], at: float | None = None) -> tuple[int, str] | None:
    """SIGINT to ``p`` (``at`` seconds after now), then its status and stderr; None when it
    had ended before the signal."""
    if at is not None:
        time.sleep(at)
    if p.poll() is not None:
        p.communicate()
        return None
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    return p.returncode, err.decode()


def assert_clean_exit(result: tuple[int, str], first: str = "hookax: interrupted") -> str:
    code, err = result
    assert code != -signal.SIGSEGV, f"SIGSEGV; stderr: {err}"
    assert code in (130, -signal.SIGINT), (code, err)
    if code == -signal.SIGINT and not err:  # killed before Python had set up its handler
        return ""
    lines = err.splitlines()
    assert 1 <= len(lines) <= 3 and "Traceback" not in err, err
    assert lines[-1].startswith(first), err
    return lines[-1]


COMMANDS = {
    "summary": ["summary", "--example", "transformer"],
    "ops": ["ops", "--example", "transformer"],
    "gradflow": ["gradflow", "--example", "transformer", "--out", "g.png"],
}


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_ctrl_c_at_several_moments(tmp_path, command):
    hit = 0
    for at in MOMENTS:
        result = interrupted(start(*COMMANDS[command], cwd=tmp_path), at)
        if result is None:  # it ended first (a fast machine)
            continue
        hit += 1
        assert assert_clean_exit(result) in ("hookax: interrupted", "")
    assert hit >= 1


@pytest.mark.slow
def test_gradflow_interrupted_while_compiling_never_crashes(tmp_path):
    """The transformer's gradient takes seconds to compile: SIGINT lands inside XLA. An
    interrupted run leaves no image or a whole one (the PNG is renamed into place), never a
    truncated file or its temporary."""
    png = tmp_path / "g.png"
    for at in (2.0, 3.0, 4.0, 5.0, 6.5, 8.0):
        png.unlink(missing_ok=True)
        result = interrupted(start(*COMMANDS["gradflow"], cwd=tmp_path), at)
        if result is None:  # it ended first (a fast machine): the image is whole
            assert png.read_bytes().endswith(PNG_END)
            continue
        assert_clean_exit(result)
        assert not png.exists() or png.read_bytes().endswith(PNG_END)
        assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["g.png"])


PNG_END = b"IEND\xaeB`\x82"  # a PNG's last chunk


def _committed(store: Path) -> int:
    try:
        return json.loads((store / "progress" / "0.json").read_text())["batches"]
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_harvest_interrupted_then_resumed_exactly(tmp_path):
    argv = ["harvest", "--example", "mlp", "--batches", "1500", "--no-progress", "--out"]
    for at in MOMENTS:
        result = interrupted(start(*argv, "s", cwd=tmp_path), at)
        if result is not None:
            assert_clean_exit(result)
    # once batches are being written
    p = start(*argv, "s", cwd=tmp_path)
    deadline = time.monotonic() + 240
    while _committed(tmp_path / "s") < 5 and p.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    result = interrupted(p)
    assert result is not None, "the harvest ended before it was interrupted"
    line = assert_clean_exit(result, "hookax: interrupted: ")
    k = _committed(tmp_path / "s")
    assert 5 <= k < 1500
    assert line == (
        f"hookax: interrupted: {k} batches committed to --out 's' are kept; run the same "
        f"command again to resume at batch {k}"
    )
    done = run(*argv, "s", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines()[-1].endswith(f"resumed at batch {k})")
    ref = run(*argv, "ref", cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    assert_same_store(tmp_path / "ref", tmp_path / "s")


def test_in_process_ctrl_c_returns_130_with_one_line(tmp_path, monkeypatch, capsys):
    from hookax._harvest.store import Store

    commit = Store.commit

    def then_interrupt(self, batches):
        commit(self, batches)
        if batches == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(Store, "commit", then_interrupt)
    argv = ["harvest", "--example", "mlp", "--batches", "4", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "s")]) == 130
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        f"hookax: interrupted: 2 batches committed to --out {str(tmp_path / 's')!r} are kept; "
        f"run the same command again to resume at batch 2\n",
    )
    monkeypatch.undo()
    assert main([*argv, "--out", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("resumed at batch 2)")


@pytest.mark.parametrize(
    ("orig_argv", "argv0", "command"),
    [
        (["python", "-m", "hookax", "summary"], "-m", True),
        (["python", "-W", "error", "-X", "dev", "-m", "hookax"], "-m", True),
        (["python", "-mhookax", "ops"], "-m", True),
        (["python", "/venv/bin/hookax", "harvest"], "/venv/bin/hookax", True),
        (["python", "-m", "pytest", "tests"], "-m", False),
        (["python", "-m", "hookax.examples"], "-m", False),
        (["python", "-c", "import hookax"], "-c", False),
        (["python", "train.py"], "train.py", False),
        (["python"], "", False),
    ],
)
def test_only_the_command_handles_ctrl_c(monkeypatch, orig_argv, argv0, command):
    from hookax._cli.interrupt import running_as_command

    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    monkeypatch.setattr(sys, "argv", [argv0])
    assert running_as_command() is command
    # hookax installs no handler in this process (a shell's background job starts with SIGINT
    # ignored, so the handler Python began with is one of these three)
    assert signal.getsignal(signal.SIGINT) in (
        signal.default_int_handler,
        signal.SIG_IGN,
        signal.SIG_DFL,
    )


def test_in_process_an_interrupt_that_jax_wrapped_is_an_interrupt(tmp_path, monkeypatch, capsys):
    """JAX turns a KeyboardInterrupt raised inside its C++ (a pytree's __eq__) into a
    ValueError: it is still Ctrl-C, never an input that does not fit."""
    from hookax._harvest import harvest as module

    def wrapped(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise ValueError("Exception raised while checking equality of metadata fields") from e

    monkeypatch.setattr(module, "harvest", wrapped)
    argv = ["harvest", "--example", "mlp", "--batches", "4", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "s")]) == 130
    assert capsys.readouterr() == (
        "",
        f"hookax: interrupted: no batch committed to --out {str(tmp_path / 's')!r}; run the "
        f"same command again to start\n",
    )
