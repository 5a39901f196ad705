"""What ``hx.harvest`` and ``hookax harvest`` show while they run and when they end, in a
newcomer's first hour: a bar with percentage and time left when the number of batches is
known, a line rewritten in place off a terminal (a notebook), one final line with one
throughput figure, the model's own output named ``(model)``, and a short repr."""

from __future__ import annotations

import io
import re

import jax.numpy as jnp
import pytest
from flax import nnx

import hookax as hx
from hookax._cli.main import main
from hookax._harvest import progress as _progress

pytest.importorskip("tensorstore")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _model():
    return nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu)


def _data(n: int):
    return [jnp.full((2, 4), float(i)) for i in range(n)]


def test_a_notebook_gets_a_line_rewritten_in_place_then_the_final_line(tmp_path, monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    h = hx.harvest(_model(), _data(5), where="layers/0", store=tmp_path / "s", progress=True)
    text = stream.getvalue()
    frames = text.split("\r")[1:]
    assert frames[0].startswith("harvest: " + "·" * 20 + "   0% batch 0/5, 0 rows")
    assert frames[-2].startswith("harvest: " + "█" * 20 + " 100% batch 5/5, 10 rows, ")
    assert frames[-1].rstrip(" \n") == str(h)  # the final line, padded over the last frame
    assert text.endswith("\n") and text.count("\n") == 1  # one line stays
    assert str(h).startswith(f"harvest: 5 batches, 10 rows, {h.bytes / 1e6:.1f} MB in ")
    assert str(h).endswith(f" -> {tmp_path / 's'}")
    assert str(h).count("MB/s") == 1


def test_a_terminal_gets_a_bar_with_percentage_and_time_left():
    stream = _Terminal()
    with _progress.Progress(True, 4, 0, stream) as bar:
        for i in range(1, 5):
            bar(i, 2 * i, 1000 * i)
    bar.finish("harvest: done")
    text = stream.getvalue()
    assert "100%" in text and "batch 4/4" in text and "left" in text
    assert text.endswith("harvest: done\n")
    assert text.rstrip("\n").split("\n")[-1].endswith("harvest: done")


def test_without_a_known_total_a_count(tmp_path, monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    data = iter(_data(3))  # no length
    h = hx.harvest(_model(), data, where="layers/0", store=tmp_path / "s", progress=True)
    frames = stream.getvalue().split("\r")[1:]
    assert frames[0].startswith("harvest: batch 0, 0 rows")
    assert "%" not in stream.getvalue()
    assert frames[-1].rstrip(" \n") == str(h)


def test_off_by_default_when_piped(tmp_path, capsys):
    assert _progress.shown(None) is False  # pytest's stderr is no terminal, no kernel here
    assert _progress.shown(True) is True
    hx.harvest(_model(), _data(2), where="layers/0", store=tmp_path / "s")
    assert capsys.readouterr().err == ""


def test_repr_is_short_and_rounded(tmp_path):
    h = hx.harvest(_model(), _data(2), store=tmp_path / "s", progress=False)
    assert "\n" not in repr(h)
    assert re.fullmatch(
        r"<hx\.Harvest '.+': 2 batches, 4 rows, \d+\.\d MB in \d+\.\d s \([\d.e+-]+ MB/s\); "
        r"2 arrays>",
        repr(h),
    ), repr(h)
    assert repr(h.seconds) not in repr(h)


def test_cli_names_the_model_and_states_one_throughput(capsys, tmp_path):
    argv = ["harvest", "--example", "mlp", "--batches", "2", "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""  # stderr is no terminal here: no progress
    lines = out.splitlines()
    assert lines[0] == "(model)   float32[16,10]"
    assert lines[-1].startswith(f"wrote {tmp_path / 's'}: 2 batches, 16 rows, ")
    assert out.count("MB/s") == 1


def test_cli_with_progress_states_the_figures_once(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(_progress, "shown", lambda progress: progress is not False)
    argv = ["harvest", "--example", "mlp", "--batches", "2", "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == f"wrote {tmp_path / 's'}"  # the figures are on stderr
    final = err.split("\r")[-1].rstrip(" \n")
    assert final.startswith("harvest: 2 batches, 16 rows, ")
    assert final.endswith(f" -> {tmp_path / 's'}")
    assert (out + final).count("MB/s") == 1
