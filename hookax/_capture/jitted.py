"""``hx.capture`` around a function that is already jitted, compiled once as a whole.

Run as it is, ``hx.capture(step)(*args)`` over a ``jax.jit`` function goes through JAX's Python
dispatch path on every call (a ``HarvestTrace`` is current, so the C++ fast path is skipped),
then the ``jit`` rule and the session's bookkeeping: a Python decode loop with per-step capture
paid about 3x the plain step. Here the capture is jitted as a whole with the same kind of jit as
``step``, its options carried over, so each call is one dispatch of one compiled program, and
JAX's own cache decides when to retrace (function, argument structure, shapes, dtypes and
shardings, static arguments, the active hookax entries). The jitted captures are kept per
``(step, where=, ops=, while_steps=)``, held only while ``step`` lives, so a capture made anew
on every step hits them too.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._util.errors import HookaxError

__all__ = ["jit_kind", "jitted_capture", "lookup"]


def jit_kind(fn: Any) -> str | None:
    """``"jax"``, ``"nnx"`` or ``"equinox"`` for a function jitted that way, else None (a
    program without modules, ``hx.program(f)``, is jitted as ``f`` is)."""
    if getattr(type(fn), "__hookax_program__", False):
        return jit_kind(fn.fn)
    if hasattr(fn, "_jit_info") and hasattr(fn, "_fun") and hasattr(fn, "lower"):
        return "jax"
    cls = type(fn)
    if cls.__name__ == "JitWrapped" and cls.__module__.startswith("flax.nnx"):
        return "nnx"
    if cls.__name__ == "_JitWrapper" and cls.__module__.startswith("equinox"):
        return "equinox"
    return None


class Packed:
    """A tree whose array leaves are a jitted function's outputs and whose other leaves (a call
    site's static outputs: ``None`` is a tree, but a string or a Python object is not a value a
    jitted function can return) travel in the tree structure."""

    __slots__ = ("tree",)

    def __init__(self, tree: Any) -> None:
        self.tree = tree


def _flatten(p: Packed) -> tuple[list[Any], Any]:
    leaves, treedef = jax.tree.flatten(p.tree)
    arrays = [x for x in leaves if _is_array(x)]
    static = tuple((i, x) for i, x in enumerate(leaves) if not _is_array(x))
    return arrays, (treedef, static)


def _unflatten(aux: Any, arrays: Any) -> Packed:
    treedef, static = aux
    it = iter(arrays)
    fixed = dict(static)
    n = treedef.num_leaves
    return Packed(treedef.unflatten([fixed[i] if i in fixed else next(it) for i in range(n)]))


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.core.Tracer)


jax.tree_util.register_pytree_node(Packed, _flatten, _unflatten)


class Ordered:
    """A dict that keeps its key order through a jitted function's outputs (JAX sorts a
    dict's keys): ``acts`` lists call sites in the order their first call started."""

    __slots__ = ("items",)

    def __init__(self, items: dict[str, Any]) -> None:
        self.items = items


jax.tree_util.register_pytree_node(
    Ordered,
    lambda o: (list(o.items.values()), tuple(o.items)),
    lambda keys, values: Ordered(dict(zip(keys, values))),
)


def _pack(tree: dict[str, Any] | None, kind: str) -> Any:
    if tree is None:
        return None
    ordered = Ordered(tree)
    # eqx.filter_jit returns non-array leaves itself
    if kind == "equinox" or all(_is_array(x) for x in jax.tree.leaves(ordered)):
        return ordered
    return Packed(ordered)


def _unpack(packed: Any) -> dict[str, Any] | None:
    if isinstance(packed, Packed):
        packed = packed.tree
    return None if packed is None else packed.items


def _jit_like(fn: Any, kind: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` jitted the way ``fn`` is, with its static and donated arguments."""
    if getattr(type(fn), "__hookax_program__", False):
        fn = fn.fn
    if kind == "jax":
        info = fn._jit_info
        return jax.jit(
            functools.wraps(fn._fun)(inner),
            static_argnums=info.static_argnums,
            static_argnames=info.static_argnames,
            donate_argnums=info.donate_argnums,
            donate_argnames=info.donate_argnames,
            keep_unused=info.keep_unused,
        )
    if kind == "nnx":
        from flax import nnx

        info = fn.jitted_fn._jit_info
        return nnx.jit(
            functools.wraps(fn.fun)(inner),
            static_argnums=info.static_argnums,
            static_argnames=info.static_argnames,
            donate_argnums=info.donate_argnums,
            donate_argnames=info.donate_argnames,
            keep_unused=info.keep_unused,
        )
    import equinox as eqx

    donate: Any = "none"
    if fn.donate_rest:
        donate = "all" if fn.filter_warning else "warn"
        donate += "" if fn.donate_first else "-except-first"
    return eqx.filter_jit(functools.wraps(fn.__wrapped__)(inner), donate=donate)


# id(fn) -> (weak reference to fn, {(where, ops, while_steps): jitted capture})
_CACHE: dict[int, tuple[Any, dict[Any, Callable[..., Any]]]] = {}


def _drop(i: int, ref: Any) -> None:
    if not isinstance(_CACHE, dict):  # the interpreter is shutting down: module globals are gone
        return
    entry = _CACHE.get(i)
    if entry is not None and entry[0] is ref:
        del _CACHE[i]


def lookup(fn: Any, raw: Any) -> Callable[..., tuple[Any, Any, Any]] | None:
    """The jitted capture kept for ``fn`` under ``raw`` (the arguments ``hx.capture`` was given,
    so a capture made anew on every step skips parsing them), or None."""
    entry = _CACHE.get(id(fn))
    if entry is None or entry[0]() is not fn:
        return None
    try:
        return entry[1].get(raw)
    except TypeError:  # an unhashable argument
        return None


def jitted_capture(
    fn: Any,
    kind: str,
    key: Any,
    run: Callable[[Any, tuple, dict], tuple[Any, Any, Any]],
    raw: Any = None,
) -> Callable[..., tuple[Any, Any, Any]]:
    """``run(fn, args, kwargs) -> (y, acts, steps)`` jitted like ``fn``, returning ``(y, acts,
    steps)``; the same object for the same ``fn`` and hashable ``key`` while ``fn`` lives (also
    found by :func:`lookup` under ``raw``). It holds ``fn`` weakly: the caller must hold it."""
    i = id(fn)
    try:
        hash(key)
        ref = weakref.ref(fn, functools.partial(_drop, i))
    except TypeError:
        return _make(fn, kind, lambda: fn, run)
    entry = _CACHE.get(i)
    if entry is None or entry[0]() is not fn:
        entry = (ref, {})
        _CACHE[i] = entry
    per = entry[1]
    if key not in per:
        per[key] = _make(fn, kind, entry[0], run)
    if raw is not None:
        with contextlib.suppress(TypeError):  # an unhashable argument: found by key only
            per[raw] = per[key]
    return per[key]


def _make(
    fn: Any, kind: str, get: Callable[[], Any], run: Callable[[Any, tuple, dict], Any]
) -> Callable[..., tuple[Any, Any, Any]]:
    def inner(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        f = get()
        if f is None:  # pragma: no cover - the capture holding this holds fn
            raise HookaxError("hx.capture: the jitted function was garbage-collected.")
        y, acts, steps = run(f, args, kwargs)
        return y, _pack(acts, kind), _pack(steps, kind)

    jitted = _jit_like(fn, kind, inner)

    def call(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        y, acts, steps = jitted(*args, **kwargs)
        return y, _unpack(acts), _unpack(steps)

    return call
