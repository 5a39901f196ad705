"""``hx.StoreReader``: shuffled, multi-epoch, resumable batches of rows of a harvest store.

Why a window shuffle. A zarr chunk is one file; reading part of it reads all of it, so drawing
rows at random from disk runs at 2-12% of a plain read (measured, DESIGN.md point 20). The reader
instead cuts the rows into *blocks* (one chunk of the stored arrays each), puts the blocks in a
seeded order, reads ``window_rows`` rows' worth of blocks at once (one TensorStore read per name
into one buffer: ``ts.concat`` of the blocks), permutes the window's rows in memory and gathers
each batch with one ``np.take``. The next window is read on a thread while the current one is
served. A row's neighbours in a batch are drawn from the whole window (>= 100k rows by default),
not from its own sequence.

Why grain. It is the JAX ecosystem's data loader: its ``MapDataset`` gives the iterator state
(``{"next_index": i}``) for resuming, and its read threads compute batches ahead of the caller and
put them on the device while the caller's step runs. Its elements here are whole batches: grain's
per-row path is 30-100x too slow for activation rows (DESIGN.md point 20).

The order is a function of ``(seed, epoch, batch)`` only: batch ``i`` is the same in every run,
after a restore, and whatever the prefetching did, so resuming is setting grain's next index.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._util.errors import HookaxError
from .._util.words import counted
from .opened import ActivationStore, open_store

__all__ = ["StoreReader"]

WINDOW_ROWS = 131072  # rows read and permuted together (>= ~100k: DESIGN.md point 20)
KEEP_WINDOWS = 3  # windows held in memory: the one served, the next, and one being read


class _Windows:
    """The epoch's layout: blocks in seeded order, grouped into windows, each one permuted."""

    def __init__(self, rows: int, block: int, window_blocks: int, seed: int) -> None:
        self.rows, self.block, self.window_blocks, self.seed = rows, block, window_blocks, seed
        self.blocks = math.ceil(rows / block)

    def order(self, epoch: int) -> list[np.ndarray]:
        """Each window's blocks in epoch ``epoch``."""
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.blocks)
        return [perm[i : i + self.window_blocks] for i in range(0, self.blocks, self.window_blocks)]

    def sizes(self, blocks: np.ndarray) -> np.ndarray:
        return np.minimum(self.block, self.rows - blocks * self.block)


class _Buffers:
    """Window buffers, reused once nothing refers to them any more.

    A buffer is 64-byte aligned: ``jax.device_put`` on a CPU then uses it in place (measured:
    0.2 ms instead of 115 ms for 200 MB). It is reused because fresh memory costs a page fault
    a page: on this project's VM, filling 200 MB of fresh pages took 0.35 s, of reused ones
    0.02 s. A buffer is free when the pool holds the only reference to it (the device array
    made from it, and every view, hold one until they are gone).
    """

    def __init__(self, keep: int) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep
        self._lock = threading.Lock()

    def get(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = None
        with self._lock:
            for i in range(len(self._free)):
                # references: the list, the call's argument (nothing else: free)
                if self._free[i].size >= n + 64 and sys.getrefcount(self._free[i]) == 2:
                    raw = self._free[i]
                    break
            if raw is None:
                raw = np.empty(n + 64 + n // 8, np.uint8)  # room for a larger window later
                if len(self._free) < self._keep:
                    self._free.append(raw)
        start = (-raw.ctypes.data) % 64
        return raw[start : start + n].view(dtype).reshape(shape)


def _take(window: Any, idx: np.ndarray) -> Any:
    """Rows ``idx`` of a device window: one jitted gather (compiled once per window shape)."""
    import jax
    import jax.numpy as jnp

    global _TAKE
    if _TAKE is None:
        _TAKE = jax.jit(lambda w, i: jnp.take(w, i, axis=0, mode="clip"))
    return _TAKE(window, jnp.asarray(idx, jnp.int32))


def _take2(first: Any, second: Any, a: np.ndarray, b: np.ndarray) -> Any:
    """Rows ``a`` of ``first`` then rows ``b`` of ``second`` (a batch across a window's end).
    Both gathers have the batch's length and a select joins them: the program's shapes do not
    depend on where the window ends, so it compiles once per pair of window shapes."""
    import jax
    import jax.numpy as jnp

    global _TAKE2
    if _TAKE2 is None:

        def both(w1: Any, w2: Any, i1: Any, i2: Any, n1: Any) -> Any:
            rows = jnp.arange(i1.shape[0]) < n1
            x1, x2 = jnp.take(w1, i1, axis=0, mode="clip"), jnp.take(w2, i2, axis=0, mode="clip")
            return jnp.where(rows.reshape(-1, *[1] * (x1.ndim - 1)), x1, x2)

        _TAKE2 = jax.jit(both)
    n = len(a) + len(b)
    i1, i2 = np.zeros(n, np.int32), np.zeros(n, np.int32)
    i1[: len(a)], i2[len(a) :] = a, b
    return _TAKE2(first, second, i1, i2, np.int32(len(a)))


_TAKE: Any = None
_TAKE2: Any = None


def _slicer(v: np.ndarray) -> Any:
    return lambda index: v[index]


class _ChunkFiles:
    """Whole chunks of one array read straight from their files into the window's buffer.

    Where the chunks are plain bytes (hx.harvest's stores: uncompressed, little-endian, one
    chunk across the features) and a block is one chunk, a chunk is one ``readinto`` of its
    file: measured on this project's VM, 2.5 M rows/s against 0.8-1.3 M for TensorStore reading
    the same chunks in a shuffled order (1.9-3 M for all chunks in order). Any other layout is
    read through TensorStore.
    """

    def __init__(self, folder: Path, sep: str, suffix: str, shape: tuple[int, ...], dtype: Any):
        self.folder, self.sep, self.suffix = folder, sep, suffix
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.row_bytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize

    @classmethod
    def of(cls, store: ActivationStore, name: str, block: int) -> _ChunkFiles | None:
        import json

        from .chunks import plain

        folder = store.path / store.metadata["arrays"][name]["dir"]
        meta = json.loads((folder / "zarr.json").read_text())
        shape = store.shapes[name]
        if not plain(meta, shape) or meta["chunk_grid"]["configuration"]["chunk_shape"][0] != block:
            return None
        sep = meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
        return cls(folder, sep, f"{sep}0" * len(shape), shape, store.dtypes[name])

    def read(
        self, blocks: np.ndarray, sizes: np.ndarray, rows: int, buffers: _Buffers
    ) -> np.ndarray:
        out = buffers.get((rows, *self.shape), self.dtype)
        raw = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        ends = np.cumsum([0, *(sizes * self.row_bytes).tolist()]).tolist()
        jobs = [
            _file_readers().submit(self._read_chunk, int(k), raw[ends[i] : ends[i + 1]])
            for i, k in enumerate(blocks.tolist())
        ]
        for job in jobs:
            job.result()
        return out

    def _read_chunk(self, k: int, view: memoryview) -> None:
        want = len(view)
        try:
            with open(self.folder / f"c{self.sep}{k}{self.suffix}", "rb", buffering=0) as f:
                got = 0
                while got < want and (n := f.readinto(view[got:])):
                    got += n
        except FileNotFoundError:  # a chunk never written holds the fill value
            got = 0
        if got < want:
            view[got:] = bytes(want - got)


_READERS: list[concurrent.futures.ThreadPoolExecutor] = []


def _file_readers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads reading chunk files (each blocks in its read; four keep the disk and the
    copies busy), shared by every reader, started by the first."""
    with _READERS_LOCK:
        if not _READERS:
            _READERS.append(concurrent.futures.ThreadPoolExecutor(4, "hookax-reader-files"))
        return _READERS[0]


_READERS_LOCK = threading.Lock()


class StoreReader:
    """Batches of rows of one or several stored call sites, shuffled, for a training loop.

    Each epoch yields every committed row exactly once (``drop_remainder=False``; otherwise the
    last partial batch is left out), in an order fixed by ``seed`` and the epoch. With several
    names the arrays stay aligned: row ``j`` of every array of a batch is the same token.
    Batches are device arrays (``sharding=`` places them, e.g. rows split over a mesh axis),
    computed ahead on grain's threads while the caller computes. ``get_state()`` /
    ``set_state()`` save and restore the position: a restored reader yields exactly the batches
    the saved one would have.

    Memory: three windows of rows for every name (``window_rows`` rows each: the one served, the
    next, and one read ahead or kept across a batch), and up to two more buffers kept for reuse,
    plus ``prefetch`` batches. The default window (131,072 rows) of 768 bfloat16 features is
    201 MB per name and window. On a CPU the windows are device arrays without a copy; on an
    accelerator they are copied to its memory once each, and batches are gathered there.

    Args:
      store: a store's folder or an [`hx.ActivationStore`][hookax.ActivationStore]
        ([`hx.open_store`][hookax.open_store]).
      names: a name (batches are arrays) or a sequence of names (batches are dicts).
      batch_size: rows per batch.
      seed: the shuffle's seed.
      epochs: epochs to yield; ``None`` for no end.
      window_rows: rows read and shuffled together (rounded up to whole blocks). More mixes
        better and holds more memory; the whole store makes a full shuffle.
      block_rows: rows of one block, the unit the order shuffles; default the largest chunk of
        the names' arrays (a block that is part of a chunk reads the whole chunk). The order
        depends on it: give it to read stores chunked differently in the same order.
      drop_remainder: leave out the last batch of an epoch when it is short (every batch has
        one shape: a jitted step compiles once).
      sharding: a ``jax.sharding.Sharding`` for every batch; default the first device. With
        several JAX processes every process builds the same reader: each reads the windows,
        gathers every batch on the host and places its own part of it.
      prefetch: batches computed ahead of the caller.
      threads: grain's threads computing those batches.

    Raises:
      HookaxError: the store is being written (or was interrupted), holds no such name, or has
        fewer rows than ``batch_size``.
      MissingExtraError: grain is not installed (the message names the install of the
        ``data`` extra).

    Examples:
      >>> import tempfile, jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)))
      >>> path = tempfile.mkdtemp() + "/acts"
      >>> data = [jnp.arange(12.0).reshape(3, 4) + i for i in range(4)]
      >>> _ = hx.harvest(model, data, where="layers/0", store=path)
      >>> reader = hx.StoreReader(path, "layers/0", batch_size=4, seed=0, epochs=1)
      >>> len(reader), next(reader).shape
      (3, (4, 8))
      >>> state = reader.get_state()
      >>> rest = [np.asarray(b) for b in reader]
      >>> again = hx.StoreReader(path, "layers/0", batch_size=4, seed=0, epochs=1)
      >>> again.set_state(state)
      >>> all((np.asarray(a) == b).all() for a, b in zip(again, rest))
      True
    """

    def __init__(
        self,
        store: str | Path | ActivationStore,
        names: str | Sequence[str],
        batch_size: int,
        *,
        seed: int = 0,
        epochs: int | None = None,
        window_rows: int = WINDOW_ROWS,
        block_rows: int | None = None,
        drop_remainder: bool = True,
        sharding: Any = None,
        prefetch: int = 4,
        threads: int = 2,
    ) -> None:
        from .._util.extras import require

        require("grain", "data", "hx.StoreReader")
        self.store = store if isinstance(store, ActivationStore) else open_store(store)
        self._single = isinstance(names, str)
        self.names: tuple[str, ...] = (names,) if isinstance(names, str) else tuple(names)
        self._check(batch_size, epochs, window_rows)
        self.batch_size, self.seed, self.epochs = batch_size, seed, epochs
        self.window_rows, self.drop_remainder, self.sharding = window_rows, drop_remainder, sharding
        rows = self.store.rows
        self.steps_per_epoch = rows // batch_size if drop_remainder else -(-rows // batch_size)
        block = block_rows or max(self.store.chunk_rows(n) for n in self.names)
        self.block_rows = block
        self._layout = _Windows(rows, block, max(1, -(-window_rows // block)), seed)
        self._arrays = {n: self.store.array(n) for n in self.names}
        self._buffers = _Buffers((KEEP_WINDOWS + 2) * len(self.names))
        self._on_device = sharding is None or sharding.is_fully_addressable
        self._device = None if sharding is None else next(iter(sharding.addressable_devices))
        self._files = {n: f for n in self.names if (f := _ChunkFiles.of(self.store, n, block))}
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[int, int], concurrent.futures.Future[Any]]
        self._cache = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hookax-reader")
        self._epoch_cache: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
        self._prefetch, self._threads = prefetch, threads
        self._start(0)

    def _check(self, batch_size: int, epochs: int | None, window_rows: int) -> None:
        s = self.store
        if not s.complete:
            raise HookaxError(
                f"hx.StoreReader: the store {str(s.path)!r} is being written, or its harvest "
                f"was interrupted ({counted(s.batches, 'batch')} committed, not complete). "
                "Fix: let the harvest finish, or run it again to resume and complete it; then "
                "read it."
            )
        missing = [n for n in self.names if n not in s.names]
        if missing or not self.names:
            raise HookaxError(
                f"hx.StoreReader: the store {str(s.path)!r} holds no {missing or 'names'!r}; "
                f"it holds {', '.join(map(repr, s.names))}."
            )
        if batch_size < 1 or batch_size > s.rows:
            raise HookaxError(
                f"hx.StoreReader: batch_size={batch_size} but the store {str(s.path)!r} holds "
                f"{counted(s.rows, 'row')}. Fix: a batch_size from 1 to {s.rows}, or harvest "
                "more batches."
            )
        if epochs is not None and epochs < 1:
            raise HookaxError(f"hx.StoreReader: epochs must be >= 1 or None, got {epochs}")
        if window_rows < 1:
            raise HookaxError(f"hx.StoreReader: window_rows must be >= 1, got {window_rows}")

    # -- the order -------------------------------------------------------------------------------

    def _epoch(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The windows' blocks and their first positions in the epoch's order."""
        with self._lock:
            hit = self._epoch_cache.get(epoch)
            if hit is None:
                windows = self._layout.order(epoch)
                sizes = [int(self._layout.sizes(w).sum()) for w in windows]
                hit = windows, np.cumsum([0, *sizes])
                self._epoch_cache = {
                    epoch: hit,
                    **{k: v for k, v in self._epoch_cache.items() if k == epoch - 1},
                }
        return hit

    def _read_window(self, epoch: int, j: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        windows, starts = self._epoch(epoch)
        blocks = np.sort(windows[j])  # in file order: the same rows, the permutation is below
        n = int(starts[j + 1] - starts[j])
        futures = {}
        for name, arr in self._arrays.items():
            files = self._files.get(name)
            if files is None:
                futures[name] = self._ts_read(arr, blocks)
            else:
                futures[name] = files.read(blocks, self._layout.sizes(blocks), n, self._buffers)
        data = {name: f if isinstance(f, np.ndarray) else f.result() for name, f in futures.items()}
        if self._on_device:  # on a CPU, an aligned buffer becomes a device array without a copy
            import jax

            data = {name: jax.device_put(v, self._device) for name, v in data.items()}
        perm = np.random.default_rng([self.seed, epoch, j]).permutation(n)
        return data, perm

    def _ts_read(self, arr: Any, blocks: np.ndarray) -> Any:
        """One TensorStore read of the blocks, concatenated (a future)."""
        import tensorstore as ts

        b, rows = self._layout.block, self._layout.rows
        parts = [arr[int(k) * b : min((int(k) + 1) * b, rows)] for k in blocks]
        return (parts[0] if len(parts) == 1 else ts.concat(parts, axis=0)).read()

    def _window(self, epoch: int, j: int) -> concurrent.futures.Future[Any]:
        """Window ``j`` of ``epoch``, read (or being read) on the reader's thread; the next
        window is started as well."""
        key = (epoch, j)
        nxt = (epoch, j + 1) if j + 1 < len(self._epoch(epoch)[0]) else (epoch + 1, 0)
        last = self.epochs is not None and nxt[0] >= self.epochs
        with self._lock:
            for k in (key,) if last else (key, nxt):
                if k not in self._cache:
                    self._cache[k] = self._pool.submit(self._read_window, *k)
                self._cache.move_to_end(k)
            while len(self._cache) > KEEP_WINDOWS:
                self._cache.popitem(last=False)
            return self._cache[key]

    def rows_of(self, index: int) -> np.ndarray:
        """The store's row numbers of batch ``index`` (counted from the first epoch's first)."""
        epoch, b = divmod(index, self.steps_per_epoch)
        windows, starts = self._epoch(epoch)
        lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, self._layout.rows)
        out = []
        for j in range(int(np.searchsorted(starts, lo, "right")) - 1, len(windows)):
            if starts[j] >= hi:
                break
            blocks = np.sort(windows[j])
            rows = np.concatenate(
                [
                    np.arange(k * self._layout.block, k * self._layout.block + s)
                    for k, s in zip(blocks, self._layout.sizes(blocks))
                ]
            )
            perm = np.random.default_rng([self.seed, epoch, j]).permutation(len(rows))
            part = perm[max(lo - starts[j], 0) : hi - starts[j]]
            out.append(rows[part])
        return np.concatenate(out)

    def _pieces(self, index: int) -> list[tuple[dict[str, Any], np.ndarray]]:
        """Batch ``index`` as (window, rows of it) pairs: one, or two across a window's end."""
        epoch, b = divmod(index, self.steps_per_epoch)
        _, starts = self._epoch(epoch)
        lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, self._layout.rows)
        out = []
        j = int(np.searchsorted(starts, lo, "right")) - 1
        while j < len(starts) - 1 and starts[j] < hi:
            data, perm = self._window(epoch, j).result()
            out.append((data, perm[max(lo - starts[j], 0) : hi - starts[j]]))
            j += 1
        return out

    def _batch(self, index: int) -> Any:
        import jax
        import jax.numpy as jnp

        pieces = self._pieces(index)
        if self._on_device:  # windows are on the device: one gather there
            out = {}
            for n in self.names:
                if len(pieces) == 1:
                    v = _take(pieces[0][0][n], pieces[0][1])
                elif len(pieces) == 2:
                    (d1, i1), (d2, i2) = pieces
                    v = _take2(d1[n], d2[n], i1, i2)
                else:  # windows smaller than a batch (compiles per piece length: slow)
                    v = jnp.concatenate([_take(d[n], i) for d, i in pieces])
                out[n] = v if self.sharding is None else jax.device_put(v, self.sharding)
        else:  # several processes: every process gathers the batch, and places its part
            out = {}
            for n in self.names:
                host = [np.take(data[n], idx, axis=0) for data, idx in pieces]
                v = host[0] if len(host) == 1 else np.concatenate(host)
                out[n] = jax.make_array_from_callback(v.shape, self.sharding, _slicer(v))
        return out[self.names[0]] if self._single else out

    # -- iteration and state ---------------------------------------------------------------------

    def _total(self) -> int:
        return (1 << 62) if self.epochs is None else self.epochs * self.steps_per_epoch

    def _start(self, index: int) -> None:
        import grain

        ds = grain.MapDataset.range(self._total()).map(self._batch)
        options = grain.ReadOptions(num_threads=self._threads, prefetch_buffer_size=self._prefetch)
        with self._lock:  # windows read ahead for the old position
            for f in self._cache.values():
                f.cancel()
            self._cache.clear()
        self._it = iter(ds.to_iter_dataset(options))
        if index:
            self._it.set_state({"next_index": index})
        self._index = index

    def __iter__(self) -> StoreReader:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self._index += 1
        return batch

    def __len__(self) -> int:
        """Batches left to yield (``epochs`` given)."""
        if self.epochs is None:
            raise TypeError("hx.StoreReader(epochs=None) has no length: it does not end")
        return self._total() - self._index

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self._index // self.steps_per_epoch

    def get_state(self) -> dict[str, Any]:
        """The position, JSON-serialisable: save it with a checkpoint."""
        return {
            "next_batch": self._index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "rows": self.store.rows,
            "window_rows": self.window_rows,
            "block_rows": self.block_rows,
            "names": list(self.names),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a [`get_state`][hookax.StoreReader.get_state] of a reader with the same
        arguments."""
        mine = self.get_state()
        diff = [k for k in mine if k != "next_batch" and state.get(k) != mine[k]]
        if diff:
            got = ", ".join(f"{k}={state.get(k)!r} (this reader: {mine[k]!r})" for k in diff)
            raise HookaxError(
                f"hx.StoreReader.set_state: the state was saved by a reader of other "
                f"arguments: {got}. Fix: build the reader with the arguments it was saved with."
            )
        self._start(int(state["next_batch"]))

    def close(self) -> None:
        """Stop the reading threads (also at garbage collection)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return (
            f"StoreReader({str(self.store.path)!r}, {list(self.names)}, batch_size="
            f"{self.batch_size}, seed={self.seed}, "
            f"{counted(self.steps_per_epoch, 'batch')} an epoch)"
        )
