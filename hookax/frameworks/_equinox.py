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
import types
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax

from .. import _context, _dispatch

__all__ = ["ADAPTER", "install", "wrap_class"]

_MARK = "__hookax_wrapped__"
_active = _context._ACTIVE_VALUE
_call = _dispatch.call
_BASE_NAMES = frozenset(n for n in dir(eqx.Module) if n != "__call__")


class EquinoxAdapter:
    name = "equinox"
    immutable = True
    capture_help = (
        "Its output was computed inside a JAX transform that runs within the captured function "
        "(jax.vmap, eqx.filter_vmap, jax.lax.scan, jax.checkpoint, eqx.filter_jit, ...), whose "
        "trace hookax cannot carry values out of, so it refuses rather than drop them. Apply "
        "hx.capture inside the transform instead: eqx.filter_vmap(hx.capture(model))(x), or "
        "return the value from the transformed function."
    )

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, eqx.Module)

    def iter_modules(self, root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
        yield (), root
        yield from _walk(root, ())

    def aliases(self, module: Any) -> Iterator[Any]:
        yield module

    def root_done(self) -> None:
        pass


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

    setattr(wrapper, _MARK, fn)
    return wrapper


def is_internal(cls: type) -> bool:
    """Equinox's own helper modules: never call sites, never roots."""
    mod = getattr(cls, "__module__", "") or ""
    if mod == "equinox" or mod.startswith("equinox."):
        return not mod.startswith("equinox.nn") or cls.__name__.startswith("_")
    return False


def _is_call_site(cls: type, name: str, value: Any) -> bool:
    if name in _BASE_NAMES or not (name == "__call__" or not name.startswith("_")):
        return False
    if not isinstance(value, types.FunctionType) or hasattr(value, _MARK):
        return False
    if getattr(value, "__isabstractmethod__", False):
        return False
    return value.__qualname__.startswith(cls.__qualname__ + ".")


def wrap_class(cls: type) -> None:
    """Make the methods ``cls`` itself defines interceptable (idempotent)."""
    if cls.__dict__.get("__hookax_class__") or is_internal(cls):
        return
    for name, value in list(vars(cls).items()):
        if _is_call_site(cls, name, value):
            type.__setattr__(cls, name, _wrap(value, name))
    type.__setattr__(cls, "__hookax_class__", True)


def _subclasses(cls: type) -> Iterator[type]:
    sub: type
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def install() -> None:
    """Wrap every existing ``eqx.Module`` subclass and every one defined from now on."""
    prev = eqx.Module.__dict__.get("__init_subclass__")

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        if prev is not None:
            prev.__get__(None, cls)(**kwargs)
        else:
            super(eqx.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
        wrap_class(cls)

    eqx.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
    for cls in list(_subclasses(eqx.Module)):
        wrap_class(cls)
