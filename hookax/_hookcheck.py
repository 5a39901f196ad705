"""Checking what hooks return, and naming hooks and call sites in errors and notes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ._errors import HookError, add_note

__all__ = ["check_like", "describe", "hook_name", "noted_call"]


def hook_name(fn: Any) -> str:
    """A readable name for a hook: its qualified name, else its repr."""
    return getattr(fn, "__qualname__", None) or repr(fn)


def describe(x: Any) -> str:
    """A short type description of a value: ``float32[4,3]``, ``None``, ``int``.

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


def check_like(expected: Any, got: Any, what: str, where: str, fix: str) -> None:
    """Raise :class:`HookError` unless ``got`` has ``expected``'s tree structure, shapes, dtypes.

    Args:
      expected: the value the hook was given (its tree, shapes and dtypes are the contract).
      got: what the hook returned.
      what: what the value is, e.g. ``"forward hook f's output"``.
      where: the call site, e.g. ``"call site 'layers/0' (Linear.__call__)"``.
      fix: the way out, shown last.
    """
    head = f"{what} at {where}"
    exp_def: Any = jax.tree.structure(expected)
    got_def: Any = jax.tree.structure(got)
    if exp_def != got_def:
        raise HookError(
            f"{head} has the wrong tree structure: expected {_tree_str(expected)}, "
            f"got {_tree_str(got)}. Fix: {fix}"
        )
    paths = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, e), g in zip(paths, jax.tree.leaves(got)):
        if getattr(e, "shape", None) is None or getattr(e, "dtype", None) is None:
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
