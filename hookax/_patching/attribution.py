"""``hx.attribution_patch``: a patching grid to first order, from one backward pass.

Attribution patching (Nanda, 2023) estimates the effect of patching an activation by
``(clean - corrupted) . d metric / d activation`` at the corrupted run. One compiled program
computes the clean values, and runs the corrupted forward and backward: for call sites, the
forward traced when the targets were found, run on the clean inputs and differentiated with
zeros added at the targets' marks; otherwise ``hx.value_and_grad`` over the targets, with
``hx.capture`` of their values inside it, and a capture of the clean values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._capture.actgrad import _differentiate, _mode, value_and_grad
from .._engine import firstcall
from .._engine.select import Where
from .._util import nnxsplit
from ..frameworks._functions import as_program
from . import compiled, cutgrid, targets
from .grid import Plan, capture_targets
from .heads import patch_mask
from .labelled import LabelledArray
from .patch import position_mask, scalar_metric, shifting, split_input

__all__ = ["attribution_patch"]

WHO = "hx.attribution_patch"


@dataclasses.dataclass(frozen=True)
class _Spec:
    rest: compiled.Static
    metric: compiled.Static
    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # each target's output shape (one call, one layer)
    axis: int
    ops: tuple[str, ...] = ()  # the keys that are operations
    heads: int | None = None  # the head axis of every target's value
    clean_rest: Any = None  # (fn, clean args) without their arrays
    plain: bool = False  # every target a call site inside no transform (targets.plain)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Closed:
    """A function without arrays, passed as a pytree with no leaves."""

    fn: Any


def _loss(
    metric: Callable[[Any], Any],
    keys: list[str],
    ops: list[str],
    inputs: list[str],
    plain: bool = False,
) -> Callable[..., Any]:
    """The metric and the targets' values; ``deltas`` (zeros) are added to the inputs named in
    ``inputs`` (``"key:in"``), so their gradients are the inputs' gradients."""

    def loss(deltas: Any, fn: Any, *args: Any) -> tuple[Any, Any]:
        fn = fn.fn if isinstance(fn, _Closed) else fn
        if inputs:
            with shifting(deltas):
                y, acts = capture_targets(fn, keys, ops, plain)(*args)
        else:
            y, acts = capture_targets(fn, keys, ops, plain)(*args)
        return _scalar(metric(y)), acts

    return loss


def _scalar(m: Any) -> Any:
    return scalar_metric(m, WHO)


def _from_forward(spec: _Spec, dyn: list[Any], clean_dyn: list[Any], metric: Any) -> Any:
    """``(clean, corrupted, gradients)`` of the targets from the forward they were found in
    (``targets.discover``'s program, each call site's value marked): run on the clean inputs,
    then differentiated at the corrupted ones with zeros added at the marks; no trace of the
    model. None where that program does not serve (operations, parts, a target inside a
    transform or called twice, another trace context, values that are not floats)."""
    if spec.ops or not cutgrid.eligible(spec.keys, ()):
        return None
    forward = targets.forward(dyn, spec.rest, spec.keys, clean_dyn, spec.clean_rest)
    if forward is None or forward.clean_flat is None:
        return None
    _, marked = cutgrid.delta_program(forward.program)
    if not all(k in marked for k in spec.keys):
        return None
    # Deltas at every float mark, not only the targets': the differentiated function is then
    # the same for every question over this forward, and JAX's derivative of it is reused.
    zeros = {k: jnp.zeros(a.shape, a.dtype) for k, a in marked.items()}
    _, clean = cutgrid.with_deltas(forward._replace(flat=forward.clean_flat), zeros)

    def loss(deltas: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        y, acts = cutgrid.with_deltas(forward, deltas)
        return _scalar(metric(y)), acts

    (_, corrupt), grads = jax.value_and_grad(loss, has_aux=True)(zeros)
    return tuple({k: (d[k],) for k in spec.keys} for d in (clean, corrupt, grads))


def _term(key: str, shape: tuple[int, ...], clean: Any, corrupt: Any, grad: Any) -> Any:
    """``(clean - corrupt) * grad`` of every call of ``key``, summed into one output's shape
    (a scanned call site's layers summed too)."""
    total = jnp.zeros(shape, jnp.float32)
    for c, x, g in zip(clean, corrupt, grad):
        t = (c.astype(jnp.float32) - x.astype(jnp.float32)) * g.astype(jnp.float32)
        total = total + (t.sum(0) if t.ndim == len(shape) + 1 else t)
    return total


def _row(term: Any, cols: Any, shape: tuple[int, ...], spec: _Spec, key: str) -> Any:
    """The term projected on the columns, and with ``heads=`` on each head: ``[n_heads, ...]``."""
    if spec.heads is None:
        return _project(term, cols, shape, spec.axis, key)
    n = shape[spec.heads % len(shape)]

    def one(head: Any) -> Any:
        mask = patch_mask(None, head, shape, spec.axis, spec.heads, key)
        return _project(jnp.where(mask, term, 0), cols, shape, spec.axis, key)

    return jax.vmap(one)(jnp.arange(n))


def _project(term: Any, cols: Any, shape: tuple[int, ...], axis: int, key: str) -> Any:
    """The term summed over each column's positions (all but ``axis`` for single indices)."""
    if cols is None:
        return term.sum()
    ax = axis % len(shape)
    if jnp.issubdtype(cols.dtype, jnp.integer) and cols.ndim == 1:
        per = term.sum(axis=tuple(i for i in range(term.ndim) if i != ax))
        return per[cols]
    return jax.vmap(lambda col: jnp.where(position_mask(col, shape, axis, key), term, 0).sum())(
        cols
    )


def _op_grads(
    metric: Any, keys: list[str], ops: list[str], sites: list[str], clean: Any, held: Any, args: Any
) -> tuple[Any, Any]:
    """The corrupted values and the gradients of targets among which are operations:
    ``hx.value_and_grad`` with ``ops=``, inputs (``"key:in"``) shifted by zeros."""
    inputs = [k for k in sites if split_input(k)[1]]
    loss = _loss(metric, keys, ops, inputs)
    deltas: Any = jnp.zeros((), jnp.float32)
    if inputs:
        deltas = {k: tuple(jnp.zeros(v.shape, jnp.float32) for v in clean[k]) for k in inputs}
    where = {"where": targets.selector(sites)} if sites else {}
    grad = value_and_grad(loss, **where, ops=ops or None, has_aux=True)
    (_, corrupt), input_grads, grads = grad(deltas, held, *args)
    return corrupt, {**grads, **input_grads} if inputs else grads


@firstcall.program(static_argnums=0)
def _attribute(
    spec: _Spec, dyn: list[Any], mdyn: list[Any], clean_dyn: list[Any], cols: Any
) -> Any:
    metric = compiled.join(mdyn, spec.metric)
    got = _from_forward(spec, dyn, clean_dyn, metric)
    if got is None:
        clean, corrupt, grads = _traced(spec, dyn, clean_dyn, metric)
    else:
        clean, corrupt, grads = got
    rows = []
    for key, shape in zip(spec.keys, spec.shapes):
        term = _term(
            key,
            shape,
            *(targets.values_of(acts, key) for acts in (clean, corrupt, grads)),
        )
        rows.append(_row(term, cols, shape, spec, key))
    return jnp.stack(rows)


def _traced(spec: _Spec, dyn: list[Any], clean_dyn: list[Any], metric: Any) -> Any:
    """``(clean, corrupted, gradients)`` of the targets, the model traced for each."""
    keys, ops = list(spec.keys), list(spec.ops)
    # The clean values in the same program: one compilation for the whole estimate.
    clean_fn, clean_args = compiled.join(clean_dyn, spec.clean_rest)
    _, clean = capture_targets(clean_fn, keys, ops, spec.plain)(*clean_args)
    fn, args = compiled.join(dyn, spec.rest)
    sites = [k for k in keys if k not in ops]
    # A module goes in as an argument (NNX transforms inside it need it at this trace level;
    # an NNX module that is no pytree too, or a variable it creates on first use would be set
    # from inside them); a function without arrays (Linen's apply) as an empty pytree that
    # holds it.
    leaves = jax.tree.leaves(fn, is_leaf=nnxsplit.is_module)
    held = fn if any(compiled.is_array(x) or nnxsplit.is_module(x) for x in leaves) else _Closed(fn)
    floating = all(
        jnp.issubdtype(v.dtype, jnp.inexact) for k in keys for v in targets.values_of(clean, k)
    )
    if ops or not floating:
        corrupt, grads = _op_grads(metric, keys, ops, sites, clean, held, args)
    else:
        # Zeros added to every target's value (one per call, as its clean values): their
        # gradients are the targets'. The shapes are the clean values': no discovery trace.
        deltas = {k: tuple(jnp.zeros_like(v) for v in targets.values_of(clean, k)) for k in keys}
        inner = _loss(metric, keys, [], keys, spec.plain)
        grad_in = lambda *a: inner(a[-1], *a[:-1])  # noqa: E731
        mode = _mode(grad_in, (held, *args), {}, ())
        (_, corrupt), (grads,) = _differentiate(grad_in, mode, (), True, (held, *args), deltas)
    return clean, corrupt, grads


def attribution_patch(
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
) -> LabelledArray:
    """The grid of [`hx.patch_grid`][hookax.patch_grid] to first order: the estimated change of
    the metric.

    Entry ``[target, column]`` is ``sum((clean - corrupted) * d metric / d output)`` over the
    column's positions (for ``positions="each"``: over every axis but ``axis``) of the target's
    output, the gradient taken at the corrupted run; a target called several times (or a
    scanned stack's call site, every layer) sums its calls' terms. It estimates
    ``patch_grid(...) - metric(fn(*corrupt_args))``. Costs one clean forward, and one corrupted
    forward and backward, whatever the grid's size.

    Args:
      fn: as [`hx.patch_grid`][hookax.patch_grid].
      clean_args: as [`hx.patch_grid`][hookax.patch_grid].
      corrupt_args: as [`hx.patch_grid`][hookax.patch_grid].
      where: as [`hx.patch_grid`][hookax.patch_grid].
      ops: as [`hx.patch_grid`][hookax.patch_grid].
      heads: as [`hx.patch_grid`][hookax.patch_grid]: entry ``[target, head, column]`` sums
        the term over one head's part of the value.
      positions: as [`hx.patch_grid`][hookax.patch_grid].
      axis: as [`hx.patch_grid`][hookax.patch_grid].
      metric: ``fn``'s output -> a scalar.

    Returns:
      A [`hx.LabelledArray`][hookax.LabelledArray] laid out and labelled as
      [`hx.patch_grid`][hookax.patch_grid]'s, in float32, its values changes of the metric
      (``delta``), with the metric of the clean and the corrupted run.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> clean, corrupt = jnp.ones((1, 3, 2)), jnp.zeros((1, 3, 2))
      >>> metric = lambda y: y[0, -1].sum()
      >>> est = hx.attribution_patch(model, (clean,), (corrupt,), metric, where="")
      >>> exact = hx.patch_grid(model, (clean,), (corrupt,), metric, where="")
      >>> bool(jnp.allclose(est, exact - metric(model(corrupt))))  # exact for a linear metric
      True
    """

    fn = as_program(fn)  # a program without modules: its own call sites

    def run() -> LabelledArray:
        plan = Plan(WHO, fn, clean_args, corrupt_args, metric, where, positions, axis, ops, heads)
        shapes = tuple(tuple(plan.shapes[k].shape) for k in plan.keys)
        spec = _Spec(
            plan.rest,
            plan.metric,
            tuple(plan.keys),
            shapes,
            axis,
            tuple(plan.ops),
            heads,
            plan.clean_rest,
            plan.plain,
        )
        est = _attribute(spec, plan.dyn, plan.mdyn, plan.clean_dyn, plan.cols)
        return plan.labelled(est, delta=True, title="estimated change of the metric")

    return compiled.retrying(WHO, (fn, metric), run)
