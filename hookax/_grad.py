"""Gradient hooks: ``hx.hook_grad`` and the backward hooks of a call site.

Both are ``jax.custom_vjp`` identities: the forward pass is the identity (XLA removes it), and the
backward pass hands the cotangent to Python hooks while JAX differentiates, which makes the hooks
run under ``jax.grad``, ``jax.vjp``, ``jit``, ``vmap`` and ``scan`` alike.

A call site with backward hooks gets two identities, as in PyTorch's ``BackwardHook``: one on its
positional inputs and one on its output. Transposition reaches the output's identity first: it runs
the backward pre-hooks on ``grad_output`` and leaves it in a per-call cell; the inputs' identity
then has ``grad_input`` and runs the backward hooks with both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import HookError
from ._hookcheck import check_like, describe, hook_name, noted_call

__all__ = ["hook_grad", "wrap_site"]


def _is_diff(x: Any) -> bool:
    """Whether JAX differentiates ``x``: an array (or tracer) of a float or complex dtype."""
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.inexact)


class _Tree:
    """A pytree split into its differentiable leaves and the rest; rebuilds gradient trees."""

    def __init__(self, tree: Any) -> None:
        self.leaves, self.treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None)
        self.mask = [_is_diff(x) for x in self.leaves]

    @property
    def diff(self) -> list[Any]:
        return [x for x, m in zip(self.leaves, self.mask) if m]

    def rebuild(self, diff: Sequence[Any], fill: Any = None) -> Any:
        """The tree with ``diff`` at the differentiable leaves, ``fill`` elsewhere."""
        it = iter(diff)
        leaves = [
            next(it) if m else (x if fill is _KEEP else fill)
            for x, m in zip(self.leaves, self.mask)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def grads_of(self, tree: Any) -> list[Any]:
        """The differentiable leaves of a gradient tree (None, or None there, means zeros)."""
        if tree is None:
            tree = jax.tree_util.tree_unflatten(self.treedef, [None] * len(self.leaves))
        leaves = jax.tree.flatten(tree, is_leaf=lambda x: x is None)[0]
        return [
            jnp.zeros(x.shape, x.dtype) if g is None else g
            for x, g, m in zip(self.leaves, leaves, self.mask)
            if m
        ]


_KEEP = object()


def _identity(on_bwd: Callable[[tuple[Any, ...]], Sequence[Any]]) -> Callable[..., Any]:
    """An identity on a tuple of arrays whose backward maps cotangents through ``on_bwd``."""

    @jax.custom_vjp
    def ident(xs: tuple[Any, ...]) -> tuple[Any, ...]:
        return xs

    def fwd(xs: tuple[Any, ...]) -> tuple[tuple[Any, ...], None]:
        return xs, None

    def bwd(_: None, cts: tuple[Any, ...]) -> tuple[tuple[Any, ...]]:
        return (tuple(on_bwd(cts)),)

    ident.defvjp(fwd, bwd)
    return ident


def hook_grad(x: Any, fn: Callable[[Any], Any]) -> Any:
    """Identity on ``x``; when JAX differentiates, the cotangent of ``x`` becomes ``fn(cotangent)``.

    PyTorch's ``Tensor.register_hook`` for JAX. ``x`` is any pytree; ``fn`` gets the cotangent
    tree (None at leaves that are not float arrays) and returns None (unchanged) or a new one of
    the same tree structure, shapes and dtypes. ``fn`` runs while JAX differentiates, so it must be
    JAX-traceable.

    >>> import jax, jax.numpy as jnp
    >>> import hookax as hx
    >>> jax.grad(lambda x: hx.hook_grad(x * x, lambda g: g * 10))(3.0)
    Array(60., dtype=float32, weak_type=True)
    """
    tree = _Tree(x)
    if not any(tree.mask):
        return x
    where = "hx.hook_grad"
    fix = "return None to keep the cotangent, or a tree like it (e.g. `return g * 2`)."

    def on_bwd(cts: tuple[Any, ...]) -> list[Any]:
        ct = tree.rebuild(cts)
        res = noted_call(fn, f"hookax: raised in gradient hook {hook_name(fn)} ({where})", ct)
        if res is None:
            return list(cts)
        check_like(ct, res, f"gradient hook {hook_name(fn)}'s cotangent", where, fix)
        return tree.grads_of(res)

    return tree.rebuild(_identity(on_bwd)(tuple(tree.diff)), _KEEP)


class _Site:
    """The backward hooks of one call of one call site, and what passes between its identities."""

    def __init__(self, module: Any, pre: list[Any], post: list[Any], where: str) -> None:
        self.module, self.pre, self.post, self.where = module, pre, post, where
        self.inputs: list[_Tree] | None = None
        self.output: _Tree | None = None
        self.grad_output: Any = None
        self.nargs = 0

    def note(self, kind: str, fn: Any) -> str:
        return f"hookax: raised in {kind} {hook_name(fn)} at {self.where}"

    def wrap_inputs(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self.nargs = len(args)
        trees = [_Tree(a) for a in args]
        if not self.post or not any(any(t.mask) for t in trees):
            return args
        self.inputs = trees
        flat = tuple(x for t in trees for x in t.diff)
        new = iter(_identity(self._inputs_bwd)(flat))
        return tuple(t.rebuild([next(new) for _ in t.diff], _KEEP) for t in trees)

    def wrap_output(self, out: Any) -> Any:
        tree = _Tree(out)
        if not any(tree.mask):
            return out
        self.output = tree
        return tree.rebuild(_identity(self._output_bwd)(tuple(tree.diff)), _KEEP)

    def _grad_input(self, cts: Sequence[Any]) -> tuple[Any, ...]:
        assert self.inputs is not None
        it = iter(cts)
        return tuple(
            t.rebuild([next(it) for _ in t.diff]) if any(t.mask) else None for t in self.inputs
        )

    def _output_bwd(self, cts: tuple[Any, ...]) -> list[Any]:
        assert self.output is not None
        grad_output = self.output.rebuild(cts)
        fix = "return None to keep grad_output, or a tree like it (e.g. `return g * 2`)."
        for fn in self.pre:
            res = noted_call(fn, self.note("backward pre-hook", fn), self.module, grad_output)
            if res is not None:
                check_like(
                    grad_output,
                    res,
                    f"backward pre-hook {hook_name(fn)}'s grad_output",
                    self.where,
                    fix,
                )
                grad_output = res
        if self.inputs is not None:
            self.grad_output = grad_output
        elif self.post:
            self._run_post(None, grad_output)
        return self.output.grads_of(grad_output)

    def _inputs_bwd(self, cts: tuple[Any, ...]) -> list[Any]:
        assert self.inputs is not None
        grad_output, self.grad_output = self.grad_output, None
        if grad_output is None and self.output is not None:
            # The output's gradient never reached this call site: it is zero.
            grad_output = self.output.rebuild(
                [jnp.zeros(x.shape, x.dtype) for x in self.output.diff]
            )
        grad_input = self._run_post(self._grad_input(cts), grad_output)
        return [g for t, gi in zip(self.inputs, grad_input) if any(t.mask) for g in t.grads_of(gi)]

    def _run_post(self, grad_input: tuple[Any, ...] | None, grad_output: Any) -> tuple[Any, ...]:
        """Run the backward hooks; ``grad_input`` None: no input of this call is differentiable."""
        given = grad_input if grad_input is not None else (None,) * self.nargs
        fix = "return None, or a tuple like grad_input (an entry None for a zero gradient)."
        for fn in self.post:
            res = noted_call(fn, self.note("backward hook", fn), self.module, given, grad_output)
            if res is None:
                continue
            what = f"backward hook {hook_name(fn)}'s grad_input"
            if not isinstance(res, tuple) or len(res) != len(given):
                got = f"a tuple of length {len(res)}" if isinstance(res, tuple) else describe(res)
                raise HookError(
                    f"{what} at {self.where} must be a tuple with one entry per positional "
                    f"argument ({len(given)}), got {got}. Fix: {fix}"
                )
            for i, (g, r) in enumerate(zip(given, res)):
                if r is not None:
                    check_like(g, r, f"{what} (entry {i})", self.where, fix)
            if grad_input is not None:
                given = res
        return given


def wrap_site(
    module: Any, args: tuple[Any, ...], pre: list[Any], post: list[Any], where: str
) -> tuple[tuple[Any, ...], Callable[[Any], Any]]:
    """Put the backward identities on a call: returns the new args and the output wrapper.

    Args:
      module: the module the hooks receive.
      args: the call's positional arguments (after forward pre-hooks).
      pre: backward pre-hooks ``(module, grad_output)``, in run order.
      post: backward hooks ``(module, grad_input, grad_output)``, in run order.
      where: the call site, for messages.
    """
    site = _Site(module, pre, post, where)
    return site.wrap_inputs(args), site.wrap_output
