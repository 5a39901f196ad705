"""Store faults of hx.harvest and `hookax harvest`: a file at --out or on its path, a read-only
location, the store's folder replaced by a file midway (a full disk: tests/test_harvest.py).
Each raises hx.StoreError naming the store, the cause and the batch reached (on the command
line: one line in the words of its flags, never "does not fit the model"); the committed
batches stay readable and a rerun resumes exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import hookax as hx
from hookax._cli.main import main
from hookax._harvest.harvest import read
from hookax._harvest.store import Store
from tests import harvest_worker as w
from tests.test_harvest import assert_same_store, captured

N = 5  # batches of a run


def batches(n: int = N) -> list[np.ndarray]:
    return [x[:, 0] for x in w.host_batches(n)]


def harvest(store: Path | str, data=None, **kw):
    data = batches() if data is None else data
    return hx.harvest(w.make_model(), data, where="layers/*", store=store, progress=False, **kw)


def cli(capsys, out: Path | str, *extra: str) -> tuple[int, str, str]:
    argv = ["harvest", "--example", "mlp", "--where", "layers/*", "--batches", str(N)]
    code = main([*argv, "--no-progress", "--out", str(out), *extra])
    o, e = capsys.readouterr()
    return code, o, e


def one_line_error(err: str) -> str:
    assert err.startswith("hookax: error: ") and err.count("\n") == 1, err
    assert "does not fit the model" not in err and "Traceback" not in err
    return err.removeprefix("hookax: error: ").strip()


def replaced_after(monkeypatch, store: Path, k: int) -> Path:
    """After batch ``k`` is committed, the store's folder is moved aside and a file put in its
    place; returns where the folder went."""
    aside = store.with_name(store.name + ".aside")
    commit = Store.commit

    def then_replace(self, batches):
        commit(self, batches)
        if batches == k and not aside.exists():
            store.rename(aside)
            store.write_text("not a folder")

    monkeypatch.setattr(Store, "commit", then_replace)
    return aside


def put_back(store: Path, aside: Path) -> None:
    store.unlink()
    aside.rename(store)


def assert_committed(store: Path, k: int) -> None:
    """The store's committed rows are exactly those of the first ``k`` batches."""
    model = w.make_model()
    for name in ("layers/0", "layers/2"):
        np.testing.assert_array_equal(read(store, name), captured(model, batches(k), name))


# ---- before any work: a file at --out or on its path ------------------------------------------


def test_a_file_at_or_above_the_store_is_refused_before_any_work(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    with pytest.raises(
        hx.StoreError, match=r"store='.*notes.txt' is a file, not a folder\. Nothing"
    ):
        harvest(f)
    under = f / "acts"
    with pytest.raises(hx.StoreError) as e:
        harvest(under)
    assert str(e.value) == (
        f"hx.harvest: cannot write the store {str(under)!r}: a part of its path is a file, not a "
        f"folder [NotADirectoryError: [Errno 20] Not a directory: {str(f)!r}]. Nothing was "
        f"written. Fix: move that file away, or give another store=PATH."
    )
    assert isinstance(e.value, OSError) and isinstance(e.value, hx.HookaxError)
    code, out, err = cli(capsys, f)
    assert (code, out) == (2, "")
    assert one_line_error(err) == (
        f"--out {str(f)!r} is a file, not a folder. Nothing was written. Fix: give the path of "
        f"a new folder."
    )
    code, out, err = cli(capsys, under)
    assert (code, out) == (2, "")
    msg = one_line_error(err)
    assert msg.startswith(f"cannot write --out {str(under)!r}: a part of its path is a file")
    assert msg.endswith("or give another --out PATH.")
    assert f.read_text() == "mine"


# ---- a read-only location ----------------------------------------------------------------------


def skip_unless_chmod_stops_writes(folder: Path) -> None:
    """Skip where a folder's mode 0o555 does not stop this process writing in it (root)."""
    folder.mkdir(exist_ok=True)
    folder.chmod(0o555)
    try:
        (folder / "probe").touch()
    except PermissionError:
        return
    finally:
        folder.chmod(0o755)
    (folder / "probe").unlink()
    pytest.skip("chmod 0o555 does not stop this user (root) from writing")


@pytest.fixture
def read_only(tmp_path):
    """A folder that this process may not write."""
    folder = tmp_path / "ro"
    skip_unless_chmod_stops_writes(folder)
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


def test_a_read_only_location_is_refused_before_any_work(read_only, capsys):
    store = read_only / "acts"
    with pytest.raises(hx.StoreError) as e:
        harvest(store)
    assert str(e.value) == (
        f"hx.harvest: cannot write the store {str(store)!r}: permission denied: this location "
        f"is not writable [PermissionError: [Errno 13] Permission denied: {str(read_only)!r}]. "
        f"Nothing was written. Fix: make the folder writable (chmod u+w), or give another "
        f"store=PATH."
    )
    code, out, err = cli(capsys, store)
    assert (code, out) == (2, "")
    assert one_line_error(err).startswith(f"cannot write --out {str(store)!r}: permission denied")
    assert list(read_only.iterdir()) == []


def test_a_store_made_read_only_midway_keeps_its_batches_and_resumes(tmp_path, monkeypatch):
    skip_unless_chmod_stops_writes(tmp_path / "probe")
    s = tmp_path / "s"
    ref = harvest(tmp_path / "ref")
    commit = Store.commit

    def then_lock(self, batches):
        commit(self, batches)
        if batches == 2:
            for d, _, _ in os.walk(s):
                os.chmod(d, 0o555)
            for f in s.rglob("c.*"):
                f.chmod(0o444)

    monkeypatch.setattr(Store, "commit", then_lock)
    with pytest.raises(hx.StoreError) as e:
        harvest(s, overlap=False)
    monkeypatch.undo()
    for d, _, _ in os.walk(s):
        os.chmod(d, 0o755)
    for f in s.rglob("c.*"):
        f.chmod(0o644)
    assert f"cannot write the store {str(s)!r} at batch 2: permission denied" in str(e.value)
    assert "The 2 batches committed before are kept." in str(e.value)
    assert_committed(s, 2)
    h = harvest(s)
    assert (h.resumed_at, h.batches) == (2, N)
    assert_same_store(ref.store, s, files=False)


# ---- the store's folder replaced by a file midway -----------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_a_store_replaced_by_a_file_midway_keeps_its_batches_and_resumes(
    tmp_path, monkeypatch, overlap
):
    ref = harvest(tmp_path / "ref")
    s = tmp_path / "s"
    aside = replaced_after(monkeypatch, s, 2)
    with pytest.raises(hx.StoreError) as e:
        harvest(s, overlap=overlap)
    monkeypatch.undo()
    assert str(e.value).startswith(
        f"hx.harvest: cannot write the store {str(s)!r} at batch 2: a part of its path is a "
        f"file, not a folder (was the store's folder moved or replaced by a file?) "
        f"[NotADirectoryError: [Errno 20] Not a directory: '{s}/"
    )
    assert str(e.value).endswith(
        f"The 2 batches committed before are kept. Fix: put the store's folder back at "
        f"store={str(s)!r}, then run again with the same arguments: it resumes at batch 2."
    )
    assert s.read_text() == "not a folder"
    put_back(s, aside)
    assert_committed(s, 2)
    h = harvest(s)
    assert (h.resumed_at, h.batches) == (2, N)
    assert_same_store(ref.store, s)


def test_cli_store_replaced_midway_then_rerun_resumes(tmp_path, monkeypatch, capsys):
    code, _, err = cli(capsys, tmp_path / "ref")
    assert (code, err) == (0, "")
    s = tmp_path / "s"
    aside = replaced_after(monkeypatch, s, 3)
    code, out, err = cli(capsys, s)
    monkeypatch.undo()
    assert (code, out) == (2, "")
    msg = one_line_error(err)
    assert msg.startswith(f"cannot write --out {str(s)!r} at batch 3: a part of its path is a file")
    assert msg.endswith(
        f"The 3 batches committed before are kept. Fix: put the store's folder back at "
        f"--out {str(s)!r}, then run the same command again: it resumes at batch 3."
    )
    put_back(s, aside)
    code, out, err = cli(capsys, s)
    assert (code, err) == (0, "")
    assert "resumed at batch 3" in out.splitlines()[-1]
    assert_same_store(tmp_path / "ref", s)


def test_cli_batches_already_in_the_store(tmp_path, capsys):
    s = tmp_path / "s"
    code, out, err = cli(capsys, s)
    assert (code, err) == (0, "")
    before = (s / "hookax.json").read_text()
    for batches in (N, N - 2):
        argv = ["harvest", "--example", "mlp", "--where", "layers/*", "--batches", str(batches)]
        assert main([*argv, "--no-progress", "--out", str(s)]) == 0
        out, err = capsys.readouterr()
        assert err == ""
        assert out.splitlines()[-1] == (
            f"{s} already holds {N} batches ({8 * N} rows): nothing to compute. A larger "
            f"--batches adds batches after them; --overwrite starts again."
        )
    assert (s / "hookax.json").read_text() == before
    code, out, err = cli(capsys, s, "--batches", str(N + 1))  # the last --batches counts
    assert (code, err) == (0, "")
    assert out.splitlines()[-1].startswith(f"wrote {s}: {N + 1} batches, {8 * (N + 1)} rows")
    assert out.splitlines()[-1].endswith(f", resumed at batch {N})")
