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
from jax.custom_derivatives import SymbolicZero

from .._util.errors import HookError
from .hookcheck import check_like, describe, hook_name, noted_call

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

    Order of chained hooks: each ``hook_grad`` wraps what it is given, and JAX runs the
    backward pass from the loss inwards, so in ``hx.hook_grad(hx.hook_grad(x, f), g)`` the outer
    ``g`` (applied last) runs **first**, then ``f``. PyTorch runs the hooks registered on one
    tensor in registration order (``t.register_hook(f); t.register_hook(g)``: ``f`` first). To get
    PyTorch's order, nest in reverse (``hook_grad(hook_grad(x, g), f)``) or compose in one hook
    (``hook_grad(x, lambda c: g(f(c)))``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import hookax as hx
      >>> jax.grad(lambda x: hx.hook_grad(x * x, lambda g: g * 10))(3.0)
      Array(60., dtype=float32, weak_type=True)
      >>> order = []
      >>> f = lambda g: order.append("f")
      >>> g = lambda g: order.append("g")
      >>> _ = jax.grad(lambda x: hx.hook_grad(hx.hook_grad(x, f), g))(1.0)
      >>> order  # the outer hook first
      ['g', 'f']
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


def _symbolic_identity(
    on_fwd: Callable[[tuple[bool, ...]], None], on_bwd: Callable[[tuple[Any, ...]], Sequence[Any]]
) -> Callable[..., Any]:
    """An identity on a tuple of arrays with symbolic zeros (``symbolic_zeros=True``).

    ``on_fwd(perturbed)`` is told, when JAX differentiates the call, which inputs are
    differentiated (one flag per array); ``on_bwd`` gets the cotangents with None where JAX has
    a symbolic zero (an output that does not reach the loss) and returns the input cotangents
    (None for zero).
    """

    @jax.custom_vjp
    def ident(xs: tuple[Any, ...]) -> tuple[Any, ...]:
        return xs

    def fwd(xs: tuple[Any, ...]) -> tuple[tuple[Any, ...], None]:
        on_fwd(tuple(bool(x.perturbed) for x in xs))
        return tuple(x.value for x in xs), None

    def bwd(_: None, cts: tuple[Any, ...]) -> tuple[tuple[Any, ...]]:
        given = tuple(None if isinstance(c, SymbolicZero) else c for c in cts)
        return (tuple(on_bwd(given)),)

    ident.defvjp(fwd, bwd, symbolic_zeros=True)
    return ident


def _template(tree: _Tree) -> Any:
    """What a gradient of ``tree`` looks like: shapes and dtypes at its differentiable leaves."""
    return tree.rebuild([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in tree.diff])


def _entries(trees: list[_Tree], cts: Sequence[Any]) -> tuple[Any, ...]:
    """PyTorch's tuple of gradients: one entry per tree, None where it has no gradient at all."""
    it = iter(cts)
    out = []
    for t in trees:
        leaves = [next(it) for _ in t.diff]
        out.append(None if all(g is None for g in leaves) else t.rebuild(leaves))
    return tuple(out)


def _flat(trees: list[_Tree], entries: Sequence[Any]) -> list[Any]:
    """The differentiable leaves of gradient ``entries`` (None, or None at a leaf: zero)."""
    out: list[Any] = []
    for t, e in zip(trees, entries):
        if e is None:
            out += [None] * len(t.diff)
            continue
        leaves = jax.tree.flatten(e, is_leaf=lambda x: x is None)[0]
        out += [g for g, m in zip(leaves, t.mask) if m]
    return out


def _ignore(_: tuple[bool, ...]) -> None:
    return None


class _Site:
    """The backward hooks of one call of one call site, and what passes between its identities.

    As in PyTorch, hooks get tuples: ``grad_output`` has one entry per output (the entries of a
    tuple output, else the output itself) and ``grad_input`` one per positional argument; an
    entry is None where there is no gradient (not a float array, not differentiated, or not
    reaching the loss).
    """

    def __init__(self, module: Any, pre: list[Any], post: list[Any], where: str) -> None:
        self.module, self.pre, self.post, self.where = module, pre, post, where
        self.inputs: list[_Tree] = []
        self.outputs: list[_Tree] = []
        self.perturbed = False  # set when JAX differentiates some input of this call
        self.differentiated: tuple[bool, ...] = ()  # which input arrays JAX differentiates
        self.grad_output: tuple[Any, ...] | None = None  # from the output's to the inputs' bwd

    def note(self, kind: str, fn: Any) -> str:
        return f"hookax: raised in {kind} {hook_name(fn)} at {self.where}"

    def _perturbed(self, perturbed: tuple[bool, ...]) -> None:
        self.perturbed = self.perturbed or any(perturbed)
        self.differentiated = perturbed

    def wrap_inputs(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self.inputs = trees = [_Tree(a) for a in args]
        if not self.post or not any(any(t.mask) for t in trees):
            return args
        flat = tuple(x for t in trees for x in t.diff)
        new = iter(_symbolic_identity(self._perturbed, self._inputs_bwd)(flat))
        return tuple(t.rebuild([next(new) for _ in t.diff], _KEEP) for t in trees)

    def wrap_output(self, out: Any) -> Any:
        is_tuple = isinstance(out, tuple)
        self.outputs = trees = [_Tree(o) for o in (out if is_tuple else (out,))]
        if not any(any(t.mask) for t in trees):
            return out
        flat = tuple(x for t in trees for x in t.diff)
        new = iter(_symbolic_identity(_ignore, self._output_bwd)(flat))
        wrapped = [t.rebuild([next(new) for _ in t.diff], _KEEP) for t in trees]
        if not is_tuple:
            return wrapped[0]
        return type(out)(*wrapped) if hasattr(out, "_fields") else tuple(wrapped)

    def _output_bwd(self, cts: tuple[Any, ...]) -> list[Any]:
        grad_output = _entries(self.outputs, cts)
        for fn in self.pre:
            res = noted_call(fn, self.note("backward pre-hook", fn), self.module, grad_output)
            if res is not None:
                what = f"backward pre-hook {hook_name(fn)}'s grad_output"
                grad_output = self._checked(res, self.outputs, what, "grad_output")
        if self.post:
            if self.perturbed:
                self.grad_output = grad_output  # the inputs' identity runs the hooks
            else:
                self._run_post(None, grad_output)
        return _flat(self.outputs, grad_output)

    def _inputs_bwd(self, cts: tuple[Any, ...]) -> list[Any]:
        grad_output, self.grad_output = self.grad_output, None
        if grad_output is None:  # the output's gradient never reached this call: as PyTorch
            return list(cts)
        # As in PyTorch: an input that is differentiated but does not reach the output has a
        # zero gradient (None stays for inputs that are not differentiated).
        leaves = [x for t in self.inputs for x in t.diff]
        cts = tuple(
            jnp.zeros(x.shape, x.dtype) if c is None and d else c
            for c, d, x in zip(cts, self.differentiated, leaves)
        )
        grad_input = self._run_post(_entries(self.inputs, cts), grad_output)
        return _flat(self.inputs, grad_input)

    def _checked(self, res: Any, trees: list[_Tree], what: str, name: str) -> tuple[Any, ...]:
        """``res`` if it is a tuple of gradients for ``trees``; else :class:`HookError`."""
        fix = f"return None, or a tuple like {name} (an entry None for a zero gradient)"
        n = len(trees)
        if not isinstance(res, tuple) or len(res) != n:
            got = f"a tuple of length {len(res)}" if isinstance(res, tuple) else describe(res)
            if isinstance(res, tuple) and len(res) > n and len(res) % n == 0:
                got += f" (`{name} * k` repeats a tuple: scale its entries instead)"
            one = f", e.g. `return ({name}[0] * 2,)`" if n == 1 else ""
            raise HookError(
                f"{what} at {self.where} must be a tuple with one entry per "
                f"{'output' if name == 'grad_output' else 'positional argument'} ({n}), got "
                f"{got}. Fix: {fix}{one}."
            )
        for i, (t, r) in enumerate(zip(trees, res)):
            if r is not None:
                check_like(
                    _template(t), r, f"{what} (entry {i})", self.where, fix + ".", none_is_zero=True
                )
        return res

    def _run_post(self, grad_input: tuple[Any, ...] | None, grad_output: Any) -> tuple[Any, ...]:
        """Run the backward hooks; ``grad_input`` None: no input of this call is differentiated."""
        given = grad_input if grad_input is not None else (None,) * len(self.inputs)
        for fn in self.post:
            res = noted_call(fn, self.note("backward hook", fn), self.module, given, grad_output)
            if res is None:
                continue
            what = f"backward hook {hook_name(fn)}'s grad_input"
            if grad_input is None:
                if isinstance(res, tuple) and all(r is None for r in res):
                    continue
                raise HookError(
                    f"{what} at {self.where}: no input of this call is differentiated, so a "
                    f"backward hook here must return None (or a tuple of None), got "
                    f"{describe(res) if not isinstance(res, tuple) else 'a tuple of gradients'}"
                    " (as in PyTorch, where no input requires gradient). Fix: return None, or "
                    "differentiate with respect to the input (e.g. `jax.grad(f, argnums=...)`)."
                )
            given = self._checked(res, self.inputs, what, "grad_input")
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
