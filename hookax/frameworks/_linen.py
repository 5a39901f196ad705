"""Flax Linen: ride on Linen's own chokepoint, made cache-correct.

Every Linen module method runs through ``Module._call_wrapped_method``, which runs the interceptors
of ``nn.intercept_methods`` when its thread-local interceptor stack is non-empty. Installing
replaces that stack with one that also holds hookax's dispatcher whenever a hookax scope is active
(``hx.intercept``, ``hx.hooks``, ``hx.capture``, ...): the dispatcher is innermost, so Linen's own
interceptors wrap it. The idle cost is one ``len()`` of the stack, as in Linen itself.

Call sites: ``__call__`` and the public methods of every module class, Linen's own layers
(``nn.Dense``, ``nn.Conv``) included; ``setup`` and the internal ``<lambda>`` wrappers of lifted
transforms (``nn.remat``, ``nn.scan``, ``nn.vmap``) are not call sites. Paths are the names Linen's
scopes give submodules (``Dense_0``, ``layers_1``, or the ``name=`` given), relative to the root
(the outermost module in progress, usually the one ``apply`` was called on). Under ``nn.scan``
Linen traces the body twice, so call sites inside it run twice while tracing.

``nn.intercept_methods`` itself is made cache-correct too: entering it also puts the interceptor
into hookax's jit-cache-keyed context, so a function traced with it is never reused without it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from flax.linen import module as linen_module

from .. import _context, _dispatch

__all__ = ["ADAPTER", "install"]

_active = _context._ACTIVE_VALUE
_call = _dispatch.call
_BASE_NAMES = frozenset(n for n in dir(linen_module.Module) if n != "__call__")


class LinenAdapter:
    name = "linen"
    immutable = True

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, linen_module.Module)

    def iter_modules(self, root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
        """Only the root: Linen creates submodules lazily, while its methods run."""
        yield (), root

    def relative_path(self, root: Any, module: Any) -> tuple[Any, ...] | None:
        """``module``'s scope path relative to ``root``'s, or None when not below it."""
        try:
            rp, mp = root.path, module.path
        except (ValueError, AttributeError):  # an unbound module has no scope
            return None
        n = len(rp)
        return tuple(mp[n:]) if tuple(mp[:n]) == tuple(rp) else None

    def aliases(self, module: Any) -> Iterator[Any]:
        yield module

    def root_done(self) -> None:
        pass


ADAPTER = LinenAdapter()


def _is_call_site(module: Any, name: str) -> bool:
    if name == "__call__":
        return True
    return name.isidentifier() and not name.startswith("_") and name not in _BASE_NAMES


def _hookax_interceptor(next_fun: Callable[..., Any], args: tuple, kwargs: dict, lctx: Any) -> Any:
    """The Linen interceptor through which hookax sees a Linen call site."""
    name = lctx.method_name
    if not _active.value or not _is_call_site(lctx.module, name):
        return next_fun(*args, **kwargs)
    return _call(_Bound(next_fun), name, lctx.module, args, kwargs, ADAPTER)


class _Bound:
    """``fn(module, *args, **kwargs)`` form of Linen's bound ``next_fun`` for ``_dispatch``."""

    __slots__ = ("next_fun",)

    def __init__(self, next_fun: Callable[..., Any]) -> None:
        self.next_fun = next_fun

    def __call__(self, _module: Any, *args: Any, **kwargs: Any) -> Any:
        return self.next_fun(*args, **kwargs)


class _Stack(linen_module.ThreadLocalStack):
    """Linen's interceptor stack, plus hookax's dispatcher (innermost) while hookax is active."""

    def __len__(self) -> int:
        return len(self._storage) + (1 if _active.value else 0)

    def __iter__(self) -> Iterator[Any]:
        # Linen wraps in iteration order: the first one yielded is the innermost.
        if any(e.kind != "linen" for e in _active.value):
            yield _hookax_interceptor
        yield from reversed(self._storage)


def install() -> None:
    """Replace Linen's interceptor stack; make ``nn.intercept_methods`` cache-correct."""
    old = linen_module._global_interceptor_stack
    stack = _Stack()
    stack._storage = old._storage  # this thread's interceptors; others start empty as before
    linen_module._global_interceptor_stack = stack

    orig = linen_module.intercept_methods
    if getattr(orig, "__hookax_wrapped__", False):
        return

    @functools.wraps(orig)
    @contextlib.contextmanager
    def intercept_methods(interceptor: Any) -> Iterator[None]:
        from .._fnkey import FnKey
        from .._intercept import Entry, scoped
        from .._select import Select

        # Entry kind "linen" is never run by hookax: it only keys the jit caches.
        with scoped(Entry("linen", FnKey(interceptor), Select())), orig(interceptor):
            yield

    intercept_methods.__hookax_wrapped__ = True  # type: ignore[attr-defined]
    linen_module.intercept_methods = intercept_methods
    import flax.linen

    if flax.linen.intercept_methods is orig:
        flax.linen.intercept_methods = intercept_methods
