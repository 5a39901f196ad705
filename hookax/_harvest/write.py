"""The host side of ``hx.harvest``: a writer thread that turns finished batches into rows on disk.

The main thread dispatches a batch's step, starts the device-to-host copy of every shard this
process owns (``copy_to_host_async``) and hands the batch to the writer through a bounded queue;
it then dispatches the next batch while the writer waits for the copies, places the rows and
issues TensorStore's asynchronous writes. The queue's bound is the backpressure: when the disk is
slower than the device, the main thread waits instead of piling batches up in memory.

Rows of a batch go to positions fixed by the batches before it: row ``j`` of the batch (in C
order over its row axes, masked rows skipped) is stored at ``base + j``. A shard this process
owns (``replica_id == 0``) covers a box of the batch; its kept rows are written as runs of
consecutive positions, so a value sharded over devices and processes is never gathered.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._util.errors import HookaxError
from .._util.words import counted
from .faults import fault, is_fault

__all__ = ["Writer", "start_transfers"]

WRITE_THREADS = 4  # threads writing chunk files (each blocks in its O_DIRECT write)


def _owned_shards(x: Any) -> list[Any]:
    return [s for s in x.addressable_shards if s.replica_id == 0]


def start_transfers(values: dict[str, Any], mask: Any) -> None:
    """Start copying to the host every shard this process will write (returns at once)."""
    for v in values.values():
        for s in _owned_shards(v):
            s.data.copy_to_host_async()
    _mask_array(mask).copy_to_host_async()


def _mask_array(mask: Any) -> Any:
    """The whole mask on this host: it is replicated when there are several processes."""
    return mask if mask.is_fully_addressable else mask.addressable_shards[0].data


def _runs(dest: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges of ``dest`` over which it counts up by one."""
    if dest.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(dest) != 1) + 1
    bounds = [0, *cuts.tolist(), dest.size]
    return list(itertools.pairwise(bounds))


class Writer:
    """Writes batches in order; commits each one once its rows are on disk.

    Args:
      store: the open :class:`~hookax._harvest.store.Store`.
      leaves: the stored arrays (:class:`~hookax._harvest.step.Leaf`), by name.
      row_axes: how many leading axes of every value are rows.
      base: rows already committed (the row position of the next batch).
      on_commit: called with ``(batches committed, rows, bytes written)`` after each commit.
      direct: this process is the only one writing: it writes chunk files itself
        (:mod:`hookax._harvest.chunks`) where their format allows.
      batches: batches already committed (``base`` is their rows).
    """

    def __init__(
        self,
        store: Any,
        leaves: dict[str, Any],
        row_axes: int,
        base: int,
        on_commit: Callable[[int, int, int], None],
        direct: bool = False,
        batches: int = 0,
    ) -> None:
        self.store, self.leaves, self.row_axes = store, leaves, row_axes
        self.rows, self.bytes = base, 0
        self.committed = batches  # batches committed in the store
        # the step's outputs: their stored leaves, and the shape of their leading scan axes
        self.sources: dict[str, list[Any]] = {}
        for leaf in leaves.values():
            self.sources.setdefault(leaf.source or leaf.name, []).append(leaf)
        self.stacks = {
            src: tuple(max(lf.index[d] for lf in group) + 1 for d in range(len(group[0].index)))
            for src, group in self.sources.items()
        }
        self.chunks: dict[str, Any] = {}
        if direct:
            starts = {n: base for n in leaves} | {"_source": base, "_batch_end": batches}
            for name, at in starts.items():
                if (chunks := store.chunks(name, at)) is not None:
                    self.chunks[name] = chunks
        self.on_commit = on_commit
        self.error: BaseException | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self.busy = 0.0  # seconds spent writing

    # -- running on a thread ----------------------------------------------------------------

    def start(self, depth: int) -> None:
        self._queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._loop, name="hookax-harvest-writer")
        self._thread.daemon = True
        self._thread.start()

    def put(self, item: tuple[int, dict[str, Any], Any]) -> None:
        """Hand a dispatched batch to the writer (or write it here when not threaded)."""
        if self._thread is None:
            self.write(*item)
            return
        while True:
            self.raise_error()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Wait until every batch handed over is committed; re-raise the writer's error."""
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.put(None, timeout=0.1)
                    break
                except queue.Full:
                    continue
            self._thread.join()
            self._thread = None
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None
        for chunks in self.chunks.values():
            chunks.close()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.write(*item)
            except BaseException as e:
                self.error = e
                return

    # -- one batch ------------------------------------------------------------------------

    def write(self, index: int, values: dict[str, Any], mask: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._write(index, values, mask)
        except HookaxError:
            raise
        except Exception as e:
            if is_fault(e):
                raise fault(self.store.path, e, index, self.committed) from e
            raise HookaxError(
                f"hx.harvest: writing batch {index} to the store {str(self.store.path)!r} "
                f"failed: {type(e).__name__}: {e}. The store is valid: it holds the "
                f"{counted(self.committed, 'batch')} committed before "
                f"({counted(self.rows, 'row')}); the rows of batch {index} are not committed. "
                "Fix the cause, then run again with the same "
                f"arguments: it resumes at batch {self.committed}."
            ) from e
        self.busy += time.perf_counter() - t0

    def _write(self, index: int, values: dict[str, Any], mask: Any) -> None:
        m = np.asarray(_mask_array(mask))
        flat = m.reshape(-1)
        n = int(flat.sum())
        for source, value in values.items():
            self._check(index, source, value, m.shape)
        # chunk files first (on the pool's threads), then the metadata and TensorStore's writes
        pending = [
            self._pool().submit(self._write_rows, self.chunks[leaf.name], leaf, value, flat, n)
            for source, value in values.items()
            for leaf in self.sources.get(source, ())
            if n and leaf.name in self.chunks
        ]
        futures: list[Any] = []
        keep: list[Any] = []  # the buffers, alive until their writes are done
        try:
            sizes = {name: self.rows + n for name in self.leaves} if n else {}
            if self.store.process == 0:
                sizes |= {"_batch_end": index + 1, "_source": self.rows + n}
            self.store.grow(sizes)
            if self.store.process == 0:
                futures += self._write_source(index, m, n)
            pos = self.rows + np.cumsum(flat) - 1
            for source, value in values.items() if n else ():
                for leaf in self.sources.get(source, ()):
                    if leaf.name in self.chunks:
                        continue
                    arr = self.store.arrays[leaf.name]
                    for shard in _owned_shards(value):
                        futures += self._write_shard(arr, leaf, shard, m.shape, flat, pos, keep)
            for f in futures:
                f.result()
        finally:  # every write ends before the batch is committed or its error reported
            concurrent.futures.wait(pending)
        for f in pending:
            self.bytes += f.result()
        self.rows += n
        self.store.commit(index + 1)
        self.committed = index + 1
        self.on_commit(index + 1, self.rows, self.bytes)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(
                min(WRITE_THREADS, len(self.chunks)), thread_name_prefix="hookax-harvest-chunks"
            )
        return self._threads

    def _check(self, index: int, source: str, value: Any, rows: tuple[int, ...]) -> None:
        if source not in self.sources:  # a scan of length 0: nothing to store
            return
        leaf = self.sources[source][0]
        want = self.stacks[source] + rows + leaf.shape
        if tuple(value.shape) != want:
            raise HookaxError(
                f"hx.harvest: batch {index} gives call site output {source!r} of shape "
                f"{tuple(value.shape)}, but the store holds rows of shape "
                f"{leaf.shape} (expected {want} for this batch's rows {rows}). "
                f"Batches may differ in their row axes only. Nothing of batch {index} was "
                f"committed. Fix: give batches of the same per-row shape."
            )

    def _write_rows(self, chunks: Any, leaf: Any, value: Any, flat: np.ndarray, n: int) -> int:
        """The kept rows of a leaf of a value this process holds whole, into their chunk
        files; returns the bytes of those rows."""
        data = np.asarray(value)[leaf.index]  # one process: every shard is on this host
        data = data.reshape(-1, *leaf.shape)
        if n < len(data):
            data = data[flat]
        chunks.write(data)
        return int(data.nbytes)

    def _write_shard(
        self,
        arr: Any,
        leaf: Any,
        shard: Any,
        rows: tuple[int, ...],
        flat: np.ndarray,
        pos: np.ndarray,
        keep: list[Any],
    ) -> list[Any]:
        """The kept rows of ``leaf`` in one shard of its value, as runs of consecutive rows."""
        k, s = self.row_axes, len(leaf.index)
        index = shard.index
        stack = [sl.indices(d) for sl, d in zip(index[:s], self.stacks[leaf.source or leaf.name])]
        if any(not (a <= i < b) for (a, b, _), i in zip(stack, leaf.index)):
            return []  # this shard holds other layers
        data = np.asarray(shard.data)
        if s:
            data = data[tuple(i - a for (a, _, _), i in zip(stack, leaf.index))]
        index = index[s:]
        ranges = [np.arange(*sl.indices(d)) for sl, d in zip(index[:k], rows)]
        ids = np.ravel_multi_index(tuple(np.meshgrid(*ranges, indexing="ij")), rows).reshape(-1)
        data = data.reshape(-1, *data.shape[k:])
        kept = flat[ids]
        if not kept.all():
            data, ids = data[kept], ids[kept]
        dest = pos[ids]
        feat = tuple(index[k:])
        out = []
        keep.append(data)
        for a, b in _runs(dest):
            out.append(arr[(slice(int(dest[a]), int(dest[b - 1]) + 1), *feat)].write(data[a:b]))
            self.bytes += data[a:b].nbytes
        return out

    def _write_source(self, index: int, m: np.ndarray, n: int) -> list[Any]:
        """Process 0 records where each row came from, and where the batch ends."""
        end = self.rows + n
        out = []
        parts = {"_batch_end": np.array([end], np.int64)}
        if n:
            where = np.argwhere(m).astype(np.int64)
            parts["_source"] = np.concatenate([np.full((n, 1), index, np.int64), where], axis=1)
        for name, rows in parts.items():
            if name in self.chunks:
                self.chunks[name].write(rows)
            else:
                first = index if name == "_batch_end" else self.rows
                out.append(self.store.arrays[name][first : first + len(rows)].write(rows))
        return out
