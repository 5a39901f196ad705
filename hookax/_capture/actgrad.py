"""``hx.value_and_grad``: gradients of the loss with respect to call-site outputs, no model edits.

The mechanism is NNX's ``perturb`` without the model edits, through every transform:

1. the selected call sites' records (key, output structure, shapes, stacked as capture stacks
   them) are found abstractly: a capture session (``_tags``, *reap*) under ``eval_shape``;
2. zero probes of those shapes are passed as one more argument to the framework's
   ``value_and_grad``;
3. while differentiating, a *plant* session adds each probe to its marked output (``x + 0``,
   folded by XLA), threading probes into scans, jits, conds and remats as extra inputs
   (``_tagrules``), so the gradient with respect to a probe is d loss / d output.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp

from .._engine import adapters as _adapters
from .._engine import eager as _eager
from .._engine.select import Where
from .._transforms import tags as _tags
from .._util.errors import HookaxError
from ..frameworks._functions import as_program
from . import capture as _capture

__all__ = ["value_and_grad"]

WHO = "hx.value_and_grad"


def _is_nnx(objs: Any) -> bool:
    if "flax.nnx" not in sys.modules:
        return False
    from flax import nnx

    leaves = jax.tree.leaves(objs, is_leaf=lambda x: isinstance(x, nnx.Module))
    return any(isinstance(leaf, nnx.Module) for leaf in leaves)


def is_nnx_module(obj: Any) -> bool:
    """Whether ``obj`` is an NNX module (without importing Flax)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(obj, nnx.Module)


def _is_equinox(objs: Any) -> bool:
    if "equinox" not in sys.modules:
        return False
    import equinox as eqx

    leaves = jax.tree.leaves(objs, is_leaf=lambda x: isinstance(x, eqx.Module))
    return any(isinstance(leaf, eqx.Module) for leaf in leaves)


def _eqx_value_and_grad(
    inner: Callable[..., Any], nums: tuple[int, ...], has_aux: bool, args: tuple, perturbs: Any
) -> tuple[Any, tuple[Any, ...]]:
    """``eqx.filter_value_and_grad`` over the ``nums`` arguments and the perturbations.

    Equinox differentiates its first argument only, so that is ``(selected args, perturbs)``;
    the gradients are laid out like ``jax.value_and_grad``'s over ``(*nums, perturbs)``.
    """
    import equinox as eqx

    def diff_fn(diff: Any, *rest: Any) -> Any:
        chosen, p = diff
        it = iter(rest)
        full = [chosen[nums.index(i)] if i in nums else next(it) for i in range(len(args))]
        return inner(*full, p)

    rest = [a for i, a in enumerate(args) if i not in nums]
    diff = (tuple(args[n] for n in nums), perturbs)
    value, (gs, gp) = eqx.filter_value_and_grad(diff_fn, has_aux=has_aux)(diff, *rest)
    return value, (*gs, gp)


def _discover(
    fn: Any,
    where: Any,
    ops: tuple[Any, ...],
    mode: Any,
    args: tuple,
    kwargs: dict,
    who: str = WHO,
    marker: Any = _capture._Marker,
) -> tuple[list[Any], list[str]]:
    """The records a capture of ``fn(*args)`` makes, as ``(key, spec, avals, (axes, layered))``
    (axes: the transforms each value left, :class:`hookax._transforms.tags.Record`; layered: the
    session's one-layer selections, :func:`hookax._capture.capture.layer_split`), abstractly; and
    the keys in the order their first call started (the order ``hx.capture`` gives). ``who`` and
    ``marker``: the caller's name and its session marker (:func:`hookax._capture.capture.session`).
    """
    found: list[Any] = []
    order: list[str] = []

    def probe(*a: Any, **k: Any) -> Any:
        s = _capture.session(who, where, fn, a, k, ops=ops, marker=marker)
        s.run(fn, *a, **k)
        layered = s.session.layered
        found[:] = [(r.key, r.spec, (r.axes, layered)) for r in s.session.records]
        order[:] = list(_capture.collect(s.session))
        return [r.values for r in s.session.records]

    shapes = eval_shape(probe, mode, args, kwargs)
    return [
        (key, spec, avals, how) for (key, spec, how), avals in zip(found, shapes, strict=True)
    ], order


def eval_shape(probe: Callable[..., Any], mode: Any, args: tuple, kwargs: dict) -> Any:
    """``probe(*args, **kwargs)`` abstractly, through the framework's own ``eval_shape``
    (``mode``: ``"equinox"``, true for NNX, false for plain JAX)."""
    if mode == "equinox":
        import equinox as eqx

        return eqx.filter_eval_shape(probe, *args, **kwargs)
    if mode:
        from flax import nnx

        return nnx.eval_shape(probe, *args, **kwargs)
    return jax.eval_shape(probe, *args, **kwargs)


def framework_mode(fn: Any, args: tuple, kwargs: dict) -> Any:
    """How to run ``fn(*args)`` abstractly: ``"equinox"``, True (NNX) or False."""
    if _is_nnx((args, kwargs, list(_capture.roots(fn)))):
        return True
    return "equinox" if _is_equinox((args, kwargs, list(_capture.roots(fn)))) else False


def _zeros(records: list[Any]) -> list[list[Any]]:
    with _eager.eager_workflow():  # eagerly: NumPy first, as the gradient's own programs
        return [
            [
                jnp.zeros(a.shape, a.dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else None
                for a in avals
            ]
            for _, _, avals, _ in records
        ]


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    *,
    where: Where = _capture._DEFAULT,
    ops: Any = None,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, dict[str, tuple[Any, ...]]]]:
    """Like ``value_and_grad``, plus the gradient of the loss with respect to call-site outputs.

    ``loss, grads, act_grads = hx.value_and_grad(loss_fn)(model, x, y)``. ``grads`` is what the
    framework's own ``value_and_grad`` returns for ``argnums`` (``nnx.value_and_grad`` when an
    argument holds an NNX module, ``eqx.filter_value_and_grad`` when a differentiated argument
    holds an Equinox module, ``jax.value_and_grad`` otherwise, e.g. for Linen parameter dicts).
    ``act_grads`` maps each selected call site's key to a tuple, one entry per call: d loss /
    d (that call's output), with the output's structure (``None`` for integer outputs). No model
    edits: costs at most what NNX's ``perturb`` costs, in time and memory
    ([benchmarks](../benchmarks.md#activation-gradients-and-capture)).

    Works wherever [`hx.capture`][hookax.capture] does, and the gradients are laid out like its
    values: inside ``nnx.scan``/``lax.scan`` stacked on the scan axis, inside ``vmap`` with the
    batch axis in front, inside ``jax.jit`` with the model as an argument; the active selection is
    part of the jit cache key. Call sites whose derivative JAX cannot give (inside ``while_loop``, a
    ``custom_jvp``/``custom_vjp`` function, or a ``shard_map`` body) raise
    [`hx.HookaxError`][hookax.HookaxError] naming the call site; exclude them with ``where=``.

    ``ops=`` adds gradients with respect to operations inside call sites
    (``act_grads["layers/0/attn:softmax"]``), addressed as [`hx.ops`][hookax.ops] lists them. An
    operation inside a ``custom_jvp``/``custom_vjp`` function has no gradient of its own (JAX
    differentiates the function by its rule): address the function instead.

    Args:
      fn: the loss function; returns a scalar, or ``(scalar, aux)`` with ``has_aux=True``.
      argnums: which positional arguments ``grads`` is taken for.
      where: which call sites; default every module's ``__call__``, or none when ``ops=`` is
        given.
      ops: operation addresses (``"layers/0/attn:softmax"``), or a list.
      has_aux: whether ``fn`` returns ``(loss, aux)``.

    Returns:
      A function of ``fn``'s arguments returning ``(loss, grads, act_grads)``, or
      ``((loss, aux), grads, act_grads)`` with ``has_aux=True``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(model, x):
      ...     return jnp.sum(model(x) ** 2)
      >>> loss, grads, act_grads = hx.value_and_grad(loss_fn)(model, jnp.ones((3, 2)))
      >>> bool(jnp.allclose(act_grads[""][0], 2 * model(jnp.ones((3, 2)))))
      True
    """
    fn = as_program(fn)  # a program without modules: its own call sites
    if not callable(fn):
        raise HookaxError(
            f"hx.value_and_grad expects a loss function, got {fn!r} of type "
            f"{type(fn).__name__}. Fix: hx.value_and_grad(lambda model, x: model(x).sum())."
        )
    where, patterns = _capture.where_and_ops(where, ops, WHO)  # malformed ones raise here
    nums = argnums if isinstance(argnums, tuple) else (argnums,)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, dict[str, tuple[Any, ...]]]:
        nums_pos = _positions(nums, argnums, args)
        linen = next((args[n] for n in nums_pos if _adapters.is_linen(args[n])), None)
        if linen is not None:  # bound or not, a Linen module is no pytree to differentiate
            raise _adapters.linen_needs_variables(WHO, linen)
        mode = _mode(fn, args, kwargs, nums_pos)
        # 1. which call sites run, with their output specs (an abstract trace)
        records, order = _discover(fn, where, patterns, mode, args, kwargs)
        # 2. the loss with a zero perturbation planted on each of them, as one more argument
        inner = _planted(fn, where, patterns, records, kwargs)
        # 3. the framework's own value_and_grad over the arguments and the perturbations
        value, g = _differentiate(inner, mode, nums_pos, has_aux, args, _zeros(records))
        grads = g[0] if not isinstance(argnums, tuple) else tuple(g[:-1])
        # 4. the perturbations' gradients, laid out like hx.capture's values
        return value, grads, _act_grads(records, order, g[-1])

    return wrapped


def _positions(nums: tuple[Any, ...], argnums: Any, args: tuple[Any, ...]) -> tuple[int, ...]:
    """``argnums`` as non-negative positions of ``args``; an out-of-range one raises."""
    for n in nums:
        if not isinstance(n, int) or not -len(args) <= n < len(args):
            raise HookaxError(
                f"hx.value_and_grad: argnums={argnums!r} names no positional argument of "
                f"the {len(args)} given. Pass the model and data positionally: "
                f"hx.value_and_grad(loss_fn)(model, x, y)."
            )
    return tuple(n % len(args) for n in nums)


def _mode(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], nums_pos: tuple[int, ...]) -> Any:
    """Whose ``value_and_grad`` to use: ``True`` (NNX), ``"equinox"``, or ``False`` (JAX's)."""
    nnx_mode = _is_nnx((args, kwargs, list(_capture.roots(fn))))
    if not nnx_mode and _is_equinox([args[n] for n in nums_pos]):
        return "equinox"
    return nnx_mode


def _planted(
    fn: Callable[..., Any],
    where: Any,
    patterns: Any,
    records: list[Any],
    kwargs: dict[str, Any],
    who: str = WHO,
    marker: Any = _capture._Marker,
) -> Callable[..., Any]:
    """``fn`` taking the perturbations as a last argument, planted on the recorded call sites."""

    def inner(*a: Any) -> Any:
        *fargs, p = a
        s = _capture.session(
            who, where, fn, tuple(fargs), kwargs, "plant", p, patterns, marker=marker
        )
        out = s.run(fn, *fargs, **kwargs)
        if s.session.used != len(p):
            key = records[s.session.used][0]
            raise HookaxError(
                f"{who}: call site {key!r} ran fewer times while differentiating than when "
                f"its outputs were measured; its gradients would be wrong. The function must "
                f"call the same modules the same number of times for the same inputs."
            )
        return out

    return inner


def _differentiate(
    inner: Callable[..., Any],
    mode: Any,
    nums_pos: tuple[int, ...],
    has_aux: bool,
    args: tuple[Any, ...],
    perturbs: Any,
) -> tuple[Any, Any]:
    """``(value, gradients)`` of ``inner`` for ``nums_pos`` and the perturbations (last).
    Called eagerly, the programs JAX runs (the forward's and the backward pass's operations)
    run with NumPy the first time (``hookax._engine.eager.eager_workflow``)."""
    with _eager.eager_workflow():
        if mode == "equinox":
            return _eqx_value_and_grad(inner, nums_pos, has_aux, args, perturbs)
        if mode:
            return _nnx_value_and_grad(inner, nums_pos, has_aux, args, perturbs)
        vg = jax.value_and_grad(inner, argnums=(*nums_pos, len(args)), has_aux=has_aux)
        return vg(*args, perturbs)


def _nnx_value_and_grad(
    inner: Callable[..., Any], nums: tuple[int, ...], has_aux: bool, args: tuple, perturbs: Any
) -> tuple[Any, tuple[Any, ...]]:
    """``nnx.value_and_grad`` over the ``nums`` arguments and the perturbations, written as
    the functional NNX API writes it: the modules of ``args`` split (one ``nnx.split``, so
    shared modules stay shared), ``jax.value_and_grad`` over the ``nnx.Param`` state of those
    in ``nums``, merged inside, and what the call set on them (batch statistics, RNG counts, a
    lazily created variable) written back. Unlike ``nnx.value_and_grad`` it does not refuse a
    variable from an outer trace that a module holds as static data (a ``cached_property``
    RoPE table, set on first use) and whose value it only reads. The gradient of a module is
    the ``nnx.State`` of its parameters, as ``nnx.grad`` gives it."""
    from flax import nnx

    flat = [jax.tree.flatten(a, is_leaf=is_nnx_module) for a in args]
    mods: list[Any] = []
    index: dict[int, int] = {}  # argument position -> index in mods, for a module argument
    for i, (leaves, _) in enumerate(flat):
        found = [x for x in leaves if is_nnx_module(x)]
        if i in nums and found and not is_nnx_module(args[i]):
            # A differentiated pytree holding modules: NNX's own transform lays out its grads.
            vg = nnx.value_and_grad(inner, argnums=(*nums, len(args)), has_aux=has_aux)
            return vg(*args, perturbs)
        if is_nnx_module(args[i]):
            index[i] = len(mods)
        mods.extend(found)
    if not mods:
        vg = jax.value_and_grad(inner, argnums=(*nums, len(args)), has_aux=has_aux)
        return vg(*args, perturbs)
    diff_mods = {index[i] for i in nums if i in index}

    def diff(path: tuple[Any, ...], x: Any) -> bool:
        return isinstance(x, nnx.Param) and bool(path) and path[0] in diff_mods

    graphdef, params, rest = cast(Any, nnx.split(tuple(mods), diff, ...))
    arrays = [i for i in nums if i not in index]

    def f(params: Any, arrs: tuple, p: Any, rest: Any) -> Any:
        # Variables made anew in this trace (jax.grad hands the undifferentiated argument over
        # as it is): the call may set them (batch statistics).
        rest = jax.tree.map(lambda x: x, rest)
        merged = nnx.merge(graphdef, params, rest)
        ms = iter(merged)
        full = []
        for i, (leaves, treedef) in enumerate(flat):
            if i in arrays:
                full.append(arrs[arrays.index(i)])
            else:
                full.append(
                    jax.tree.unflatten(
                        treedef, [next(ms) if is_nnx_module(x) else x for x in leaves]
                    )
                )
        out = inner(*full, p)
        new_rest = cast(Any, nnx.split(merged, diff, ...))[2]
        value, aux = out if has_aux else (out, None)
        return value, (aux, new_rest)

    vg = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
    (value, (aux, new_rest)), (g_params, g_arrs, g_p) = vg(
        params, tuple(args[i] for i in arrays), perturbs, rest
    )
    nnx.update(tuple(mods), new_rest)
    grads = [
        g_arrs[arrays.index(i)] if i in arrays else _sub_state(nnx, g_params, index[i])
        for i in nums
    ]
    return ((value, aux) if has_aux else value), (*grads, g_p)


def _sub_state(nnx: Any, state: Any, k: int) -> Any:
    """The part of a split of several modules that belongs to the ``k``-th (empty when it has
    no parameters)."""
    return state[k] if k in state else nnx.State({})


def _act_grads(records: list[Any], order: list[str], g: Any) -> dict[str, tuple[Any, ...]]:
    """The perturbations' gradients by call-site key, one entry per call, in call order."""
    act_grads: dict[str, list[Any]] = {k: [] for k in order}
    for (key, spec, _, (axes, layered)), leaves in zip(records, g):
        tree = _tags.unwrap(spec.rebuild(list(leaves), axes))
        for k, v in _capture.layer_split(key, tree, axes, layered):
            act_grads.setdefault(k, []).append(v)
    return {k: tuple(v) for k, v in act_grads.items()}
