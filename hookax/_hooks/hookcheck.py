"""Checking what hooks return, and naming hooks and call sites in errors and notes."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from .._util.errors import HookError, add_note

__all__ = ["check_arity", "check_like", "describe", "hook_name", "noted_call"]


def hook_name(fn: Any) -> str:
    """A readable name for a hook: its qualified name, else its repr."""
    return getattr(fn, "__qualname__", None) or repr(fn)


def describe(x: Any) -> str:
    """A short type description of a value: ``float32[4,3]``, ``None``, ``int``.

    Examples:
      >>> import jax.numpy as jnp
      >>> describe(jnp.zeros((4, 3)))
      'float32[4,3]'
    """
    if x is None:
        return "None"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{dtype}[{','.join(str(d) for d in shape)}]"
    return type(x).__name__


def _tree_str(tree: Any) -> str:
    return str(jax.tree.map(describe, tree))


def check_like(
    expected: Any, got: Any, what: str, where: str, fix: str, *, none_is_zero: bool = False
) -> None:
    """Raise :class:`HookError` unless ``got`` has ``expected``'s tree structure, shapes, dtypes.

    Args:
      expected: the value the hook was given (its tree, shapes and dtypes are the contract).
      got: what the hook returned.
      what: what the value is, e.g. ``"forward hook f's output"``.
      where: the call site, e.g. ``"call site 'layers/0' (Linear.__call__)"``.
      fix: the way out, shown last.
      none_is_zero: a gradient tree: None may stand for any array leaf (a zero gradient).
    """
    head = f"{what} at {where}"
    is_leaf = (lambda x: x is None) if none_is_zero else None
    exp_def: Any = jax.tree.structure(expected, is_leaf=is_leaf)
    got_def: Any = jax.tree.structure(got, is_leaf=is_leaf)
    if exp_def != got_def:
        raise HookError(
            f"{head} has the wrong tree structure: expected {_tree_str(expected)}, "
            f"got {_tree_str(got)}. Fix: {fix}"
        )
    paths = jax.tree_util.tree_flatten_with_path(expected, is_leaf=is_leaf)[0]
    for (path, e), g in zip(paths, jax.tree.leaves(got, is_leaf=is_leaf)):
        if none_is_zero and e is None and g is not None:
            leaf = jax.tree_util.keystr(path) or "the value"
            raise HookError(
                f"{head} has a gradient at {leaf}, which has none (not a float array): "
                f"expected None, got {describe(g)}. Fix: {fix}"
            )
        if g is None or getattr(e, "shape", None) is None or getattr(e, "dtype", None) is None:
            continue
        if getattr(g, "shape", None) != e.shape or getattr(g, "dtype", None) != e.dtype:
            leaf = jax.tree_util.keystr(path) or "the value"
            raise HookError(
                f"{head} has the wrong shape or dtype at {leaf}: expected {describe(e)}, "
                f"got {describe(g)}. Fix: {fix}"
            )


def noted_call(fn: Callable[..., Any], note: str, *args: Any) -> Any:
    """Call ``fn(*args)``; an exception it raises propagates as itself, with ``note`` added."""
    try:
        return fn(*args)
    except BaseException as e:
        add_note(e, note)
        raise


# How each kind of hook is called: (positional parameters, with_kwargs=True form).
SIGNATURES = {
    "forward_pre": ("hook(module, args)", "hook(module, args, kwargs)"),
    "forward": ("hook(module, args, output)", "hook(module, args, kwargs, output)"),
    "backward_pre": ("hook(module, grad_output)", None),
    "backward": ("hook(module, grad_input, grad_output)", None),
    "intercept": ("interceptor(next_fun, args, kwargs, context)", None),
}


def check_arity(fn: Any, kind: str, with_kwargs: bool, api: str, where: str) -> None:
    """Raise :class:`HookError` if ``fn`` cannot be called the way hooks of ``kind`` are.

    Checked with :func:`inspect.signature` when the function has one (builtins may not: those
    are left to fail when called).

    Args:
      fn: the hook or interceptor.
      kind: ``"forward_pre"``, ``"forward"``, ``"backward_pre"``, ``"backward"`` or
        ``"intercept"``.
      with_kwargs: whether the hook is called in its ``with_kwargs=True`` form.
      api: the public function it was given to, e.g. ``"register_forward_hook"``.
      where: the call sites it was registered for, e.g. ``"'layers/0' (Linear.__call__)"``.

    Examples:
      >>> check_arity(lambda m, a, o: None, "forward", False, "register_forward_hook", "'' (M)")
      >>> try:
      ...     check_arity(lambda m, a: None, "forward", False, "register_forward_hook", "'' (M)")
      ... except HookError as e:
      ...     print(str(e).split(", but")[0])
      hx.register_forward_hook: hook <lambda> has the signature (m, a)
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return
    plain, kw = SIGNATURES[kind]
    form = kw if with_kwargs and kw is not None else plain
    n = form.count(",") + 1
    try:
        sig.bind(*range(n))
    except TypeError:
        pass
    else:
        return
    name = "interceptor" if kind == "intercept" else "hook"
    what = {
        "forward_pre": "forward pre-hooks",
        "forward": "forward hooks",
        "backward_pre": "backward pre-hooks",
        "backward": "backward hooks",
        "intercept": "interceptors",
    }[kind]
    other = ""
    if kw is not None:
        flag = "False" if with_kwargs else "True"
        alt = plain if with_kwargs else kw
        other = f" (or pass with_kwargs={flag} for {alt})"
    raise HookError(
        f"hx.{api}: {name} {hook_name(fn)} has the signature {sig}, but {what} at {where} are "
        f"called as {form} ({n} positional arguments). Fix: `def {form}: ...`{other}."
    )
