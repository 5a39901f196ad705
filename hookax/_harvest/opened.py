"""``hx.open_store``: a harvest store opened for reading (names, per-row shapes, rows as arrays).

Examples:
  >>> import tempfile, jax.numpy as jnp
  >>> from flax import nnx
  >>> import hookax as hx
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu)
  >>> path = tempfile.mkdtemp() + "/acts"
  >>> _ = hx.harvest(model, [jnp.ones((3, 4))] * 2, where="layers/0", store=path)
  >>> s = hx.open_store(path)
  >>> s.names, s.rows, s.shapes["layers/0"], str(s.dtypes["layers/0"])
  (('layers/0',), 6, (8,), 'float32')
  >>> s.read("layers/0", 2, 4).shape
  (2, 8)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .._util.errors import HookaxError
from .._util.words import counted

__all__ = ["ActivationStore", "open_store"]


class ActivationStore:
    """A harvest store opened for reading. Use [`hx.open_store`][hookax.open_store].

    Attributes:
      path: the store's folder.
      names: the stored values' names (call-site keys, as [`hx.harvest`][hookax.harvest] names
        them).
      shapes: each name's per-row shape.
      dtypes: each name's numpy dtype.
      rows: committed rows (every array has this many).
      batches: committed batches.
      complete: whether the harvest that wrote it finished (else it is being written, or was
        interrupted: only the committed rows are read).
      metadata: what the harvest recorded (``hookax.json``).
    """

    def __init__(self, path: Path) -> None:
        from .store import META, Store

        meta_file = path / META
        if not meta_file.is_file():
            raise HookaxError(
                f"hx.open_store: {str(path)!r} is not a hookax harvest store (no {META}). Fix: "
                f"the folder given as store= to hx.harvest (or --out to hookax harvest)."
            )
        self.path = path
        self.metadata: dict[str, Any] = json.loads(meta_file.read_text())
        self._store = Store(path, self.metadata, 0)
        self._store.open()
        arrays = self.metadata["arrays"]
        self.names: tuple[str, ...] = tuple(arrays)
        self.shapes = {n: tuple(a["shape"]) for n, a in arrays.items()}
        self.dtypes = {n: self._store.arrays[n].dtype.numpy_dtype for n in arrays}
        self.complete = bool(self.metadata.get("complete"))
        self.batches = self._store.committed()
        self.rows = self._store.rows_before(self.batches)

    def array(self, name: str) -> Any:
        """The TensorStore handle of ``name`` (lazy: a slice reads only the chunks it touches).
        Its length may pass ``rows`` while the store is being written."""
        self._check(name)
        return self._store.arrays[name]

    def chunk_rows(self, name: str) -> int:
        """Rows in one chunk of ``name`` (a read of part of a chunk reads all of it)."""
        return int(self.array(name).chunk_layout.read_chunk.shape[0])

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``start:stop`` of ``name`` (default all committed rows) as a numpy array;
        ``"_source"`` gives each row's batch and position."""
        stop = self.rows if stop is None else min(stop, self.rows)
        return np.asarray(self.array(name)[start:stop].read().result())

    def _check(self, name: str) -> None:
        if name not in self._store.arrays:
            raise HookaxError(
                f"hx.open_store: the store {str(self.path)!r} holds no {name!r}; it holds "
                f"{', '.join(map(repr, self.names))}."
            )

    def __repr__(self) -> str:
        state = "" if self.complete else ", being written or interrupted"
        n = len(self.names)
        size = f"{counted(n, 'array')}, {counted(self.rows, 'row')}"
        return f"ActivationStore({str(self.path)!r}, {size}{state})"


def open_store(path: str | Path) -> ActivationStore:
    """Open a [`hx.harvest`][hookax.harvest] store for reading.

    Args:
      path: the store's folder.

    Returns:
      An [`hx.ActivationStore`][hookax.ActivationStore]: ``names``, ``shapes``, ``dtypes``,
      ``rows``, ``read(name, start, stop)`` and TensorStore handles (``array(name)``).

    Raises:
      HookaxError: ``path`` is not a harvest store.
    """
    from .store import import_tensorstore

    import_tensorstore()
    return ActivationStore(Path(path))
