"""``hx.value_and_grad``: gradients of the loss with respect to call-site outputs, no model edits.

The mechanism is NNX's ``perturb`` without the model edits and without activation-sized inputs:

1. the selected call sites and their output shapes are found abstractly (``hx.capture`` under
   ``eval_shape``: trace time only);
2. zeros of those shapes are created inside the traced computation and passed as one more
   argument to the framework's ``value_and_grad``;
3. while differentiating, an interceptor adds the zeros to each selected output (``x + 0``, which
   XLA folds away), so the gradient with respect to the zeros is d loss / d output.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import _capture
from ._errors import HookaxError
from ._select import CALL_ONLY, as_selector

__all__ = ["value_and_grad"]


@dataclasses.dataclass(frozen=True)
class _Perturber:
    """The interceptor of the gradient session at ``depth``. Compared by value (a cache key)."""

    depth: int

    def __call__(self, next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        out = next_fun(*args, **kwargs)
        return _capture._session(self.depth, "hx.value_and_grad").perturb(ctx, out)


class _Session:
    """One differentiated call in progress: the zeros to add, and how many calls were seen."""

    def __init__(self, depth: int, perturbs: dict[str, tuple[list[Any], ...]]) -> None:
        self.depth = depth
        self.perturbs = perturbs
        self.counts: dict[str, int] = {}

    def interceptor(self) -> Any:
        return _Perturber(self.depth)

    def attach(self, objs: Any) -> None:
        pass

    def abandon(self) -> None:
        pass

    def perturb(self, ctx: Any, out: Any) -> Any:
        key = ctx.key
        i = self.counts.get(key, 0)
        self.counts[key] = i + 1
        calls = self.perturbs.get(key, ())
        if i >= len(calls):
            raise HookaxError(
                f"hx.value_and_grad: call site {key!r} ({type(ctx.module).__name__}."
                f"{ctx.method}) ran {i + 1} times while differentiating but {len(calls)} times "
                f"when its outputs were measured. The function must call the same modules the "
                f"same number of times for the same inputs (no data-dependent Python control "
                f"flow, no randomness in which modules run)."
            )
        leaves, treedef = jax.tree.flatten(out)
        zeros = calls[i]
        if len(leaves) != len(zeros):
            raise HookaxError(
                f"hx.value_and_grad: call site {key!r} returned {len(leaves)} arrays while "
                f"differentiating but {len(zeros)} when its outputs were measured."
            )
        new = []
        for leaf, z in zip(leaves, zeros):
            if z is not None and jnp.shape(leaf) != z.shape:
                raise HookaxError(
                    f"hx.value_and_grad cannot differentiate with respect to call site {key!r} "
                    f"({type(ctx.module).__name__}.{ctx.method}): it runs inside a transform "
                    f"that maps or scans it (nnx.vmap, nnx.scan, jax.vmap, ...) within the "
                    f"differentiated function. Its output has shape {jnp.shape(leaf)} there, "
                    f"but {z.shape} outside. Gradients of outputs inside such transforms are not "
                    f"supported; exclude them with where= (e.g. where=hx.Select(paths=...)), or "
                    f"apply the transform outside hx.value_and_grad."
                )
            new.append(leaf if z is None else leaf + z)
        return jax.tree.unflatten(treedef, new)

    def check_complete(self) -> None:
        for key, calls in self.perturbs.items():
            seen = self.counts.get(key, 0)
            if seen != len(calls):
                raise HookaxError(
                    f"hx.value_and_grad: call site {key!r} ran {seen} times while "
                    f"differentiating but {len(calls)} times when its outputs were measured; "
                    f"its gradients would be wrong. This happens when it runs inside a jitted "
                    f"function traced earlier (a jit cache hit runs no Python). Define jitted "
                    f"inner functions inside the loss function, or jit the whole step instead."
                )


def _is_nnx(objs: Any) -> bool:
    if "flax.nnx" not in sys.modules:
        return False
    from flax import nnx

    leaves = jax.tree.leaves(objs, is_leaf=lambda x: isinstance(x, nnx.Module))
    return any(isinstance(leaf, nnx.Module) for leaf in leaves)


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


def _discover(fn: Any, selector: Any, nnx_mode: Any, args: tuple, kwargs: dict) -> dict:
    """``{key: (tree of ShapeDtypeStruct, ...)}`` of the selected outputs in call order."""
    order: list[str] = []

    def probe(*a: Any, **k: Any) -> Any:
        acts = _capture.capture_with(fn, selector)(*a, **k)[1]
        order[:] = acts
        return acts

    if nnx_mode == "equinox":
        import equinox as eqx

        shapes = eqx.filter_eval_shape(probe, *args, **kwargs)
    elif nnx_mode:
        from flax import nnx

        shapes = nnx.eval_shape(probe, *args, **kwargs)
    else:
        shapes = jax.eval_shape(probe, *args, **kwargs)
    return {key: shapes[key] for key in order}  # pytree outputs come back with sorted keys


def _zeros(shapes: dict) -> dict[str, tuple[list[Any], ...]]:
    out = {}
    for key, calls in shapes.items():
        out[key] = tuple(
            [
                jnp.zeros(s.shape, s.dtype) if jnp.issubdtype(s.dtype, jnp.inexact) else None
                for s in jax.tree.leaves(call)
            ]
            for call in calls
        )
    return out


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    *,
    where: Any = None,
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
    (``benchmarks/bench_capture.py``).

    Works eagerly and under ``jax.jit``/``nnx.jit``; the active selection is part of the jit cache
    key. Call sites inside a transform that maps or scans them (``nnx.vmap``, ``nnx.scan``) within
    ``fn`` are not supported and raise :class:`hx.HookaxError`; exclude them with ``where=``.

    Args:
      fn: the loss function; returns a scalar, or ``(scalar, aux)`` with ``has_aux=True``.
      argnums: which positional arguments ``grads`` is taken for.
      where: which call sites; default every module's ``__call__``.
      has_aux: whether ``fn`` returns ``(loss, aux)``.

    Returns:
      A function of ``fn``'s arguments returning ``(loss, grads, act_grads)``, or
      ``((loss, aux), grads, act_grads)`` with ``has_aux=True``.

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
    if not callable(fn):
        raise HookaxError(
            f"hx.value_and_grad expects a loss function, got {fn!r} of type "
            f"{type(fn).__name__}. Fix: hx.value_and_grad(lambda model, x: model(x).sum())."
        )
    selector = as_selector(where, CALL_ONLY)
    nums = argnums if isinstance(argnums, tuple) else (argnums,)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, dict[str, tuple[Any, ...]]]:
        for n in nums:
            if not isinstance(n, int) or not -len(args) <= n < len(args):
                raise HookaxError(
                    f"hx.value_and_grad: argnums={argnums!r} names no positional argument of "
                    f"the {len(args)} given. Pass the model and data positionally: "
                    f"hx.value_and_grad(loss_fn)(model, x, y)."
                )
        nnx_mode = _is_nnx((args, kwargs, _capture._roots(fn)))
        nums_pos = tuple(n % len(args) for n in nums)
        eqx_mode = not nnx_mode and _is_equinox([args[n] for n in nums_pos])
        shapes = _discover(fn, selector, "equinox" if eqx_mode else nnx_mode, args, kwargs)
        perturbs = _zeros(shapes)
        extra = len(args)

        def inner(*a: Any) -> Any:
            *fargs, p = a
            make = functools.partial(_Session, perturbs=p)
            with _capture.session(fn, tuple(fargs), kwargs, selector, make) as s:
                out = fn(*fargs, **kwargs)
                s.check_complete()
            return out

        if eqx_mode:
            value, g = _eqx_value_and_grad(inner, nums_pos, has_aux, args, perturbs)
        else:
            if nnx_mode:
                from flax import nnx

                vg = nnx.value_and_grad(inner, argnums=(*nums_pos, extra), has_aux=has_aux)
            else:
                vg = jax.value_and_grad(inner, argnums=(*nums_pos, extra), has_aux=has_aux)
            value, g = vg(*args, perturbs)
        grads = g[0] if not isinstance(argnums, tuple) else tuple(g[:-1])
        act_grads = {
            key: tuple(
                jax.tree.unflatten(jax.tree.structure(call), leaves)
                for call, leaves in zip(shapes[key], calls)
            )
            for key, calls in ((k, g[-1][k]) for k in shapes)
        }
        return value, grads, act_grads

    return wrapped
