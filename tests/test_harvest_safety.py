"""hx.harvest and `hookax harvest` never delete or change what hookax did not write.

Every test snapshots the user's files byte by byte (hidden files and subfolders included)
before the call and compares after it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import hookax as hx
from hookax._harvest import store as _store
from hookax._harvest.harvest import Harvest
from tests import harvest_worker as w


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry below ``root``: a file's bytes, None for a folder (symlinks not followed)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


def user_folder(path: Path) -> Path:
    """A folder of somebody's work: files, hidden files, a subfolder, a stale-looking .tmp."""
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("\\chapter{Results}\n")
    (path / ".git").mkdir()
    (path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (path / ".env").write_bytes(b"TOKEN=\x00\x01secret")
    (path / "data").mkdir()
    (path / "data" / "runs.csv").write_text("step,loss\n1,0.5\n")
    (path / ".notes.12345.tmp").write_text("my draft, not hookax's")
    (path / "data" / ".cache.1.tmp").write_text("also mine")
    return path


def batches(n: int = 2) -> list[np.ndarray]:
    return [x[:, 0] for x in w.host_batches(n)]


def harvest(store: Path | str, **kw) -> Harvest:
    return hx.harvest(
        w.make_model(), batches(), where="layers/*", store=store, progress=False, **kw
    )


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_user_files_is_refused_and_left_byte_identical(tmp_path, overwrite):
    mine = user_folder(tmp_path / "mine")
    before = snapshot(mine)
    with pytest.raises(hx.HookaxError) as e:
        harvest(mine, overwrite=overwrite)
    msg = str(e.value)
    assert f"store={str(mine)!r} is a folder that is not a hookax store" in msg
    assert "'.env', '.git', '.notes.12345.tmp', 'data', 'thesis.tex'" in msg
    assert "Nothing was written or deleted" in msg
    assert snapshot(mine) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_current_and_home_folders_are_refused_whatever_they_hold(
    tmp_path, monkeypatch, overwrite
):
    work = user_folder(tmp_path / "work")
    home = user_folder(tmp_path / "home")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    before = snapshot(tmp_path)
    for store, what in [
        (".", "is the current folder"),
        (str(work), "is the current folder"),
        (str(tmp_path), "is a folder above the current folder"),
        (str(home), "is your home folder"),
        ("~", "is your home folder"),
        ("/", "is a folder above the current folder"),
    ]:
        with pytest.raises(hx.HookaxError, match=f"store={store!r} {what}; a store is a folder"):
            harvest(store, overwrite=overwrite)
    assert snapshot(tmp_path) == before
    (work / "empty").mkdir()
    monkeypatch.chdir(work / "empty")  # an empty current folder is refused too
    with pytest.raises(hx.HookaxError, match="is the current folder"):
        harvest(".", overwrite=overwrite)
    assert list((work / "empty").iterdir()) == []


def test_a_store_is_replaced_and_an_empty_folder_used(tmp_path):
    s = tmp_path / "s"
    harvest(s)
    old = (s / "hookax.json").read_text()
    model = w.make_model()
    h = hx.harvest(model, batches(3), where="layers/0", store=s, overwrite=True, progress=False)
    assert (h.batches, h.names) == (3, ("layers/0",))
    assert (s / "hookax.json").read_text() != old
    assert not (s / "layers.2").exists()  # the old run's array is gone: it was hookax's
    (tmp_path / "empty").mkdir()
    assert harvest(tmp_path / "empty", overwrite=True).batches == 2


def test_a_store_holding_user_files_is_not_replaced(tmp_path):
    s = tmp_path / "s"
    harvest(s)
    (s / "README.txt").write_text("what these activations are")
    (s / "plots").mkdir()
    (s / "plots" / "a.png").write_bytes(b"\x89PNG")
    before = snapshot(s)
    with pytest.raises(
        hx.HookaxError,
        match=r"is a hookax store that also holds files hookax did not write \(2 entries: "
        r"'README.txt', 'plots'\); overwrite=True replaces only what hookax wrote",
    ):
        harvest(s, overwrite=True)
    assert snapshot(s) == before
    assert harvest(s).resumed_at == 2  # without overwrite: the store is resumed, files kept
    assert (s / "README.txt").read_text() == "what these activations are"


def test_a_refused_folder_keeps_its_tmp_files(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".hookax.json.999.tmp").write_text("looks like hookax's, is not in a store")
    (mine / "progress").mkdir()
    (mine / "progress" / ".0.json.1.tmp").write_text("x")
    before = snapshot(mine)
    with pytest.raises(hx.HookaxError, match="is a folder that is not a hookax store"):
        harvest(mine)
    assert snapshot(mine) == before


def test_a_file_is_refused(tmp_path):
    f = tmp_path / "acts.zarr"
    f.write_text("a file")
    with pytest.raises(hx.HookaxError, match=r"is a file, not a folder\. Nothing was written"):
        harvest(f, overwrite=True)
    assert f.read_text() == "a file"


def test_a_crash_while_replacing_leaves_a_store_a_rerun_completes(tmp_path, monkeypatch):
    s = tmp_path / "s"
    harvest(s)
    fresh = tmp_path / "fresh"
    want = harvest(fresh)

    def crash(path: Path) -> None:
        raise KeyboardInterrupt  # killed after the description was removed

    monkeypatch.setattr(_store, "_remove_hookax_entries", crash)
    with pytest.raises(KeyboardInterrupt):
        harvest(s, overwrite=True)
    monkeypatch.undo()
    assert (s / ".hookax-harvest").exists() and not (s / "hookax.json").exists()
    h = harvest(s)  # no overwrite needed: an interrupted creation starts again
    assert (h.batches, h.resumed_at) == (2, 0)
    for name in want.names:
        np.testing.assert_array_equal(h.read(name), want.read(name))


def test_cli_overwrite_of_user_folders_and_dot(tmp_path, monkeypatch, capsys):
    from hookax._cli.main import main

    mine = user_folder(tmp_path / "mine")
    monkeypatch.chdir(mine)
    before = snapshot(tmp_path)
    argv = ["harvest", "--example", "mlp", "--batches", "1", "--no-progress", "--overwrite"]
    for out in [".", str(mine), "data"]:
        assert main([*argv, "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hookax: error: ") and err.count("\n") == 1, err
        assert "does not fit the model" not in err
    assert snapshot(tmp_path) == before
    assert main([*argv, "--out", "acts"]) == 0  # a new folder beside them is fine
    capsys.readouterr()
    assert main([*argv, "--out", "acts"]) == 0  # and replacing hookax's own store
    capsys.readouterr()
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("mine/acts")} == before
