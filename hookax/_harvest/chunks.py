"""Appending rows to ``hx.harvest``'s arrays by writing their zarr v3 chunk files directly.

Why not through TensorStore: its writes go through the page cache, which copies every byte into
freshly allocated pages. On the 2-core VM this project is measured on, that kernel work is 0.25 to
0.5 CPU-seconds per 268 MB (a fifth to a third of the forward pass's CPU time in
``python -m benchmarks harvest``), and a chunk that several batches fill is read and rewritten
once per batch. A harvest never reads back what it writes, so this module writes with
``O_DIRECT`` (the device reads the bytes from our buffer: 0.02 CPU-seconds for the same 268 MB),
and each batch writes only the blocks its rows touch.

It serves arrays whose chunk files are the chunk's bytes as they are (codec ``bytes``, little
endian, no compression), whose chunks span whole rows and whose chunk keys are zarr v3's default
encoding (``c.<row chunk>.0``, or with ``/``): the arrays :class:`~hookax._harvest.store.Store`
creates. Any zarr v3 reader reads them. Only one process may write such an array (several
processes write through TensorStore, whose file driver locks each chunk's read-modify-write).

A chunk's file is created at its full size (a sparse file: zeros, the fill value, past what is
written). Rows arrive in order; a write covers the aligned blocks from the one holding its first
row to the one holding its last, the bytes of earlier rows in the first block coming from the
previous write (kept in memory) and the rest of the last block being zeros. Bytes of committed
rows are rewritten only with themselves, so a write killed half way leaves them intact; a resumed
run cuts off whatever a killed run left after the committed rows, so it ends identical.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Chunks", "plain"]

BLOCK = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a multiple of any device's)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_KEEP_BYTES = 64 << 20  # staging buffers kept for later runs (their pages are already mapped)


def plain(meta: dict[str, Any], row_shape: tuple[int, ...]) -> bool:
    """Whether a zarr v3 array's ``zarr.json`` describes chunks this module can write."""
    grid = meta.get("chunk_grid", {})
    keys = meta.get("chunk_key_encoding", {})
    codecs = meta.get("codecs", [])
    raw = len(codecs) == 1 and codecs[0].get("name") == "bytes"
    little = raw and codecs[0].get("configuration", {}).get("endian", "little") == "little"
    chunk = grid.get("configuration", {}).get("chunk_shape", [])
    return (
        little
        and grid.get("name") == "regular"
        and keys.get("name") == "default"
        and keys.get("configuration", {}).get("separator", "/") in ("/", ".")
        and list(chunk[1:]) == [max(1, d) for d in row_shape]
        and meta.get("fill_value") in (0, 0.0, False)
        and not meta.get("storage_transformers")
    )


def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    return os.pwrite(fd, data, offset)


class _Buffers:
    """Page-aligned staging buffers, kept between runs up to ``_KEEP_BYTES``: fresh pages cost
    a page fault each (on a VM, several times the cost of the copy into them)."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self, size: int) -> mmap.mmap:
        with self._lock:
            fits = [m for m in self._free if len(m) >= size]
            if fits:
                m = min(fits, key=len)
                self._free.remove(m)
                return m
        return mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)

    def put(self, m: mmap.mmap) -> None:
        with self._lock:
            self._free.append(m)
            self._free.sort(key=len, reverse=True)
            while sum(map(len, self._free)) > _KEEP_BYTES:
                self._free.pop().close()


_BUFFERS = _Buffers()


class Chunks:
    """Appends rows to one array's chunk files.

    Args:
      folder: the array's folder (holding ``zarr.json``).
      chunk_rows: rows per chunk.
      row_shape: the per-row shape.
      dtype: the stored numpy dtype.
      separator: the chunk keys' separator (``c/0/0`` or ``c.0.0``).
      fsync: ``fdatasync`` every chunk file after writing it.
    """

    def __init__(
        self,
        folder: Path,
        chunk_rows: int,
        row_shape: tuple[int, ...],
        dtype: Any,
        separator: str = "/",
        fsync: bool = False,
    ) -> None:
        self.folder, self.rows, self.fsync = folder, chunk_rows, fsync
        self.row_bytes = math.prod(row_shape) * np.dtype(dtype).itemsize
        self.nbytes = chunk_rows * self.row_bytes
        self.direct = bool(_O_DIRECT) and self.nbytes % BLOCK == 0
        self.separator, self.suffix = separator, f"{separator}0" * len(row_shape)
        self._head = b""  # the bytes of the last block written, up to the last row
        self._next = 0  # the row position the next write starts at
        self._mem: mmap.mmap | None = None

    def resume(self, base: int, read: Callable[[int, int], Any]) -> None:
        """Continue after ``base`` rows: ``read(lo, hi)`` gives rows already stored. Cuts
        off what the chunk's file holds after them (a killed run's rows)."""
        self._next = base
        lo = base % self.rows
        if lo == 0:
            return
        at = lo * self.row_bytes
        block = at - at % BLOCK
        first = block // self.row_bytes  # the first row with bytes in that block
        rows = np.ascontiguousarray(read(base - lo + first, base)).reshape(-1).view(np.uint8)
        self._head = rows.tobytes()[block - first * self.row_bytes :]
        path = self._path((base - lo) // self.rows)
        if path.exists():
            with open(path, "r+b") as f:
                f.truncate(-(-at // BLOCK) * BLOCK)
                f.truncate(self.nbytes)

    def write(self, rows: Any) -> None:
        """Append ``rows`` (a ``(n, *row_shape)`` array): every chunk they touch is written
        before this returns."""
        data = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
        done = 0
        while done < len(data):
            lo = self._next % self.rows
            k = min(self.rows - lo, (len(data) - done) // self.row_bytes)
            part = data[done : done + k * self.row_bytes]
            self._write_file(self._next // self.rows, lo * self.row_bytes, part)
            self._next += k
            done += len(part)

    def close(self) -> None:
        """Give the staging buffer back for later runs."""
        if self._mem is not None:
            _BUFFERS.put(self._mem)
            self._mem = None

    def _path(self, index: int) -> Path:
        return self.folder / f"c{self.separator}{index}{self.suffix}"

    def _write_file(self, index: int, at: int, data: np.ndarray) -> None:
        """Write ``data`` at byte ``at`` of chunk ``index``, as whole blocks."""
        block = at - at % BLOCK
        end = at + len(data)
        stop = min(self.nbytes, -(-end // BLOCK) * BLOCK)
        size = stop - block
        if self._mem is None or len(self._mem) < size:
            if self._mem is not None:
                _BUFFERS.put(self._mem)
            self._mem = _BUFFERS.get(size + size // 8)  # room for batches a bit larger
        buf = np.frombuffer(self._mem, np.uint8, size)
        head = at - block
        if head:
            buf[:head] = np.frombuffer(self._head, np.uint8)
        buf[head : head + len(data)] = data
        buf[head + len(data) :] = 0
        tail = end - end % BLOCK
        self._head = buf[tail - block : end - block].tobytes()
        del buf
        view = memoryview(self._mem)[:size]
        try:
            if self.direct:
                try:
                    self._write_at(self._path(index), block, view, at == 0, _O_DIRECT)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:  # EINVAL: O_DIRECT is not supported there
                        raise
                    self.direct = False
            self._write_at(self._path(index), block, view, at == 0, 0)
        finally:
            view.release()

    def _write_at(self, path: Path, at: int, view: memoryview, new: bool, flags: int) -> None:
        flags |= os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if new:  # a chunk's first rows: nothing committed in it yet
            flags |= os.O_TRUNC
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            if not self.folder.is_dir():  # the store was moved or deleted: never recreate it
                raise
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o644)
        try:
            if new:
                os.ftruncate(fd, self.nbytes)
            done = 0
            while done < len(view):
                done += _pwrite(fd, view[done:], at + done)
            if self.fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
