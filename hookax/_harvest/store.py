"""The on-disk store of ``hx.harvest``: zarr v3 arrays written through TensorStore.

Why TensorStore: it is already installed with Flax (Orbax checkpoints are written with it), so
the ``harvest`` extra adds nothing new for NNX users; it writes zarr v3, which zarr-python, xarray
and TensorStore itself read; its writes are asynchronous futures issued from C++ threads (the
Python writer thread only hands over buffers); and its ``file`` driver takes file locks around
each chunk's read-modify-write, so several processes may write parts of one chunk safely (zarr-
python's local store does not lock).

Layout of ``PATH``::

    hookax.json          what the store holds (model, where, dtype, call sites and their shapes)
                         and, once a run completes, its batch and row counts
    <name>/              one zarr v3 array per stored value: shape (rows, *per-row shape)
    _source/             int64 (rows, 1 + row_axes): batch index and row position in the batch
    _batch_end/          int64 (batches,): one past the last row of each batch
    progress/<i>.json    while a run is in progress: how many batches process i has committed

Commit protocol: a process writes a batch's rows (and, process 0, its ``_source`` and
``_batch_end`` entries), waits until every write is on disk, then atomically replaces its own
``progress/<i>.json`` (write a temporary file, ``os.replace``). The committed batch count is the
smallest over the progress files; rows past the last committed batch are garbage that the next run
overwrites. Arrays only ever grow during a run, so one process never truncates another's rows; a
finished run shrinks them to the exact row count, writes the counts into ``hookax.json`` and
removes ``progress/``. Each batch's rows land at positions fixed by the batches before it, so
writing a batch twice writes the same bytes: that is what makes a resumed run end identical.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from .._util.errors import HookaxError

__all__ = ["FORMAT", "Store", "import_tensorstore"]

FORMAT = "hookax.harvest/1"
META = "hookax.json"
CHUNK_BYTES = 16 << 20  # the most bytes of one chunk
PROGRESS_BYTES = 64  # the length of a progress file
SEPARATOR = "."  # chunk keys c.0.0: a chunk is one file, not also a folder


def import_tensorstore() -> Any:
    try:
        import tensorstore as ts
    except ImportError as e:  # pragma: no cover - tensorstore comes with flax
        raise HookaxError(
            "hx.harvest writes its store with TensorStore, which is not installed. "
            "Fix: pip install 'hookax[harvest]' (or pip install tensorstore)."
        ) from e
    return ts


def _dir_name(name: str, taken: set[str]) -> str:
    """A folder name for a stored value's name: ``layers/0/mlp`` -> ``layers.0.mlp``."""
    base = re.sub(r"[^A-Za-z0-9_.#\-]", "_", name.replace("/", ".")) or "_root"
    if base.startswith(("_", ".")) or base == "progress":
        base = "v" + base
    out, i = base, 1
    while out in taken:
        out, i = f"{base}~{i}", i + 1
    taken.add(out)
    return out


def describe(
    leaves: list[Any], *, model: str, where: str, row_axes: int, masked: bool, user: Any
) -> dict[str, Any]:
    """The static part of ``hookax.json``: what a run with these arguments stores."""
    taken: set[str] = set()
    arrays = {}
    for leaf in leaves:
        arrays[leaf.name] = {**leaf.describe(), "dir": _dir_name(leaf.name, taken)}
    return {
        "format": FORMAT,
        "model": model,
        "where": where,
        "row_axes": row_axes,
        "masked": masked,
        "arrays": arrays,
        "metadata": user,
    }


def _write_json(path: Path, obj: Any, fsync: bool = True) -> None:
    """Atomically replace ``path`` with ``obj`` as JSON (temporary file, [fsync,] rename)."""
    _write_text(path, json.dumps(obj, indent=1, sort_keys=True), fsync)


def _write_text(path: Path, text: str, fsync: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _progress_record(batches: int) -> str:
    """A progress file's text: always ``PROGRESS_BYTES`` long, so one ``pwrite`` replaces it."""
    return json.dumps({"batches": batches}).ljust(PROGRESS_BYTES - 1) + "\n"


def _read_progress(path: Path) -> int | None:
    """A progress file's count (None if it is gone); retried if read while being rewritten."""
    for attempt in range(5):
        try:
            return int(json.loads(path.read_text())["batches"])
        except FileNotFoundError:
            return None
        except ValueError:
            if attempt == 4:
                raise
            time.sleep(0.01)
    return None  # pragma: no cover


def _show(a: dict[str, Any] | None) -> str:
    return "absent" if a is None else f"{a['dtype']}[rows,{','.join(map(str, a['shape']))}]"


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for field in ("format", "model", "where", "row_axes", "masked", "metadata"):
        if old.get(field) != new[field]:
            out.append(f"{field}: store has {old.get(field)!r}, this run {new[field]!r}")
    oa, na = old.get("arrays", {}), new["arrays"]
    for name in sorted(set(oa) | set(na), key=str):
        o, n = oa.get(name), na.get(name)
        if o == n:
            continue
        out.append(f"array {name!r}: store has {_show(o)}, this run {_show(n)}")
    return out


class Store:
    """An open store: its description, its arrays, and the commit state of this process."""

    def __init__(self, path: Path, meta: dict[str, Any], process: int, fsync: bool = False) -> None:
        self.path, self.meta, self.process, self.fsync = path, meta, process, fsync
        ts = import_tensorstore()
        self._ts = ts
        self.context = ts.Context({"file_io_sync": fsync})
        self.arrays: dict[str, Any] = {}
        self._progress: int | None = None  # this process's progress file, open for rewriting

    # -- creation and validation -------------------------------------------------------------

    @staticmethod
    def prepare(
        path: Path,
        desc: dict[str, Any],
        *,
        overwrite: bool,
        create: bool,
        batch_rows: int = 1,
        batches_per_chunk: int = 1,
    ) -> None:
        """Make ``path`` hold a store described by ``desc``: create it, or check the one there.

        ``create`` is true in the one process that may create (process 0). A new store's chunks
        hold ``batches_per_chunk * batch_rows`` rows, fewer where that passes ``CHUNK_BYTES``.
        Several processes write through TensorStore, one batch per chunk (an unmasked batch
        then writes whole chunks, never reading one back); one process appends to chunk files
        itself (:mod:`hookax._harvest.chunks`) and prefers few large files.
        """
        meta_file = path / META
        if path.exists() and overwrite and create:
            shutil.rmtree(path)
        if create and path.is_dir():  # files left by a process killed while replacing them
            for tmp in [*path.glob(".*.tmp"), *path.glob("progress/.*.tmp")]:
                tmp.unlink(missing_ok=True)
        if meta_file.exists():
            old = json.loads(meta_file.read_text())
            diff = _differences(old, desc)
            if diff:
                raise HookaxError(
                    f"hx.harvest: the store {str(path)!r} holds another harvest than this run "
                    f"would write: " + "; ".join(diff) + ". Nothing was written. Fix: give "
                    "another store=PATH, or overwrite=True to replace it (a store is resumed "
                    "only by a run with the same model, where=, dtype=, mask= and metadata=)."
                )
            return
        if not create:
            return
        if path.exists() and any(path.iterdir()) and not (path / ".hookax-harvest").exists():
            raise HookaxError(
                f"hx.harvest: {str(path)!r} exists and is not a hookax harvest store (no "
                f"{META}); nothing was written. Fix: give a new or empty store=PATH, or "
                f"overwrite=True to delete what is there."
            )
        if path.exists():  # an earlier creation was interrupted: start again
            shutil.rmtree(path)
        path.mkdir(parents=True)
        (path / ".hookax-harvest").touch()
        Store._create_arrays(path, desc, batch_rows * batches_per_chunk)
        _write_json(meta_file, {**desc, "batches": 0, "rows": 0, "complete": False})

    @staticmethod
    def _create_arrays(path: Path, desc: dict[str, Any], chunk_rows: int) -> None:
        import numpy as np

        ts = import_tensorstore()
        ctx = ts.Context()
        futures = []
        row_axes = desc["row_axes"]
        keys = {"name": "default", "configuration": {"separator": SEPARATOR}}
        specs = [(a["dir"], a["dtype"], a["shape"]) for a in desc["arrays"].values()]
        specs += [("_source", "int64", [1 + row_axes]), ("_batch_end", "int64", None)]
        for d, dtype, shape in specs:
            if shape is None:  # one entry per batch
                full, chunk = [0], [1024]
            else:
                row_bytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
                rows = max(1, min(chunk_rows, CHUNK_BYTES // row_bytes))
                full, chunk = [0, *shape], [rows, *[max(1, d) for d in shape]]
            futures.append(
                ts.open(
                    {**_spec(path / d), "metadata": {"chunk_key_encoding": keys}},
                    create=True,
                    dtype=ts.dtype(dtype),
                    shape=full,
                    chunk_layout=ts.ChunkLayout(chunk_shape=chunk),
                    fill_value=0,
                    context=ctx,
                )
            )
        for f in futures:
            f.result()

    # -- opening ------------------------------------------------------------------------------

    def open(self) -> None:
        ts = self._ts
        names = {name: a["dir"] for name, a in self.meta["arrays"].items()}
        names |= {"_source": "_source", "_batch_end": "_batch_end"}
        futures = {
            n: ts.open(_spec(self.path / d), open=True, context=self.context)
            for n, d in names.items()
        }
        self.arrays = {n: f.result() for n, f in futures.items()}

    def chunks(self, name: str, base: int) -> Any:
        """A :class:`~hookax._harvest.chunks.Chunks` appending the rows of ``name`` after
        ``base`` rows, or None where its chunk files are not plain bytes (then TensorStore
        writes them). Only for a store that one process writes."""
        from .chunks import Chunks, plain

        if name in ("_source", "_batch_end"):
            folder = self.path / name
            shape: tuple[int, ...] = (1 + self.meta["row_axes"],) if name == "_source" else ()
        else:
            folder = self.path / self.meta["arrays"][name]["dir"]
            shape = tuple(self.meta["arrays"][name]["shape"])
        zmeta = json.loads((folder / "zarr.json").read_text())
        if not plain(zmeta, shape):
            return None
        arr = self.arrays[name]
        rows = zmeta["chunk_grid"]["configuration"]["chunk_shape"][0]
        sep = zmeta["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
        out = Chunks(folder, rows, shape, arr.dtype.numpy_dtype, sep, self.fsync)
        out.resume(base, lambda lo, hi: arr[lo:hi].read().result())
        return out

    # -- progress -----------------------------------------------------------------------------

    def committed(self) -> int:
        """Batches committed by every process (the store's valid prefix)."""
        counts = []
        prog = self.path / "progress"
        if prog.is_dir():
            for f in prog.glob("*.json"):
                if (count := _read_progress(f)) is not None:
                    counts.append(count)
        if counts:
            return min(counts)
        return int(json.loads((self.path / META).read_text())["batches"])

    def rows_before(self, batch: int) -> int:
        """Rows of batches ``0 .. batch-1``."""
        if batch == 0:
            return 0
        return int(self.arrays["_batch_end"][batch - 1].read().result())

    def commit(self, batches: int) -> None:
        """Record that this process has written ``batches`` batches. The first commit of a run
        (and every one with ``fsync``) replaces the file by renaming a new one over it; later
        ones rewrite it in place with one ``pwrite`` of the same length (a killed process
        leaves the old or the new text), creating no file: a new file costs more than a batch's
        bytes on a file system where many were just deleted."""
        record = _progress_record(batches)
        if self._progress is not None and not self.fsync:
            os.pwrite(self._progress, record.encode(), 0)
            return
        prog = self.path / "progress"
        prog.mkdir(exist_ok=True)
        path = prog / f"{self.process}.json"
        _write_text(path, record, self.fsync)
        if not self.fsync:
            self._progress = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))

    def close(self) -> None:
        """Close the progress file (the arrays need no closing)."""
        if self._progress is not None:
            os.close(self._progress)
            self._progress = None

    def drop_other_progress(self, processes: int) -> None:
        """Remove progress files of processes that this run does not have."""
        for f in (self.path / "progress").glob("*.json"):
            if not f.stem.isdigit() or int(f.stem) >= processes:
                f.unlink(missing_ok=True)

    # -- growth and the end of a run ----------------------------------------------------------

    def grow(self, sizes: dict[str, int]) -> None:
        """Give each array ``name`` of ``sizes`` room for ``sizes[name]`` rows (all at once). An
        array at least doubles, to four chunks or more (few metadata writes), and never shrinks:
        another process may have written further."""
        while True:
            short = {
                name: arr
                for name, arr in self.arrays.items()
                if name in sizes and arr.domain.exclusive_max[0] < sizes[name]
            }
            if not short:
                return
            futures = {}
            for name, arr in short.items():
                chunk = arr.chunk_layout.read_chunk.shape[0]
                upper = [max(sizes[name], 2 * arr.domain.exclusive_max[0], 4 * chunk)]
                upper += [None] * (arr.rank - 1)
                futures[name] = arr.resize(exclusive_max=upper, expand_only=True)
            for name, f in futures.items():
                try:
                    self.arrays[name] = f.result()
                except ValueError:  # another process grew it further: reopen to see its size
                    again = self._ts.open(short[name].spec(), open=True, context=self.context)
                    self.arrays[name] = again.result()

    def finish(self, batches: int, rows: int) -> None:
        """Shrink the arrays to the rows written, record the counts, drop the progress files."""
        ts = self._ts
        ctx = ts.Context()  # fresh handles: another process may have grown the arrays
        fresh = [ts.open(a.spec(), open=True, context=ctx) for a in self.arrays.values()]
        futures = []
        for name, f in zip(self.arrays, fresh):
            arr = f.result()
            n = batches if name == "_batch_end" else rows
            futures.append(arr.resize(exclusive_max=[n] + [None] * (arr.rank - 1)))
        for f in futures:
            f.result()
        done = {**self.meta, "batches": batches, "rows": rows, "complete": True}
        _write_json(self.path / META, done)
        self.meta = done
        shutil.rmtree(self.path / "progress", ignore_errors=True)


def _spec(path: Path) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
