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

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from .._util.errors import HookaxError, StoreError
from .faults import fault

__all__ = ["FORMAT", "Store", "check_path", "committed_batches", "import_tensorstore"]

FORMAT = "hookax.harvest/1"
META = "hookax.json"
MARKER = ".hookax-harvest"  # written first when a store is created
# what hookax writes at the top of a store, besides one folder per stored array
_OWN = {META, MARKER, "progress", "_source", "_batch_end"}
_TMP = re.compile(r"^\..+\.\d+\.tmp$")  # _write_text's temporary files
CHUNK_BYTES = 16 << 20  # the most bytes of one chunk
PROGRESS_BYTES = 64  # the length of a progress file
SEPARATOR = "."  # chunk keys c.0.0: a chunk is one file, not also a folder


def import_tensorstore() -> Any:
    try:
        import tensorstore as ts
    except ImportError as e:  # pragma: no cover - tensorstore comes with flax
        from .._util.extras import install_command

        raise HookaxError(
            "hx.harvest writes its store with TensorStore, which is not installed. "
            f"Fix: {install_command('harvest')} (or pip install tensorstore)."
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
        kind = check_path(path, overwrite=overwrite)  # before anything is touched
        if create and kind == "store" and overwrite:
            # Replace only what hookax wrote, the description first: from then on the folder is
            # a store whose creation was interrupted (the marker stays), which a crash leaves
            # for the next run to start again, never a half-deleted store that looks complete.
            meta_file.unlink(missing_ok=True)
            _remove_hookax_entries(path)
        elif create and kind == "store":  # files left by a process killed while writing them
            for tmp in [*path.glob(".*.tmp"), *path.glob("progress/.*.tmp")]:
                if _TMP.match(tmp.name):
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
        if kind == "store":  # an earlier creation was interrupted: start again
            _remove_hookax_entries(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / MARKER).touch()
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
        return committed_batches(self.path)

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
            if f.stem.isdigit() and int(f.stem) >= processes:
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


def committed_batches(path: Path) -> int:
    """Batches committed by every process in the store ``path`` (its valid prefix); reads only
    its small files (no TensorStore)."""
    counts = []
    prog = path / "progress"
    if prog.is_dir():
        for f in prog.glob("*.json"):
            if (count := _read_progress(f)) is not None:
                counts.append(count)
    if counts:
        return min(counts)
    return int(json.loads((path / META).read_text())["batches"])


def check_path(path: Path, *, overwrite: bool) -> str:
    """What ``path`` is, for a harvest about to write there: ``"new"`` (absent), ``"empty"``,
    ``"store"`` (a hookax store, holding only what hookax writes); anything else raises
    :class:`HookaxError` naming the path and what is in it, with every file left as it was.

    A folder that holds the current folder or the home folder (``.``, ``~``, ``/``) is refused
    whatever it holds: a store is a folder of its own.
    """
    here, home = Path.cwd().resolve(), Path.home().resolve()
    full = path.expanduser().resolve()
    for name, place in (("the current folder", here), ("your home folder", home)):
        if full == place or place.is_relative_to(full):
            what = name if full == place else f"a folder above {name}"
            raise HookaxError(
                f"hx.harvest: store={str(path)!r} is {what}; a store is a folder of its own, "
                f"and hookax never writes or deletes files there. Nothing was written. Fix: "
                f"store={str(path / 'acts.zarr')!r} (a new folder)."
            )
    if not path.exists() and not path.is_symlink():
        _check_creatable(path)
        return "new"
    if not path.is_dir():
        raise StoreError(
            f"hx.harvest: store={str(path)!r} is a file, not a folder. Nothing was written. Fix: "
            f"give the path of a new folder."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise fault(path, _not_writable(path), 0, 0, before=True)
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return "empty"
    if (path / MARKER).exists() or _is_store_meta(path / META):
        foreign = [e for e in entries if not _hookax_entry(path, e)]
        if not foreign or not overwrite:
            return "store"
        raise HookaxError(
            f"hx.harvest: store={str(path)!r} is a hookax store that also holds files hookax "
            f"did not write ({_listing(foreign)}); overwrite=True replaces only what hookax "
            f"wrote, so nothing was deleted or written. Fix: move those files out, or give "
            f"another store=PATH."
        )
    raise HookaxError(
        f"hx.harvest: store={str(path)!r} is a folder that is not a hookax store (it holds "
        f"{_listing(entries)}); hookax writes only into a new folder, an empty one, or a store "
        f"of its own, and overwrite=True replaces only those. Nothing was written or deleted. "
        f"Fix: give a new store=PATH (for example {str(path / 'acts.zarr')!r})."
    )


def _check_creatable(path: Path) -> None:
    """Refuse, before any work, a new store that cannot be created: a file on its path, or a
    folder above it that this process may not write."""
    above = path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        e = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(above))
        raise fault(path, e, 0, 0, before=True)
    if not os.access(above, os.W_OK | os.X_OK):
        raise fault(path, _not_writable(above), 0, 0, before=True)


def _not_writable(folder: Path) -> OSError:
    """The error that writing into ``folder`` would meet (``os.access`` said it would fail)."""
    read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    code = errno.EROFS if read_only else errno.EACCES
    return OSError(code, os.strerror(code), str(folder))


def _listing(names: list[str], most: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: {shown}{more}"


def _is_store_meta(meta: Path) -> bool:
    try:
        return json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _hookax_entry(path: Path, name: str) -> bool:
    """Whether ``path/name`` is something a hookax store holds: its description, marker,
    progress, a temporary file of its own, or an array folder (a zarr v3 ``zarr.json``)."""
    entry = path / name
    if name in _OWN or _TMP.match(name):
        return True
    return entry.is_dir() and not entry.is_symlink() and (entry / "zarr.json").is_file()


def _remove_hookax_entries(path: Path) -> None:
    """Delete what hookax wrote in the store ``path`` (never anything else) but its marker."""
    for entry in path.iterdir():
        if entry.name == MARKER or not _hookax_entry(path, entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


def _spec(path: Path) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
