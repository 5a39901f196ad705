"""Equinox: wrap the methods of every ``eqx.Module`` subclass once; paths from the pytree.

Equinox modules are frozen dataclass pytrees and ``m(x)`` looks ``__call__`` up on the class, so,
as for NNX, each class's own ``__call__`` and public methods are replaced once by a wrapper whose
idle path is one check. Nothing is stored on instances: the pytree structure, ``eqx.filter_jit``'s
cache keys, ``eqx.tree_at``, ``eqx.partition``/``combine`` and serialisation are untouched. (Equinox
turns ``m.method`` into a ``BoundMethod`` pytree holding the class's function, which is then the
wrapper: the same object every time, so jit caches keyed on it still hit.)

Equinox's own helper modules (the wrappers behind ``filter_jit``, ``filter_grad``,
``filter_vmap``, ``BoundMethod``, ``Partial``, ... : every ``eqx.Module`` defined in ``equinox``
outside ``equinox.nn``, and private classes) are never wrapped, so they are never call sites or
roots. Paths are the pytree keys: attribute names and sequence/dict keys (``layers/0``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax

from .._engine import context as _context
from .._engine import dispatch as _dispatch
from ._classwrap import MARK, install_on

__all__ = ["ADAPTER", "install", "wrap_class"]

wrap_class: Callable[[type], None]  # set by install()

_MARK = MARK
_active = _context._ACTIVE_VALUE
_call = _dispatch.call


class EquinoxAdapter:
    name = "equinox"
    immutable = True

    def __reduce__(self) -> str:
        # By reference: the method wrappers hold the adapter, and cloudpickle pickles the
        # wrappers of a class defined in __main__ or in a function by value.
        return "ADAPTER"

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, eqx.Module)

    def iter_modules(self, root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
        yield (), root
        yield from _walk(root, ())

    def aliases(self, module: Any) -> Iterator[Any]:
        yield module

    def root_done(self) -> None:
        pass

    def rebuilt_from(
        self, module: Any, candidates: list[tuple[tuple[Any, ...], Any]], near: tuple[Any, ...]
    ) -> tuple[Any, ...] | None:
        """The path of the one module of the model ``module`` is a copy of, rebuilt by a JAX
        transform: the same class and fields, each array of its shape, or of its shape without
        the leading axis (a layer of a stack passed as ``lax.scan`` xs, as Haliax's ``Stacked``
        does). Several such modules: the one below ``near`` (the path of the nearest caller),
        else none."""
        mine = _arrays(module)
        if mine is None:
            return None
        hits = [
            path
            for path, m in candidates
            if type(m) is type(module) and m is not module and _copy_of(mine, _arrays(m))
        ]
        if len(hits) > 1 and near:
            hits = [p for p in hits if p[: len(near)] == near]
        return hits[0] if len(hits) == 1 else None


def _arrays(module: Any) -> tuple[tuple[str, ...], list[Any]] | None:
    """``module``'s leaves: their key paths, and each array's (shape, dtype) or the leaf."""
    flat = jax.tree_util.tree_flatten_with_path(module)[0]
    keys = tuple(jax.tree_util.keystr(kp) for kp, _ in flat)
    leaves = [
        (tuple(x.shape), x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x
        for _, x in flat
    ]
    if not any(isinstance(x, tuple) for x in leaves):
        return None  # no arrays: nothing to tell copies apart by
    return keys, leaves


def _same_leaf(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a leaf without a plain equality
        return False


def _copy_of(mine: Any, theirs: Any) -> bool:
    if theirs is None or mine[0] != theirs[0]:
        return False
    stacked = same = True
    for a, b in zip(mine[1], theirs[1], strict=True):
        if isinstance(a, tuple) != isinstance(b, tuple):
            return False
        if not isinstance(a, tuple):
            if not _same_leaf(a, b):
                return False
            continue
        (sa, da), (sb, db) = a, b
        if da != db:
            return False
        same = same and sa == sb
        stacked = stacked and sb[1:] == sa and len(sb) == len(sa) + 1
    return same or stacked


def _key(k: Any) -> Any:
    for attr in ("name", "idx", "key"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def _walk(node: Any, prefix: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node and isinstance(x, eqx.Module)
    )[0]
    for kp, leaf in leaves:
        if isinstance(leaf, eqx.Module):
            path = (*prefix, *(_key(k) for k in kp))
            yield path, leaf
            yield from _walk(leaf, path)


ADAPTER = EquinoxAdapter()


def _wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    adapter = ADAPTER

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _active.value:
            return fn(self, *args, **kwargs)
        return _call(fn, name, self, args, kwargs, adapter)

    return wrapper


def is_internal(cls: type) -> bool:
    """Equinox's own helper modules: never call sites, never roots."""
    mod = getattr(cls, "__module__", "") or ""
    if mod == "equinox" or mod.startswith("equinox."):
        return not mod.startswith("equinox.nn") or cls.__name__.startswith("_")
    return False


def install() -> None:
    """Wrap every existing ``eqx.Module`` subclass and every one defined from now on."""
    global wrap_class
    wrap_class = install_on(eqx.Module, _wrap, is_internal)
