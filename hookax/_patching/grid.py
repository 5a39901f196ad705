"""``hx.patch_grid``: a patching experiment over targets x positions as batched compiled programs.

The clean run's values at the targets are captured once (``hx.capture``, jitted). The grid is
one compiled program per chunk shape: for each target, ``jax.vmap`` over a chunk of positions of
the corrupted forward inside an ``hx.patching`` block (an ``hx.intercept_op`` edit for an
operation target, :mod:`.heads`; with ``heads=``, the vmap runs over heads x positions), the
targets one after another (an optimization barrier orders them, so one target's temporaries are
live at a time). The vmapped forward depends on the batched position only from the patched call
site on, so everything before it is computed once per chunk, not once per patch: the program a
careful hand-written grid would be. One program rather than one per target: XLA's fixed cost per
compile is paid once (a 12-layer grid compiled 3x faster). Programs are cached across calls (see
:mod:`.compiled`); ``chunk_size`` bounds how many patches per target one call runs (on CPU by
default rows are cut into chunks that keep a chunk's temporaries in cache).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .._capture.capture import capture
from .._capture.ops import intercept_op
from .._engine import firstcall
from .._engine.select import Where
from .._util.errors import HookaxError
from ..frameworks._functions import as_program
from . import compiled, cutgrid, targets
from .heads import check_heads, discover_ops, full_mask, op_edit
from .labelled import LabelledArray, Unpatched, labels_of_columns
from .patch import PatchError, patching, split_input

__all__ = ["Plan", "patch_grid"]

WHO = "hx.patch_grid"
# The default chunk on CPU: 32 patches of bench_patching's (1, 64, 64) float32 residual stream
# took 15% less CPU time than whole rows of 64 (2-core AMD EPYC, 2 MiB L2 per core).
CPU_CHUNK_BYTES = 512 * 1024
CPU_MIN_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class _GridSpec:
    rest: compiled.Static  # (fn, corrupt args) without their arrays
    metric: compiled.Static  # the metric without the values it closes over
    keys: tuple[str, ...]
    axis: int
    ops: tuple[str, ...] = ()  # the keys that are operations (patched by hx.intercept_op)
    heads: int | None = None  # the head axis of every target's value
    shapes: tuple[tuple[int, ...], ...] = ()  # each key's value shape (one call)
    clean_rest: Any = None  # (fn, clean args) without their arrays: clean values inside
    plain: bool = False  # every target a call site inside no transform (targets.plain)


def capture_targets(
    fn: Any, keys: list[str], ops: list[str], plain: bool = False
) -> Callable[..., Any]:
    """``hx.capture`` of the call sites ``keys`` (their inputs for ``"key:in"``) and the
    operations ``ops``; ``plain``: call sites inside no transform (:func:`targets.plain`),
    kept by an interceptor."""
    if plain and not ops:
        return targets.recorded(fn, keys)
    sites = [k for k in keys if k not in ops]
    inputs = {"inputs": True} if any(split_input(k)[1] for k in sites) else {}
    if not ops:
        return capture(fn, where=targets.selector(sites), **inputs)
    if not sites:
        return capture(fn, ops=ops)
    return capture(fn, where=targets.selector(sites), ops=ops, **inputs)


@firstcall.program(static_argnums=(0, 1, 2, 3))
def _clean(
    rest: compiled.Static, keys: tuple[str, ...], ops: tuple[str, ...], plain: bool, dyn: list[Any]
) -> dict[str, Any]:
    fn, args = compiled.join(dyn, rest)
    _, acts = capture_targets(fn, list(keys), list(ops), plain)(*args)
    return acts


def _patched(spec: _GridSpec, key: str, values: dict[str, Any], col: Any, head: Any) -> Any:
    """The block that applies one patch of ``key``."""
    if key in spec.ops:
        edit = op_edit(key, values[key], col, head, spec.axis, spec.heads)
        return intercept_op(edit, ops=key)
    if head is None:
        return patching({key: values[key]}, positions=col, axis=spec.axis)
    shape = spec.shapes[spec.keys.index(key)]
    mask = full_mask(col, head, shape, spec.axis, spec.heads, key)
    return patching({key: values[key]}, positions=mask, axis=-1)


@firstcall.program(static_argnums=0)
def _grid(
    spec: _GridSpec, dyn: list[Any], mdyn: list[Any], values: dict[str, Any] | None, patches: Any
) -> Any:
    """Every target's row for ``patches`` (``(columns, heads)``, either None, a leading axis
    on those given): one program, one vmap per target. ``values`` None: the clean values are
    captured in the same program (``dyn`` is then ``(corrupt dyn, clean dyn)``)."""
    metric = compiled.join(mdyn, spec.metric)
    clean_dyn: Any = None
    if values is None:
        dyn, clean_dyn = dyn
    if cutgrid.eligible(spec.keys, spec.ops):  # rows as suffixes of one traced forward
        # the forward the targets were found in (every call site marked), or traced here
        forward = None
        if not spec.ops:
            forward = targets.forward(dyn, spec.rest, spec.keys, clean_dyn, spec.clean_rest)
        if forward is None:
            fn, args = compiled.join(dyn, spec.rest)
            clean_args = None if clean_dyn is None else compiled.join(clean_dyn, spec.clean_rest)[1]
            forward = cutgrid.trace(fn, args, spec.keys, spec.ops, clean_args)
        got = None
        if forward is not None:
            got = cutgrid.rows(forward, spec.keys, values, patches, spec.axis, spec.heads, metric)
        if got is not None:
            return got
    if values is None:
        clean_fn, clean_args = compiled.join(clean_dyn, spec.clean_rest)
        capture = capture_targets(clean_fn, list(spec.keys), list(spec.ops), spec.plain)
        _, acts = capture(*clean_args)
        values = {k: targets.values_of(acts, k) for k in spec.keys}

    def one(key: str, dyn: list[Any], patch: Any, values: dict[str, Any]) -> Any:
        fn, args = compiled.join(dyn, spec.rest)  # rebuilt inside the vmap (NNX transforms)
        with _patched(spec, key, values, *patch):
            return metric(fn(*args))

    rows: list[Any] = []
    for key in spec.keys:
        if rows:  # one row after the other: a chunk's temporaries, not n_targets', are live
            dyn, values, patches, _ = jax.lax.optimization_barrier((dyn, values, patches, rows[-1]))
        if all(p is None for p in patches):
            rows.append(one(key, dyn, patches, values))
        else:
            row = jax.vmap(functools.partial(one, key), in_axes=(None, 0, None))
            rows.append(row(dyn, patches, values))
    return jnp.stack(rows)


def _as_args(args: Any, name: str, who: str = WHO) -> tuple[Any, ...]:
    if not isinstance(args, tuple):
        raise HookaxError(
            f"{who}: {name} is the tuple of fn's positional arguments, got "
            f"{type(args).__name__}. Fix: {name}=(tokens,) for fn(tokens)."
        )
    return args


def _alike(clean_args: tuple[Any, ...], corrupt_args: tuple[Any, ...], who: str) -> None:
    """Refuse clean and corrupted inputs of different structures, shapes or dtypes: one run's
    values go into the other, so they must be alike (said before anything runs)."""
    fix = (
        "Patching puts the clean run's values into the corrupted run, so both runs take inputs "
        "of the same shapes and dtypes. Fix: make the two prompts the same length (pad or trim "
        "them; the same number of tokens in each)."
    )
    clean, clean_tree = jax.tree_util.tree_flatten_with_path(clean_args)
    corrupt, corrupt_tree = jax.tree_util.tree_flatten_with_path(corrupt_args)
    if clean_tree != cast(Any, corrupt_tree):
        raise PatchError(
            f"{who}: clean_args and corrupt_args differ in structure: clean {clean_tree} and "
            f"corrupt {corrupt_tree}. {fix}"
        )
    for (path, a), (_, b) in zip(clean, corrupt, strict=True):
        if not (hasattr(a, "shape") and hasattr(b, "shape")):
            continue
        where = jax.tree_util.keystr(path)
        if tuple(a.shape) != tuple(b.shape):
            raise PatchError(
                f"{who}: clean {tuple(a.shape)} and corrupt {tuple(b.shape)} differ (the shapes "
                f"of clean_args{where} and corrupt_args{where}). {fix}"
            )
        if _canonical(a.dtype) != _canonical(b.dtype):
            raise PatchError(
                f"{who}: clean {a.dtype} and corrupt {b.dtype} differ (the dtypes of "
                f"clean_args{where} and corrupt_args{where}). {fix}"
            )


def _canonical(dtype: Any) -> Any:
    """The dtype an argument runs as (NumPy's int64 tokens run as int32); a PRNG key's (an NNX
    model's ``nnx.Rngs`` among the arguments) as it is."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


class Plan:
    """What a grid (or its attribution) needs: targets, their clean values, the patches."""

    def __init__(
        self,
        who: str,
        fn: Callable[..., Any],
        clean_args: Any,
        corrupt_args: Any,
        metric: Callable[[Any], Any],
        where: Any,
        positions: Any,
        axis: int,
        ops: Any = None,
        heads: Any = None,
        n_heads: int | None = None,
    ) -> None:
        for name, f in (("fn", fn), ("metric", metric)):
            if not callable(f):
                raise HookaxError(f"{who}: {name} must be callable, got {f!r}.")
        if where is None and ops is None:
            raise HookaxError(
                f"{who}: no targets: pass where= (call sites, 'layers/*') or ops= (operations "
                f"inside them, 'layers/*/attn:dot_general#1'), or both."
            )
        clean_args, corrupt_args = (
            _as_args(clean_args, "clean_args", who),
            _as_args(corrupt_args, "corrupt_args", who),
        )
        _alike(clean_args, corrupt_args, who)
        self.keys, self.shapes = [], {}
        self.plain = False
        self.dyn, self.rest = compiled.split((fn, corrupt_args))
        if where is not None:
            found = targets.discover(self.dyn, self.rest)
            self.keys = targets.where_keys(where, fn, corrupt_args, found, who)
            self.shapes = {k: targets.out_spec(k, found, who) for k in self.keys}
        op_shapes = {} if ops is None else discover_ops(fn, corrupt_args, ops, who)
        self.ops = [k for k in op_shapes if k not in self.shapes]
        if where is not None and not self.ops:
            self.plain = targets.plain(self.keys, found)
        self.keys += self.ops
        self.shapes.update({k: op_shapes[k] for k in self.ops})
        self.axis = axis
        self.cols = targets.columns(positions, axis, self.shapes, who)
        self.heads = heads
        self.n_heads = None
        if heads is not None:
            self.n_heads = check_heads(heads, self.shapes, axis, self.cols, who, n_heads)
        self.clean_dyn, self.clean_rest = compiled.split((fn, clean_args))
        self.mdyn, self.metric = compiled.split(metric, ints=True)

    @functools.cached_property
    def acts(self) -> dict[str, Any]:
        """The targets' clean values (their own program; attribution computes them in its)."""
        return _clean(
            self.clean_rest, tuple(self.keys), tuple(self.ops), self.plain, self.clean_dyn
        )

    def spec(self) -> _GridSpec:
        shapes = tuple(tuple(self.shapes[k].shape) for k in self.keys)
        return _GridSpec(
            self.rest,
            self.metric,
            tuple(self.keys),
            self.axis,
            tuple(self.ops),
            self.heads,
            shapes,
            plain=self.plain,
        )

    def patches(self) -> tuple[Any, Any]:
        """The patches of one row, ``(columns, heads)`` with one leading axis (either None):
        with heads, head ``h`` with every column, for each ``h`` in turn. Host arrays where
        the columns are (no program compiled for tiling them)."""
        if self.n_heads is None:
            return self.cols, None
        xp = np if isinstance(self.cols, np.ndarray) or self.cols is None else jnp
        hs = xp.arange(self.n_heads, dtype=np.int32)
        if self.cols is None:
            return None, hs
        n = self.cols.shape[0]
        return xp.tile(self.cols, (self.n_heads,) + (1,) * (self.cols.ndim - 1)), xp.repeat(hs, n)

    def layout(self, rows: Any) -> Any:
        """``[n_targets, n_patches, ...]`` as ``[n_targets, n_heads, n_columns, ...]``."""
        if self.n_heads is None or self.cols is None:
            return rows
        return rows.reshape(rows.shape[0], self.n_heads, self.cols.shape[0], *rows.shape[2:])

    def auto_chunk(self, n: int) -> int:
        """The default chunk: a whole row on an accelerator; on CPU, rows cut evenly into
        chunks of at most :data:`CPU_CHUNK_BYTES` of target values (at least
        :data:`CPU_MIN_CHUNK` patches), so a chunk's temporaries stay in cache."""
        if jax.default_backend() != "cpu":
            return n
        size = max(math.prod(s.shape) * s.dtype.itemsize for s in self.shapes.values())
        most = max(CPU_MIN_CHUNK, CPU_CHUNK_BYTES // max(size, 1))
        calls = -(-n // most)
        return -(-n // calls)

    def chunks(self, chunk_size: int | None) -> list[tuple[Any, int]]:
        """The patches cut into chunks of one size (the last padded): ``(chunk, used)``."""
        patches = self.patches()
        if all(p is None for p in patches):
            return [(patches, 1)]
        n = next(p for p in patches if p is not None).shape[0]
        c = self.auto_chunk(n) if chunk_size is None else min(chunk_size, n)
        out = []
        for start in range(0, n, c):
            used = min(c, n - start)

            def cut(p: Any, start: int = start, used: int = used) -> Any:
                if used == n:
                    return p
                xp = np if isinstance(p, np.ndarray) else jnp
                chunk = p[start : start + used]
                if used < c:
                    chunk = xp.concatenate([chunk, xp.repeat(chunk[-1:], c - used, axis=0)])
                return chunk

            out.append((tuple(None if p is None else cut(p) for p in patches), used))
        return out

    def values(self) -> dict[str, Any]:
        return {k: targets.values_of(self.acts, k) for k in self.keys}

    def _inputs(self, chunks: list[tuple[Any, int]]) -> tuple[_GridSpec, Any, Any]:
        """``_grid``'s spec, model arrays and values. The clean values are captured inside the
        grid's program (one program to compile on a first call) unless the grid runs as many
        small chunks (each would capture them again): then in their own program, once."""
        spec = self.spec()
        size = next((p.shape[0] for p in chunks[0][0] if p is not None), 1)
        if len(chunks) > 1 and size < CPU_MIN_CHUNK:
            return spec, self.dyn, self.values()
        both = (self.dyn, self.clean_dyn)
        return dataclasses.replace(spec, clean_rest=self.clean_rest), both, None

    def grid(self, chunk_size: int | None) -> Any:
        chunks = self.chunks(chunk_size)
        spec, dyn, values = self._inputs(chunks)
        parts = [(_grid(spec, dyn, self.mdyn, values, chunk), used) for chunk, used in chunks]
        if all(p is None for p in chunks[0][0]):
            return parts[0][0]
        return _assemble(parts, self.layout, self.n_heads is not None and self.cols is not None)

    def labels(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        """The grid's axes and their labels: targets, heads (``H0``...), columns."""
        axes, labels = ["target"], [tuple(self.keys)]
        if self.n_heads is not None:
            axes.append("head")
            labels.append(tuple(f"H{h}" for h in range(self.n_heads)))
        if self.cols is not None:
            axes.append("position")
            labels.append(labels_of_columns(self.cols))
        return tuple(axes), labels

    def labelled(self, values: Any, **kw: Any) -> LabelledArray:
        """``values`` labelled as this plan's grid; the metric of the unpatched clean and
        corrupted runs is computed when first read (:class:`~.labelled.Unpatched`)."""
        axes, labels = self.labels()
        runs = (self.rest, self.clean_rest, self.metric, self.dyn, self.clean_dyn, self.mdyn)
        return LabelledArray(values, axes, labels, unpatched=Unpatched(runs=runs), **kw)

    def compiled(self, chunk_size: int | None) -> Any:
        """The compiled program of one chunk (for its memory analysis)."""
        chunks = self.chunks(chunk_size)
        spec, dyn, values = self._inputs(chunks)
        return _grid.lower(spec, dyn, self.mdyn, values, chunks[0][0]).compile()


def _assemble(parts: list[tuple[Any, int]], layout: Callable[[Any], Any], heads: bool) -> Any:
    """The chunks' rows (each ``[:, :used]``) side by side, laid out; on the host when they are
    concrete (no program compiled for slicing and joining them)."""
    (first, used), *more = parts
    if any(isinstance(p, jax.core.Tracer) for p, _ in parts):
        return layout(jnp.concatenate([p[:, :u] for p, u in parts], axis=1))
    if not more and used == first.shape[1] and not heads:
        return first
    out = layout(np.concatenate([np.asarray(p)[:, :u] for p, u in parts], axis=1))
    return jax.device_put(out)  # (jnp.asarray would compile a program for it)


def patch_grid(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    metric: Callable[[Any], Any],
    *,
    where: Where = None,
    ops: Any = None,
    heads: int | None = None,
    positions: Any = "each",
    axis: int = 1,
    chunk_size: int | None = None,
    n_heads: int | None = None,
) -> LabelledArray:
    """The metric of the corrupted run with each target patched from the clean run, as a grid.

    For each target (a row) and each patch (a column), the corrupted run ``fn(*corrupt_args)``
    runs with that target's value replaced, at that patch's positions, by its value in the
    clean run ``fn(*clean_args)``, and ``metric`` of its output is the entry. A target is a call
    site's output (``where=``) or an operation's value inside a call site (``ops=``, addressed
    as [`hx.ops`][hookax.ops] lists them: ``"layers/0/attn:dot_general#1"``, the attention's
    per-head output). Every call of a target is patched (a scanned stack's call site: every
    layer).

    ``heads=`` names the head axis of the targets' values: each target then has one row per
    head, and each patch replaces one head (at the column's positions), the other heads keeping
    the corrupted run's values.

    The clean values are captured once; the grid is one compiled program: for each target in
    turn, ``jax.vmap`` over patches of the patched forward (what comes before the target is
    computed once per chunk), at most ``chunk_size`` patches per target per program call
    (memory grows linearly with it: [benchmarks](../benchmarks.md#activation-patching)).
    Programs are reused by later calls with the same structure, shapes, ``fn`` and ``metric``
    (functions compared by code and closure, as [`hx.intercept`][hookax.intercept] compares
    them); pass the model as ``fn``, or among the arguments, rather than closed over.

    Args:
      fn: a module or a function of arrays (e.g. Linen's ``model.apply``).
      clean_args: ``fn``'s positional arguments for the clean run, a tuple.
      corrupt_args: the same for the corrupted run.
      metric: ``fn``'s output -> an array (a scalar: a logit difference, a log-probability).
      where: call-site targets: a key, a path glob (``"layers/*"``: every match, in call order)
        or a list of them; ``"path:method"`` for a method other than ``__call__``; ``":in"``
        after one names the call's input as ``hx.capture(..., inputs=True)`` does
        (``"blocks/*:in"``: the residual stream before each block).
      ops: operation targets: an address or a glob over them (``"layers/*/attn:dot_general#1"``:
        every match, in program order) or a list of them; rows after ``where=``'s. Inside a
        scanned stack, a layer suffix gives one row per layer: ``"blocks/attn[0:12]:softmax"``.
      heads: the head axis of every target's value (e.g. ``1`` for ``(batch, heads, ...)``);
        default None: whole values, no head axis in the grid.
      positions: ``"each"``: one column per index along ``axis``; ``None``: one patch of the
        whole output (no column axis); or an array whose leading axis lists the patches, each an
        index, indices or a boolean mask as [`hx.patching`][hookax.patching] takes them.
      axis: the position axis of the targets' values.
      chunk_size: the most patches per target one program call runs; default a whole row
        (on CPU, rows cut evenly into chunks of at most 512 KiB of the targets' values, at
        least 8 patches: smaller batches stay in cache).
      n_heads: the model's number of heads, checked against the ``heads=`` axis of every
        target: an axis of another size (heads on another axis of that operation, or lumped
        with another, as in grouped-query attention) raises instead of giving a grid of
        something else than heads.

    Returns:
      A [`hx.LabelledArray`][hookax.LabelledArray] ``[n_targets, n_columns, *metric's
      shape]`` (``[n_targets, *metric's shape]`` for ``positions=None``), targets in the order
      of ``where`` then ``ops``; with ``heads=``, a head axis after the targets':
      ``[n_targets, n_heads, n_columns, ...]``. It is used as that array, and carries the
      labels of its axes (``rows``: the targets' keys; ``H0``... for heads; ``columns``: the
      positions) and the metric of the unpatched clean and corrupted runs (``clean``,
      ``corrupted``: computed when first read, by one more program).

    Raises:
      SelectorError: a ``where=`` or ``ops=`` entry matched nothing (the message lists what
        ran).
      PatchError: a target whose value is not an array, positions that do not fit it, a
        ``heads=`` axis out of range for it, or of another size than ``n_heads``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.tanh)
      >>> clean, corrupt = jnp.ones((1, 3, 2)), jnp.zeros((1, 3, 2))
      >>> metric = lambda y: y[0, -1, 0]
      >>> grid = hx.patch_grid(model, (clean,), (corrupt,), metric, where="layers/0")
      >>> grid.shape
      (1, 3)
      >>> bool(grid[0, 2] == metric(model(clean))), bool(grid[0, 0] == metric(model(corrupt)))
      (True, True)

      Heads: the value of an operation, one row per head (here the two features of the
      linear layer's ``dot_general`` stand for heads):

      >>> by_head = hx.patch_grid(model, (clean,), (corrupt,), lambda y: y[0, -1, 0],
      ...                         ops="layers/0:dot_general", heads=2)
      >>> by_head.shape                                  # (target, head, position)
      (1, 2, 3)
    """
    fn = as_program(fn)  # a program without modules: its own call sites
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise PatchError(f"{WHO}: chunk_size= takes a positive int or None, got {chunk_size!r}.")

    def run() -> LabelledArray:
        plan = Plan(
            WHO, fn, clean_args, corrupt_args, metric, where, positions, axis, ops, heads, n_heads
        )
        return plan.labelled(plan.grid(chunk_size), title="patched metric")

    return compiled.retrying(WHO, (fn, metric), run)
