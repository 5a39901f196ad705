"""Per-call-site statistics of outputs and their gradients, reduced inside a jitted train step.

``loss, grads, stats = hx.value_grad_and_stats(loss_fn)(model, x, y)``: beside the loss and the
parameter gradients, statistics of each selected call site's output and of d loss / d (that
output), read as ``stats[key]["grad"]["norm"]`` ([`hx.Stats`][hookax.Stats]: one small array, so one
buffer leaves the step). Nothing activation-sized leaves the step, and nothing activation-sized
is kept for it.

How (the best hand-written method measured, ``DESIGN.md`` point 19): each selected call site's
output passes through an identity with a custom derivative, ``_tap``, that also takes a small
zero dummy of ``2 * len(stats)`` numbers. Its forward rule reduces the output to its statistics
in place (they are the rule's only residuals); its backward rule returns the cotangent unchanged
and, as the dummy's cotangent, the forward statistics followed by the cotangent's. So the
gradient with respect to the dummies *is* the statistics. The dummies are the probes of
``hx.value_and_grad``'s mechanism (``_capture.actgrad``): marked at the call site
(``_StatsMarker``), they enter ``jit``, ``scan``, ``remat`` and ``cond`` as extra inputs, so
a call site inside a scan over layers gets one row of statistics per layer, and a call site inside
a ``vmap`` one per example, exactly as [`hx.capture`][hookax.capture] lays out values; the
examples' statistics are then combined into the batch's (``norm`` from the examples' norms,
``std`` pooled from their means and deviations, ...), unless asked per example.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._capture import actgrad as _actgrad
from .._capture import capture as _capture
from .._engine.select import Where
from .._transforms import tags as _tags
from .._util.errors import HookaxError
from ..frameworks._functions import as_program
from .statsview import Stats

__all__ = ["DEFAULT_STATS", "STATS", "StatsMarker", "layer_axes", "value_grad_and_stats"]

WHO = "hx.value_grad_and_stats"


def _f32(xs: tuple[Any, ...]) -> list[Any]:
    return [x.astype(jnp.float32) for x in xs]


def _count(xs: tuple[Any, ...]) -> int:
    return sum(int(x.size) for x in xs)


def _total(parts: list[Any]) -> Any:
    """``parts[0] + parts[1] + ...`` (not Python's ``sum``: its ``0 + x`` is an operation XLA
    keeps, since ``-0.0 + 0`` is not ``-0.0``, and it stops the reduction fusing with its user)."""
    return functools.reduce(operator.add, parts)


def _norm(xs: tuple[Any, ...]) -> Any:
    return jnp.sqrt(_total([jnp.sum(jnp.square(x)) for x in _f32(xs)]))


def _rms(xs: tuple[Any, ...]) -> Any:
    return _norm(xs) / jnp.sqrt(jnp.float32(max(_count(xs), 1)))


def _mean(xs: tuple[Any, ...]) -> Any:
    return _total([jnp.sum(x) for x in _f32(xs)]) / jnp.float32(max(_count(xs), 1))


def _std(xs: tuple[Any, ...]) -> Any:
    if len(xs) == 1:
        return jnp.std(xs[0].astype(jnp.float32))
    # several leaves: pooled from each leaf's mean and variance (no second pass over them all)
    n = jnp.float32(max(_count(xs), 1))
    m = _mean(xs)
    parts = [x.size * (jnp.var(x) + jnp.square(jnp.mean(x) - m)) for x in _f32(xs)]
    return jnp.sqrt(_total(parts) / n)


def _max_abs(xs: tuple[Any, ...]) -> Any:
    # initial= only for an empty array: it is one more operation after the reduction
    tops = [jnp.max(jnp.abs(x), initial=0.0 if x.size == 0 else None) for x in _f32(xs)]
    return functools.reduce(jnp.maximum, tops)


def _frac_zero(xs: tuple[Any, ...]) -> Any:
    zeros = _total([jnp.sum(x == 0, dtype=jnp.float32) for x in xs])
    return zeros / jnp.float32(max(_count(xs), 1))


def _nonfinite(xs: tuple[Any, ...]) -> Any:
    return _total([jnp.sum(~jnp.isfinite(x), dtype=jnp.float32) for x in xs])


# name -> reduction of a tuple of floating arrays to a float32 scalar
STATS: dict[str, Callable[[tuple[Any, ...]], Any]] = {
    "norm": _norm,
    "rms": _rms,
    "mean": _mean,
    "std": _std,
    "max_abs": _max_abs,
    "frac_zero": _frac_zero,
    "nonfinite": _nonfinite,
}
DEFAULT_STATS = ("norm", "mean", "max_abs", "frac_zero", "nonfinite")


def _reduce(names: tuple[str, ...], xs: tuple[Any, ...]) -> Any:
    return jnp.stack([jnp.asarray(STATS[n](xs), jnp.float32) for n in names])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap(names: tuple[str, ...], xs: tuple[Any, ...], dummy: Any) -> tuple[Any, ...]:
    """The identity on ``xs``; d (anything) / d ``dummy`` is the statistics (module docstring)."""
    return xs


def _tap_fwd(names: tuple[str, ...], xs: tuple[Any, ...], dummy: Any) -> Any:
    return xs, _reduce(names, xs)


def _tap_bwd(names: tuple[str, ...], forward: Any, cts: tuple[Any, ...]) -> Any:
    return cts, jnp.concatenate([forward, _reduce(names, cts)])


_tap.defvjp(_tap_fwd, _tap_bwd)


def _dummy(x: Any, n: int) -> Any:
    """``n`` float32 zeros that carry the batch axes of ``x`` (under ``vmap`` inside a model).

    A dummy independent of a ``vmap``-ed output would be unbatched, and JAX would sum its
    per-example cotangents: every statistic would be a sum over the examples. The sum of an
    empty slice of ``x`` is exactly zero (never NaN), batched like ``x``, folded by XLA, and
    valid for any sharding (an empty slice divides every mesh axis).
    """
    v = x if x.ndim else x[None]
    zero = jnp.sum(lax.stop_gradient(v[:0]), dtype=jnp.float32)
    return jnp.zeros((n,), jnp.float32) + zero


@dataclasses.dataclass(frozen=True)
class StatsMarker(_capture._Marker):
    """The session's interceptor: taps each selected call site's floating outputs (all of them
    together), marking the tap's dummy instead of the output. Compared by value (cache key)."""

    names: tuple[str, ...] = DEFAULT_STATS

    def tag(self, out: Any, key: str) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(out)
        first: dict[int, int] = {}  # an array that is there twice (tied weights) counts once
        for i, x in enumerate(leaves):
            if _is_float_array(x):
                first.setdefault(id(x), i)
        where = sorted(first.values())
        if not where:
            return out  # no floating output: nothing to measure, no record
        xs = tuple(leaves[i] for i in where)
        dummy = _tags.mark(_dummy(xs[0], 2 * len(self.names)), self.sid, key)
        tapped = dict(zip(where, _tap(self.names, xs, dummy)))
        leaves = [tapped[first[id(x)]] if id(x) in first else x for x in leaves]
        return jax.tree_util.tree_unflatten(treedef, leaves)


def _is_float_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and jnp.issubdtype(x.dtype, jnp.inexact)


def _check_names(stats: Any) -> tuple[str, ...]:
    names = (stats,) if isinstance(stats, str) else tuple(stats)
    bad = [n for n in names if n not in STATS]
    if bad or not names or len(set(names)) != len(names):
        raise HookaxError(
            f"{WHO}: stats={stats!r} is not a tuple of distinct statistic names"
            f"{f' ({bad[0]!r} is unknown)' if bad else ''}. Known: {', '.join(STATS)}. Fix: "
            f'stats=("norm", "max_abs").'
        )
    return names


def _pooled_std(col: dict[str, Any], axes: tuple[int, ...]) -> Any:
    m = jnp.mean(col["mean"], axes, keepdims=True)
    spread = jnp.square(col["std"]) + jnp.square(col["mean"] - m)
    return jnp.sqrt(jnp.mean(spread, axes))


# name -> the statistic over a batch from the examples' ones (every example has the same
# number of values: a vmap's); ``col`` maps each measured name to its per-example values
_OVER_BATCH: dict[str, Callable[[dict[str, Any], tuple[int, ...]], Any]] = {
    "norm": lambda col, axes: jnp.sqrt(jnp.sum(jnp.square(col["norm"]), axes)),
    "rms": lambda col, axes: jnp.sqrt(jnp.mean(jnp.square(col["rms"]), axes)),
    "mean": lambda col, axes: jnp.mean(col["mean"], axes),
    "std": _pooled_std,
    "max_abs": lambda col, axes: jnp.max(col["max_abs"], axes),
    "frac_zero": lambda col, axes: jnp.mean(col["frac_zero"], axes),
    "nonfinite": lambda col, axes: jnp.sum(col["nonfinite"], axes),
}


def measured(names: tuple[str, ...], per_example: bool) -> tuple[str, ...]:
    """The statistics the taps compute for ``names``: over a batch, ``std`` needs the
    examples' means too."""
    if per_example or "std" not in names or "mean" in names:
        return names
    return (*names, "mean")


def _over_batch(
    v: Any, lead: int, names: tuple[str, ...], inner: tuple[str, ...], per_example: bool
) -> Any:
    """A record's statistics ``(*layers, *batch, 2 * len(inner))`` as ``names`` over its
    batch axes (those of a vmap inside the model), or kept per example."""
    axes = () if per_example else tuple(range(lead, v.ndim - 1))
    if not axes and inner == names:
        return v
    m = len(inner)
    halves = []
    for half in (v[..., :m], v[..., m:]):  # the output's, then the gradient's
        col = {n: half[..., i] for i, n in enumerate(inner)}
        if axes:
            halves += [_OVER_BATCH[n](col, axes) for n in names]
        else:
            halves += [col[n] for n in names]
    return jnp.stack(halves, axis=-1)


def layer_axes(axes: tuple[tuple[str, Any], ...]) -> int:
    """How many leading axes of a record are layers (``scan``) or shards (``shard_map``)."""
    return sum(1 for kind, _ in axes if kind in ("scan", "shard_map"))


def value_grad_and_stats(
    fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    *,
    where: Where = None,
    stats: Any = DEFAULT_STATS,
    has_aux: bool = False,
    per_example: bool = False,
) -> Callable[..., tuple[Any, Any, Stats]]:
    """Like ``value_and_grad``, plus statistics of each selected call site's output and gradient.

    ``loss, grads, stats = hx.value_grad_and_stats(loss_fn)(model, x, y)``. ``loss`` and
    ``grads`` are what the framework's own ``value_and_grad`` returns (as in
    ``hx.value_and_grad``); ``stats[key]["act"][name]`` is a statistic of that call
    site's output and ``stats[key]["grad"][name]`` the same statistic of d loss / d (that output),
    float32, reduced inside the step: a scalar per call, one value per layer for a call site
    inside a scan over layers (leading axis). A call site inside a ``vmap`` in the model (an
    Equinox model run as ``jax.vmap(model)(x)`` inside the loss) gets its statistics over the
    whole batch, as an unbatched layer would (``per_example=True`` keeps one value per example,
    the vmaps' axes after the layers'); a ``vmap`` around the whole step gives one value per
    example, as it gives every other value. A call
    site called several times gets its calls stacked on a new leading axis. The statistics of a
    call site's floating outputs are taken over all of them together (integer outputs are left
    out; a call site with none has no entry). ``stats`` is an [`hx.Stats`][hookax.Stats], a
    mapping from key (in the order the call sites finished) whose values all live in one array,
    so the step returns one buffer for them (``stats.to_dict()``: plain dicts).

    Statistics (``stats=``): ``"norm"`` (2-norm), ``"rms"``, ``"mean"``, ``"std"``,
    ``"max_abs"``, ``"frac_zero"`` (fraction of exact zeros), ``"nonfinite"`` (count of NaN and
    Inf, as a float). Each is one reduction over the output, fused into the step; the cost is that
    of hand-written taps ([benchmarks](../benchmarks.md#statistics-inside-a-training-step)),
    with no activation-sized buffer.

    Works inside ``jax.jit``/``nnx.jit`` train steps (with optax), ``vmap`` around or inside the
    model, ``nnx.scan``/``lax.scan`` over layers, ``remat``, as ``hx.value_and_grad``
    does (and with its limits: not inside ``while_loop`` or a ``custom_vjp`` function). A call
    site whose output does not reach the loss reports zeros (JAX does not run its backward).

    Args:
      fn: the loss function; returns a scalar, or ``(scalar, aux)`` with ``has_aux=True``.
      argnums: which positional arguments ``grads`` is taken for.
      where: which call sites (any ``where=`` selector); default every module's ``__call__``.
      stats: names of the statistics, in the order they are computed.
      has_aux: whether ``fn`` returns ``(loss, aux)``.
      per_example: keep the statistics of a call site inside a ``vmap`` in the model per
        example instead of over the batch.

    Returns:
      A function of ``fn``'s arguments returning ``(loss, grads, stats)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> def loss_fn(model, x):
      ...     return jnp.sum(model(x) ** 2)
      >>> x = jnp.ones((4, 2))
      >>> loss, grads, stats = hx.value_grad_and_stats(loss_fn, stats=("norm",))(model, x)
      >>> bool(jnp.allclose(stats[""]["act"]["norm"], jnp.linalg.norm(model(x))))
      True
      >>> bool(jnp.allclose(stats[""]["grad"]["norm"], 2 * stats[""]["act"]["norm"]))
      True
    """
    fn = as_program(fn)  # a program without modules: its own call sites
    if not callable(fn):
        raise HookaxError(
            f"{WHO} expects a loss function, got {fn!r} of type {type(fn).__name__}. Fix: "
            f"hx.value_grad_and_stats(lambda model, x: model(x).sum())."
        )
    names = _check_names(stats)
    where, _ = _capture.where_and_ops(where, None, WHO)  # a malformed where= raises here
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    inner = measured(names, per_example)
    marker = functools.partial(StatsMarker, names=inner)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, Stats]:
        value, grads, records, g = run(fn, args, kwargs, nums, argnums, where, has_aux, marker)
        return value, grads, layout(records, g, names, inner, per_example)

    return wrapped


def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nums: tuple[int, ...],
    argnums: Any,
    where: Any,
    has_aux: bool,
    marker: Any,
    who: str = WHO,
) -> tuple[Any, Any, list[Any], list[Any]]:
    """``(value, grads, records, dummy gradients)``: the steps of ``hx.value_and_grad``
    with the statistics marker (records as ``_actgrad._discover`` gives them); ``who`` names
    the caller in errors."""
    nums_pos = _actgrad._positions(nums, argnums, args)
    mode = _actgrad._mode(fn, args, kwargs, nums_pos)
    records, _ = _actgrad._discover(fn, where, (), mode, args, kwargs, who, marker)
    inner = _actgrad._planted(fn, where, (), records, kwargs, who, marker)
    zeros = _actgrad._zeros(records)
    value, g = _actgrad._differentiate(inner, mode, nums_pos, has_aux, args, zeros)
    grads = g[0] if not isinstance(argnums, tuple) else tuple(g[:-1])
    return value, grads, records, [leaves[0] for leaves in g[-1]]


def layout(
    records: list[Any],
    g: list[Any],
    names: tuple[str, ...],
    inner: tuple[str, ...] | None = None,
    per_example: bool = False,
) -> Stats:
    """``Stats`` from the dummies' gradients (the statistics ``inner``, default ``names``),
    keys in the order their first call ended; several calls of one call site stacked on a new
    leading axis; a vmap's axes reduced over unless ``per_example``."""
    per_key: dict[str, list[Any]] = {}
    for (key, _, _, (axes, layered)), v in zip(records, g):
        v = _over_batch(v, layer_axes(axes), names, inner or names, per_example)
        # a one-layer selection ("blocks/lin[2]") stacked over its scan: one key per layer
        for k, part in _capture.layer_split(key, v, axes, layered):
            per_key.setdefault(k, []).append(part)
    blocks, lead = [], []
    for key, values in per_key.items():
        if len(values) > 1 and len({v.shape for v in values}) > 1:
            raise HookaxError(
                f"{WHO}: call site {key!r} is called several times with different layouts "
                f"({', '.join(str(v.shape[:-1]) for v in values)}: e.g. inside and outside a "
                f"scan), so its statistics cannot be stacked. Fix: select its calls apart with "
                f"where=, or measure one of them."
            )
        v = values[0] if len(values) == 1 else jnp.stack(values)
        # (..., 2n) as (..., 2, n): act then grad; flattened into the one array of the step
        lead.append((key, tuple(v.shape[:-1])))
        blocks.append(v.reshape(-1))
    flat = jnp.concatenate(blocks) if blocks else jnp.zeros((0,), jnp.float32)
    return Stats(flat, tuple(lead), names)
