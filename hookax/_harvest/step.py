"""The device side of ``hx.harvest``: one jitted step per batch, and the arrays it produces.

The step runs a capture session under jit (``hx.capture``'s, whose records also say how many
leading axes scans stacked on each value), casts floating outputs to the store's
dtype on the device (so ``bfloat16`` also halves the bytes moved to the host), flattens every
captured output into named leaves (one stored array each) and computes the batch's row mask. An
NNX module is an argument of ``jax.jit`` (as its variables' arrays, or ``nnx.split`` state for
one that is no pytree: :mod:`hookax._util.nnxsplit`), so its parameters are not baked into the
program; any other function is jitted with ``jax.jit``, closing over the modules it calls.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._capture.actgrad import is_nnx_module
from .._transforms.cutscan import cut_scans
from .._util import nnxsplit
from .._util.errors import HookaxError
from .._util.parts import parts

__all__ = ["Leaf", "Origin", "Step", "as_args", "leaf_specs", "replication", "row_shape"]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One stored array: which call site, which call, which layer, which part of the output."""

    name: str  # what users index the store with: "layers/0", "attn#1", "pair.0", "blocks/mlp[3]"
    key: str  # the call site's key
    call: int  # which call of that call site
    part: str  # the leaf inside the output, as targets name it (".0"; "" for an array output)
    shape: tuple[int, ...]  # per-row shape (the value's shape after the row axes)
    dtype: str  # stored dtype
    source: str = ""  # the step's output holding it (its name, without the layer index)
    index: tuple[int, ...] = ()  # its position on the leading scan axes of that output

    def describe(self) -> dict[str, Any]:
        out = {
            "key": self.key,
            "call": self.call,
            "part": self.part,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }
        if self.index:
            out["layer"] = list(self.index)
        return out


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a step output comes from; ``scans``: how many leading axes scans stacked on it."""

    key: str
    call: int
    part: str
    scans: int


def as_args(batch: Any) -> tuple[Any, ...]:
    """A batch as the positional arguments of ``fn``: a tuple as it is, anything else alone."""
    return batch if isinstance(batch, tuple) else (batch,)


def _scans(axes: tuple[tuple[str, Any], ...]) -> int:
    """How many leading axes of a captured value scans (and ``while`` loops with
    ``while_steps=``) stacked on it (``axes`` innermost first, as
    :class:`hookax._transforms.tags.Record` keeps them; ``cond`` and an unbounded ``while`` add
    none). Only the outermost run counts: a ``shard_map`` axis is not a layer axis."""
    n = 0
    for kind, size in reversed(axes):
        if kind == "cond" or (kind == "while" and size is None):
            continue
        if kind not in ("scan", "while"):
            break
        n += 1
    return n


def _outputs(
    f: Any,
    where: Any,
    ops: tuple[Any, ...],
    args: tuple[Any, ...],
    while_steps: int | None = None,
    inputs: bool = False,
) -> list[tuple[str, Origin, Any]]:
    """``(name, origin, value)`` for every array leaf of every selected call's output, as
    :func:`hookax.capture` collects them, and how many scan axes lead each."""
    from .._capture.capture import layer_keys, layer_split, session

    s = session("hx.harvest", where, f, args, {}, ops=ops, while_steps=while_steps, inputs=inputs)
    s.run(f, *args)
    layered = s.session.layered
    calls: dict[str, list[Any]] = {
        k: [] for start in s.session.starts for k in layer_keys(start, layered)
    }
    for r in s.session.records:
        # One layer of a scanned call site ("blocks/up[2]"): that layer's value, one scan less.
        axes = _without_inner_scan(r.axes) if r.key in layered else r.axes
        for key, value in layer_split(r.key, r.output(), r.axes, layered):
            calls.setdefault(key, []).append((value, axes))
    out = []
    for key, records in calls.items():
        for call, (value, axes) in enumerate(records):
            for part, leaf in parts(value):
                name = key + (f"#{call}" if len(records) > 1 else "") + part
                out.append((name, Origin(key, call, part, _scans(axes)), leaf))
    return out


def _without_inner_scan(axes: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    kinds = [kind for kind, _ in axes]
    i = kinds.index("scan")
    return axes[:i] + axes[i + 1 :]


def row_shape(shapes: list[tuple[tuple[int, ...], int]], row_axes: int) -> tuple[int, ...]:
    """The batch's rows without a mask: the leading ``row_axes`` axes of the first value that
    no scan stacked, or else of the first value after its scan axes."""
    for shape, scans in shapes:
        if not scans:
            return shape[:row_axes]
    shape, scans = shapes[0]
    return shape[scans : scans + row_axes]


def _cast(x: Any, dtype: Any) -> Any:
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype)


def replication(args: tuple[Any, ...]) -> Any:
    """With several processes, a sharding that puts a value whole on every device of the
    batch's mesh (every process then holds the whole row mask); None with one process."""
    if jax.process_count() == 1:
        return None
    from jax.sharding import NamedSharding, PartitionSpec

    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
    raise HookaxError(
        f"hx.harvest: with {jax.process_count()} JAX processes every batch must hold global "
        "jax.Arrays with a NamedSharding (the mesh the step runs on), got "
        f"{[type(x).__name__ for x in jax.tree.leaves(args)]}. Fix: build each batch with "
        "jax.make_array_from_process_local_data(NamedSharding(mesh, P('data')), local_rows)."
    )


def _selects_layers(where: Any, ops: tuple[Any, ...]) -> bool:
    """Whether ``where=`` or an ``ops=`` pattern names layers of a scanned stack."""
    from .._capture.capture import _NO_SITES
    from .._engine.select import CALL_ONLY, as_selector

    if where is not _NO_SITES and as_selector(where, CALL_ONLY).has_layers():
        return True
    return any(p.site.has_layers() for p in ops)


class Step:
    """The jitted step: ``step(*args) -> ({name: value}, row mask)``.

    ``origin`` maps each name to ``(key, call, part)``; it is filled while the step traces.
    """

    def __init__(
        self,
        fn: Any,
        where: Any,
        ops: tuple[Any, ...],
        dtype: Any,
        mask: Callable[..., Any] | None,
        row_axes: int,
        first: tuple[Any, ...],
        while_steps: int | None = None,
        inputs: bool = False,
    ) -> None:
        self.origin: dict[str, Origin] = {}
        whole = replication(first)

        def compute(f: Any, *args: Any) -> tuple[dict[str, Any], Any]:
            values = {}
            for name, origin, v in _outputs(f, where, ops, args, while_steps, inputs):
                self.origin[name] = origin
                values[name] = _cast(v, dtype)
            if mask is None:
                shapes = [(v.shape, self.origin[n].scans) for n, v in values.items()]
                m = jnp.ones(row_shape(shapes, row_axes) if shapes else (), bool)
            else:
                m = jnp.asarray(mask(*args), bool)
            return values, m if whole is None else jax.lax.with_sharding_constraint(m, whole)

        def body(f: Any, *args: Any) -> tuple[dict[str, Any], Any]:
            # Scans cut after the last layer stored: "blocks/up[2]" of a scanned stack runs
            # three layers, as XLA already stops an unrolled stack after the layer it needs.
            # Only for a one-layer selection: the pass traces twice and inlines jit calls.
            if not _selects_layers(where, ops):
                return compute(f, *args)
            if not is_nnx_module(f):
                return cut_scans(lambda *a: compute(f, *a))(*args)
            from flax import nnx

            graphdef, state = nnx.split(f)

            def pure(state: Any, *args: Any) -> Any:
                m = nnx.merge(graphdef, state)
                return compute(m, *args), nnx.state(m)

            out, state = cut_scans(pure)(state, *args)
            nnx.update(f, state)
            return out

        if is_nnx_module(fn):
            # An argument of jax.jit, rebuilt inside (read afresh on every call):
            # no NNX transform walking the graph per batch, and what the model sets on itself
            # while running (a variable created on first use) stays inside the program.
            jitted = jax.jit(lambda packed, *args: body(nnxsplit.lower(packed), *args))
            self._run: Callable[..., Any] = lambda *args: jitted(nnxsplit.lift(fn), *args)
            self._shapes: Callable[..., Any] = lambda *args: jax.eval_shape(
                jitted, nnxsplit.lift(fn), *args
            )
            self._lower: Callable[..., Any] = lambda *args: jitted.lower(nnxsplit.lift(fn), *args)
        else:
            run = jax.jit(lambda *args: body(fn, *args))
            self._run = run
            self._shapes = lambda *args: jax.eval_shape(run, *args)
            self._lower = run.lower

    @classmethod
    def cached(
        cls,
        fn: Any,
        where: Any,
        ops: tuple[Any, ...],
        dtype: Any,
        mask: Callable[..., Any] | None,
        row_axes: int,
        first: tuple[Any, ...],
        while_steps: int | None = None,
        inputs: bool = False,
    ) -> Step:
        """The step of an earlier run with the same arguments (its compilations kept), or a
        new one. Objects are compared by identity, and kept alive by the cache."""
        from .._capture.capture import _NO_SITES
        from .._engine.select import CALL_ONLY, as_selector

        # compares by value
        selector = where if where is _NO_SITES else as_selector(where, CALL_ONLY)
        key = (
            id(fn),
            selector,
            ops,
            str(dtype),
            id(mask),
            row_axes,
            replication(first),
            while_steps,
            inputs,
        )
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is fn and hit[1] is mask:
            return hit[2]
        step = cls(fn, where, ops, dtype, mask, row_axes, first, while_steps, inputs)
        _CACHE[key] = (fn, mask, step)
        while len(_CACHE) > 4:
            del _CACHE[next(iter(_CACHE))]
        return step

    def __call__(self, *args: Any) -> tuple[dict[str, Any], Any]:
        return self._run(*args)

    def lower(self, *args: Any) -> Any:
        """The step's program for these arguments, lowered (``jax.stages.Lowered``)."""
        return self._lower(*args)

    def shapes(self, *args: Any) -> tuple[dict[str, Any], Any]:
        """Abstract outputs (shapes and dtypes) for these arguments; computes nothing."""
        return self._shapes(*args)


_CACHE: dict[Any, tuple[Any, Any, Step]] = {}


def leaf_specs(
    step: Step, values: dict[str, Any], m: Any, row_axes: int, masked: bool
) -> tuple[list[Leaf], tuple[int, ...]]:
    """The stored arrays of ``step``'s outputs ``values`` and row mask ``m`` (arrays, or their
    shapes from :meth:`Step.shapes`) and the batch's row shape; checks that every value leads
    with the row axes.

    A value that scans stacked (a call site inside ``nnx.scan``/``lax.scan`` over layers:
    ``(layers, *rows, ...)``) is stored as one array per layer, ``name[i]`` (``name[i][j]``
    under two scans): each layer's rows are contiguous in the value, and a layer is what
    sparse autoencoders train on.
    """
    rows = tuple(m.shape)
    if masked and len(rows) != row_axes:
        raise HookaxError(
            f"hx.harvest: mask= returned a {len(rows)}-d mask of shape {rows}, but "
            f"row_axes={row_axes}. The mask has one entry per stored row: its shape is the "
            f"leading row_axes axes of every captured value. Fix: row_axes={len(rows)}."
        )
    leaves: list[Leaf] = []
    for source, v in values.items():
        o = step.origin[source]
        shape = tuple(v.shape)
        k = o.scans if shape[o.scans : o.scans + row_axes] == rows else 0
        if shape[k : k + row_axes] != rows or len(shape) < k + row_axes:
            stacked = f" after its {o.scans} leading scan axes" if o.scans else ""
            raise HookaxError(
                f"hx.harvest: call site output {source!r} has shape {shape}, whose leading "
                f"{row_axes} axes{stacked} are not the batch's rows {rows} (row_axes={row_axes}"
                f"{', from the mask' if masked else ', from the first output'}). Every stored "
                f"value must lead with the same row axes. Fix: select only call sites whose "
                f"outputs lead with the batch axes (where=...), or set row_axes= to match."
            )
        per_row = shape[k + row_axes :]
        for index in itertools.product(*map(range, shape[:k])):
            at = "".join(f"[{i}]" for i in index)
            # The index follows the call site's path, as a one-layer selection writes it:
            # "blocks/attn[2]:softmax", "blocks/mlp[2]:in", then "#call" and the part.
            site, colon, tail = o.key.partition(":")
            call = source[len(o.key) :].removesuffix(o.part)
            name = site + at + colon + tail + call + o.part
            leaves.append(
                Leaf(name, o.key, o.call, o.part, per_row, str(v.dtype), source, tuple(index))
            )
    names = [leaf.name for leaf in leaves]
    for name in names:
        if names.count(name) > 1:
            raise HookaxError(
                f"hx.harvest: two stored values would be named {name!r} (a layer of a scanned "
                f"call site and a part of an output of the same key). Fix: select only one of "
                f"them with where=."
            )
    return leaves, rows
