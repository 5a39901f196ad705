"""``hx.harvest``: captured activations of many batches, appended to an on-disk array store.

The pieces: :mod:`hookax._harvest.step` (the jitted step on the device),
:mod:`hookax._harvest.write` (the writer thread), :mod:`hookax._harvest.store` (the zarr v3 layout
and its commit protocol, and why TensorStore writes it). This module runs the loop and reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sized
from pathlib import Path
from typing import Any

from .._capture.capture import _DEFAULT, validate_while_steps, where_and_ops
from .._engine.select import Where
from .._util.errors import HookaxError
from .._util.words import counted
from ..frameworks._functions import as_program

__all__ = ["Harvest", "harvest"]

BATCHES_PER_CHUNK = 64  # one process: a chunk holds up to this many batches (up to 16 MB)


@dataclasses.dataclass(frozen=True)
class Harvest:
    """What a :func:`harvest` run left in its store, and how long it took.

    Attributes:
      store: the store's folder.
      names: the stored values' names (call-site keys; ``key#i`` for the i-th of several calls,
        ``key[i]`` for layer i of a call site inside a scan over layers, ``key.0`` for the
        arrays of a tuple output (``.name`` for a field or dict key):
        ``path[layer]:rest#call.part``, the layer after the call site's path as a one-layer
        selection names it: ``"blocks/attn[2]:softmax"``, ``"blocks/mlp[2]:in"``,
        ``"decoder/layers[1].0"``).
      batches: batches in the store.
      rows: rows in each stored array.
      resumed_at: the first batch this run computed (0 unless it resumed an interrupted run).
      bytes: bytes of rows this process wrote.
      seconds: wall time of the run.
    """

    store: Path
    names: tuple[str, ...]
    batches: int
    rows: int
    resumed_at: int
    bytes: int
    seconds: float

    def describe(self) -> str:
        """``"100 batches, 51,200 rows, 52.4 MB in 3.2 s (16.4 MB/s)"``: the run in one line
        (the throughput is of the bytes this run wrote, over its whole time)."""
        rate = self.bytes / 1e6 / max(self.seconds, 1e-9)
        resumed = f", resumed at batch {self.resumed_at}" if self.resumed_at else ""
        return (
            f"{counted(self.batches, 'batch')}, {counted(self.rows, 'row', ',')}, "
            f"{self.bytes / 1e6:.1f} MB in "
            f"{self.seconds:.1f} s ({rate:.3g} MB/s{resumed})"
        )

    def __str__(self) -> str:
        return f"harvest: {self.describe()} -> {self.store}"

    def __repr__(self) -> str:
        arrays = counted(len(self.names), "array")
        return f"<hx.Harvest {str(self.store)!r}: {self.describe()}; {arrays}>"

    def read(self, name: str) -> Any:
        """The rows stored for ``name``, as a numpy array ``(rows, *per-row shape)``."""
        return read(self.store, name)

    def source(self) -> Any:
        """int64 ``(rows, 1 + row_axes)``: each row's batch index and position in the batch."""
        return read(self.store, "_source")


def read(store: str | Path, name: str) -> Any:
    """The committed rows of ``name`` in ``store`` (``"_source"`` for the rows' sources)."""
    import json

    from .store import META, Store

    path = Path(store)
    meta = json.loads((path / META).read_text())
    if name not in meta["arrays"] and name not in ("_source", "_batch_end"):
        raise HookaxError(
            f"hx.harvest: the store {str(path)!r} holds no {name!r}; it holds "
            f"{', '.join(map(repr, meta['arrays']))}."
        )
    s = Store(path, meta, 0)
    s.open()
    batches = s.committed()
    rows = s.rows_before(batches)
    n = batches if name == "_batch_end" else rows
    return s.arrays[name][:n].read().result()


def _describe_fn(fn: Any) -> str:
    kind = fn if isinstance(fn, type) else type(fn)
    if hasattr(fn, "__qualname__") and not hasattr(fn, "__self__"):
        return f"{getattr(fn, '__module__', '?')}.{fn.__qualname__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def _describe_where(where: Any) -> str:
    """A form of ``where=`` that is the same in every run (no addresses)."""
    if where is None or isinstance(where, str):
        return repr(where)
    if isinstance(where, type):
        return f"{where.__module__}.{where.__qualname__}"
    if isinstance(where, tuple):
        return "(" + ", ".join(_describe_where(w) for w in where) + ")"
    if isinstance(where, list):
        return "[" + ", ".join(_describe_where(w) for w in where) + "]"
    if callable(where) and hasattr(where, "__qualname__"):
        return _describe_fn(where)
    return repr(where)


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"hookax.harvest.{name}")


def harvest(
    fn: Callable[..., Any],
    batches: Iterable[Any],
    *,
    where: Where = _DEFAULT,
    ops: Any = None,
    store: str | Path,
    dtype: Any = None,
    mask: Callable[..., Any] | None = None,
    row_axes: int = 1,
    while_steps: int | None = None,
    inputs: bool = False,
    overwrite: bool = False,
    metadata: Any = None,
    progress: bool | None = None,
    overlap: bool = True,
    queue_size: int = 2,
    fsync: bool = False,
) -> Harvest:
    """Run ``fn`` over ``batches`` under jit and append the selected call sites' outputs to disk.

    Each batch is ``fn``'s positional arguments (a tuple, or one value). Every captured output
    (as [`hx.capture`][hookax.capture] returns it) becomes one zarr v3 array in ``store``, named
    by its call-site key, with one *row* per entry of its leading ``row_axes`` axes: a ``(batch,
    seq, d)`` output with ``row_axes=2`` gives ``batch * seq`` rows of ``d`` values. A call site
    inside ``nnx.scan``/``lax.scan`` over layers, whose captured value is stacked ``(layers,
    batch, ...)``, gives one array per layer, ``key[i]``, with the same rows (an operation's
    value or an input: ``"blocks/attn[2]:softmax"``, ``"blocks/mlp[2]:in"``, the names a
    one-layer selection gives). With
    ``while_steps=N``, a call site inside a ``lax.while_loop`` (a decode loop) gives one array per
    iteration, ``key[t]`` for ``t < N``, stacked as [`hx.capture`][hookax.capture] stacks it; rows
    of iterations the loop did not reach hold NaN, and iterations from ``N`` on are dropped (the
    step runs under jit, where the count is not known in time to raise). Rows of later
    batches are appended after earlier ones; ``_source`` records each row's batch and position.

    Writing overlaps computing: the host copy of a batch starts as soon as its step is
    dispatched, and a writer thread writes it while the next batches compute. Values sharded over
    devices are written shard by shard by the process that holds them; with several JAX
    processes (``jax.distributed``) every process runs ``harvest`` with the same arguments and
    writes its own shards into the same store.

    An interrupted run resumes: run again with the same arguments and it skips the batches
    already committed and ends with the same store as an uninterrupted run. A store written by
    another model, ``where=``, ``dtype=`` or ``mask=`` is refused (``overwrite=True`` replaces
    it). A run over a complete store appends the batches after the ones it already holds.

    Args:
      fn: an NNX module (jitted with ``nnx.jit``, the module passed as an argument) or any
        function calling modules (jitted with ``jax.jit``).
      batches: an iterable of batches; iterated once.
      where: which call sites (as [`hx.capture`][hookax.capture]); default every module's
        ``__call__``, or none when ``ops=`` is given.
      ops: operations inside call sites (as [`hx.capture`][hookax.capture]'s ``ops=``:
        ``"layers/*/attn:softmax"``), stored like call-site outputs under their addresses.
      store: the store's folder.
      dtype: store floating outputs in this dtype (cast on the device: ``jnp.bfloat16`` halves
        the bytes moved and written); default their own dtype. Integer outputs keep theirs.
      mask: ``mask(*batch) -> bool array`` of the row axes' shape: rows where it is False
        (padding) are not stored. Computed inside the jitted step.
      row_axes: how many leading axes of each output are rows (``mask``'s number of axes).
      while_steps: keep every iteration of each ``lax.while_loop``, up to this many (as
        [`hx.capture`][hookax.capture]); default the last iteration only.
      inputs: also store each selected call's inputs as its caller passed them, named
        ``"key:in"`` (``"blocks/0:in"``: the residual stream before a block), as
        [`hx.capture`][hookax.capture]'s ``inputs=True`` records them.
      overwrite: replace the hookax store at ``store``. Only a hookax store holding nothing but
        what hookax wrote, or an empty folder, is replaced; any other folder (and ``.``, the
        home folder and the folders above them, whatever they hold) raises with every file
        left as it was.
      metadata: JSON-serialisable data kept in the store's ``hookax.json`` (part of what a resumed
        run must match).
      progress: show the progress: a bar on a terminal (with the percentage and the time left
        when ``batches`` has a length), a line rewritten in place in a notebook, and one final
        line (``str()`` of the result) on stderr; default on a terminal (stderr) and in a
        Jupyter kernel. Only process 0 shows it.
      overlap: write on a thread while the next batches compute (``False``: write each batch
        before computing the next; for measuring).
      queue_size: batches that may wait for the writer (each holds its outputs in memory).
      fsync: sync every chunk and counter to the disk before committing. Without it a killed
        process still resumes exactly (the operating system keeps what it wrote); with it, so
        does a machine that loses power, at several times the cost per byte.

    Returns:
      A ``Harvest`` with the store's counts; ``.read(name)`` loads an array.

    Raises:
      HookaxError: the store holds another harvest; an output whose leading axes are not the
        batch's rows; a write failed (the store stays valid: rerun to resume).

    Examples:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu)
      >>> data = [jnp.full((2, 4), float(i)) for i in range(3)]
      >>> store = tempfile.mkdtemp() + "/acts"
      >>> h = hx.harvest(model, data, where="layers/0", store=store, dtype=jnp.bfloat16)
      >>> h.rows, h.read("layers/0").shape, str(h.read("layers/0").dtype)
      (6, (6, 8), 'bfloat16')
    """
    fn = as_program(fn)  # a program without modules: its own call sites
    t0 = time.perf_counter()
    import jax

    from .faults import store_faults
    from .progress import Progress, shown
    from .store import check_path, import_tensorstore

    import_tensorstore()
    if row_axes < 1:
        raise HookaxError(f"hx.harvest: row_axes must be at least 1, got {row_axes}")
    bound = validate_while_steps(while_steps, "hx.harvest")
    path = Path(store)
    check_path(path, overwrite=overwrite)  # a folder hookax may not write: refused before any work
    total = len(batches) if isinstance(batches, Sized) else None
    it = iter(batches)
    first = next(it, None)
    if first is None:
        raise HookaxError("hx.harvest: batches is empty: there is nothing to harvest.")
    plan = _plan(
        fn, first, path, where, ops, dtype, mask, row_axes, overwrite, metadata, bound, inputs
    )
    process, processes = jax.process_index(), jax.process_count()
    s, start = _open_store(path, plan, overwrite, fsync, process, processes)
    bar = Progress(shown(progress) and process == 0, total, start)
    writer = _writer(s, plan, start, bar, processes == 1)
    if overlap:
        writer.start(queue_size)
    count = _write_batches(plan, itertools.chain([first], it), start, s, writer, bar)
    _barrier("written")
    batches_done, rows = max(count, start), writer.rows
    if process == 0:
        with store_faults(path, batches_done, batches_done):
            s.finish(batches_done, rows)
    _barrier("finished")
    h = Harvest(
        path,
        tuple(leaf.name for leaf in plan.leaves),
        batches_done,
        rows,
        start,
        writer.bytes,
        time.perf_counter() - t0,
    )
    bar.finish(str(h))
    return h


@dataclasses.dataclass
class _Plan:
    """What a run stores, found from its first batch: the jitted step, the stored leaves, the
    rows of a batch, the store's description, and batch 0's outputs when already computed."""

    step: Any
    leaves: list[Any]
    row_axes: int
    batch_rows: int
    desc: dict[str, Any]
    early: Any  # (values, mask) of batch 0, or None


def _plan(
    fn: Callable[..., Any],
    first: Any,
    path: Path,
    where: Any,
    ops: Any,
    dtype: Any,
    mask: Callable[..., Any] | None,
    row_axes: int,
    overwrite: bool,
    metadata: Any,
    bound: int | None = None,
    inputs: bool = False,
) -> _Plan:
    """Trace the step on the first batch: what the store holds. A new store computes batch 0
    meanwhile (it is written first); a store to resume only needs the shapes."""
    from .step import Step, as_args, leaf_specs
    from .store import META, describe
    from .write import start_transfers

    where, patterns = where_and_ops(where, ops, "hx.harvest")
    step = Step.cached(fn, where, patterns, dtype, mask, row_axes, as_args(first), bound, inputs)
    early = None
    if overwrite or not (path / META).exists():  # a new store: batch 0 computes meanwhile
        early = step(*as_args(first))
        start_transfers(*early)
    values, m = early if early is not None else step.shapes(*as_args(first))
    leaves, rows_shape = leaf_specs(step, values, m, row_axes, mask is not None)
    if not leaves:
        raise HookaxError(
            f"hx.harvest: the selected call sites (where={where!r}) returned no arrays: there "
            f"is nothing to store. Fix: a where= that matches call sites returning arrays; "
            f"`hookax summary` lists the keys of a model's call sites."
        )
    desc = describe(
        leaves,
        model=_describe_fn(fn),
        where=_describe_where(where)
        + (f" ops={[p.text for p in patterns]!r}" if patterns else "")
        + (f" while_steps={bound}" if bound is not None else ""),
        row_axes=row_axes,
        masked=mask is not None,
        user=metadata,
    )
    return _Plan(step, leaves, row_axes, int(math.prod(rows_shape)), desc, early)


def _open_store(
    path: Path, plan: _Plan, overwrite: bool, fsync: bool, process: int, processes: int
) -> tuple[Any, int]:
    """Create or check the store (process 0 creates it, every process checks it), open it and
    return it with the batches already committed, where this run starts."""
    import json

    from .faults import store_faults
    from .store import META, Store

    with store_faults(path, 0, None):
        Store.prepare(
            path,
            plan.desc,
            overwrite=overwrite,
            create=process == 0,
            batch_rows=plan.batch_rows,
            batches_per_chunk=1 if processes > 1 else BATCHES_PER_CHUNK,
        )
    _barrier("created")
    with store_faults(path, 0, None):
        Store.prepare(path, plan.desc, overwrite=False, create=False)  # every process checks it
        s = Store(path, json.loads((path / META).read_text()), process, fsync)
        s.open()
        start = s.committed()
    with store_faults(path, start, start):
        s.commit(start)
    _barrier("resumed")
    if process == 0:
        s.drop_other_progress(processes)
    return s, start


def _writer(s: Any, plan: _Plan, start: int, bar: Any, direct: bool) -> Any:
    """The writer appending after the ``start`` batches committed (not started yet)."""
    from .faults import store_faults
    from .write import Writer

    leaf_map = {leaf.name: leaf for leaf in plan.leaves}
    with store_faults(s.path, start, start):
        base = s.rows_before(start)
        return Writer(s, leaf_map, plan.row_axes, base, bar, direct=direct, batches=start)


def _write_batches(
    plan: _Plan, batches: Iterable[Any], start: int, s: Any, writer: Any, bar: Any
) -> int:
    """Compute every batch from ``start`` on and hand it to the writer; returns how many
    batches there were. On any error, or Ctrl-C, what was handed over is committed first."""
    from .step import as_args
    from .write import start_transfers

    count = 0
    early, plan.early = plan.early, None  # batch 0's outputs: kept only until written
    with bar:
        try:
            for i, batch in enumerate(batches):
                count = i + 1
                if i < start:
                    continue
                if i == 0 and early is not None:
                    values, m = early
                else:
                    values, m = plan.step(*as_args(batch))
                    start_transfers(values, m)
                early = None
                writer.put((i, values, m))
        except BaseException:
            with contextlib.suppress(Exception):  # commit what was handed over, then re-raise
                writer.close()
            s.close()
            raise
        try:
            writer.close()
        finally:
            s.close()
    return count
