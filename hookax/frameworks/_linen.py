"""Flax Linen: ride on Linen's own chokepoint, and leave Linen's own interceptors as they are.

Every Linen module method runs through ``Module._call_wrapped_method``, which runs the interceptors
of ``nn.intercept_methods`` when its thread-local interceptor stack is non-empty. Installing
gives that stack object (in place) a class that also yields hookax's dispatcher whenever a hookax
scope is active (``hx.intercept``, ``hx.hooks``, ``hx.capture``, ...): the dispatcher is
innermost, so Linen's own interceptors wrap it. The idle cost is one ``len()`` of the stack, as in
Linen itself.

Call sites: ``__call__`` and the public methods of every module class, Linen's own layers
(``nn.Dense``, ``nn.Conv``) included; ``setup`` and the internal ``<lambda>`` wrappers of lifted
transforms (``nn.remat``, ``nn.scan``, ``nn.vmap``) are not call sites. Paths are the names Linen's
scopes give submodules (``Dense_0``, ``layers_1``, or the ``name=`` given), relative to the root
(the outermost module in progress, usually the one ``apply`` was called on). Under ``nn.scan``
Linen traces the body twice, so call sites inside it run twice while tracing.

``nn.intercept_methods`` keeps Linen's behaviour (its interceptors are not part of the jit cache
key) unless :func:`hookax.key_linen_interceptors` opts in; then entering it also puts the
interceptor into hookax's jit-cache-keyed context. Keyed by default, the common pattern of an
interceptor closing over a fresh dict each step would retrace every jitted step, recompile every
eager operation and keep each step's dict alive in JAX's caches. Unkeyed, hookax warns once
(:class:`hookax.StaleTraceWarning`) when a block ends without its interceptor having been called,
the visible sign of a jitted function reusing a trace made without it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from flax.linen import module as linen_module

from .._engine import adapters as _frameworks
from .._engine import context as _context
from .._engine import dispatch as _dispatch

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
    if isinstance(lctx.module, _bridges()):  # the NNX module it runs is the call site
        return _dispatch.bare(_Bound(next_fun), name, lctx.module, args, kwargs, ADAPTER)
    return _call(_Bound(next_fun), name, lctx.module, args, kwargs, ADAPTER)


def _bridges() -> tuple[type, ...]:
    """Flax's Linen wrappers of NNX modules (``nnx.bridge.ToLinen``), once NNX is imported."""
    if "flax.nnx" not in sys.modules:
        return ()
    from flax.nnx.bridge import wrappers

    return (wrappers.ToLinen,)


class _Bound:
    """``fn(module, *args, **kwargs)`` form of Linen's bound ``next_fun`` for ``_dispatch``."""

    __slots__ = ("next_fun",)

    def __init__(self, next_fun: Callable[..., Any]) -> None:
        self.next_fun = next_fun

    def __call__(self, _module: Any, *args: Any, **kwargs: Any) -> Any:
        return self.next_fun(*args, **kwargs)


class _Local(threading.local):
    def __init__(self) -> None:
        # Linen method calls on this thread that ran the interceptor stack (non-empty stack).
        self.calls = 0
        # One per interceptor pushed since install, innermost last: the call count at push, and
        # the jit-cache-keyed scope entered for it (opt-in) or None.
        self.marks: list[tuple[int, Any]] = []


_LOCAL = _Local()


class _Stack(linen_module.ThreadLocalStack):
    """Linen's interceptor stack, plus hookax's dispatcher (innermost) while hookax is active.

    Installed by changing the class of Linen's one stack object, never by replacing the object:
    Linen keeps each thread's interceptors in it (a ``threading.local``), and a thread inside
    ``nn.intercept_methods`` while hookax installs keeps its interceptors.
    """

    def __len__(self) -> int:
        return len(self._storage) + (1 if _active.value else 0)

    def __iter__(self) -> Iterator[Any]:
        _LOCAL.calls += 1
        # Linen wraps in iteration order: the first one yielded is the innermost.
        if any(e.kind != "linen" for e in _active.value):
            yield _hookax_interceptor
        yield from reversed(self._storage)

    def push(self, elem: Any) -> None:
        scope = None
        if _frameworks.LINEN_KEYED[0]:
            from .._engine.select import Select
            from .._hooks.intercept import Entry, scoped
            from .._util.fnkey import FnKey

            # Kind "linen" is never run by hookax: it only keys the jit caches.
            scope = scoped(Entry("linen", FnKey(elem), Select()))
            scope.__enter__()
        self._storage.append(elem)
        _LOCAL.marks.append((_LOCAL.calls, scope))

    def pop(self) -> Any:
        elem = self._storage.pop()
        marks = _LOCAL.marks
        if len(marks) > len(self._storage):  # pushed since install (else: before it)
            calls, scope = marks.pop()
            if scope is not None:
                scope.__exit__(None, None, None)
            elif calls == _LOCAL.calls and sys.exc_info()[0] is None:
                _never_called(elem)
        return elem


_WARNED: set[Any] = set()  # interceptors' code objects already warned about (warn once each)


def _never_called(interceptor: Any) -> None:
    """Warn (once per interceptor function) that a block ran without calling its interceptor."""
    code = getattr(interceptor, "__code__", None) or type(interceptor)
    if code in _WARNED:
        return
    _WARNED.add(code)
    name = getattr(interceptor, "__qualname__", None) or repr(interceptor)
    warnings.warn(
        f"nn.intercept_methods({name}) ended without calling its interceptor: no Linen module "
        "method ran in the block on this thread. If the block called a jitted function traced "
        "before, JAX reused that trace, and Linen's interceptors are not part of the jit cache "
        "key: the interceptor did not run (its side effects did not happen) and the output is "
        "that of the earlier trace, with the interceptor it had then or none. Fix: enter the "
        "block inside the jitted function, or use hx.intercept (cache-keyed), or call "
        "hx.key_linen_interceptors() once to make nn.intercept_methods cache-keyed (an "
        "interceptor that closes over a new object each step then retraces each step).",
        _frameworks.StaleTraceWarning,
        stacklevel=_user_stacklevel(),
    )


def _user_stacklevel() -> int:
    """The stack level of the first caller outside hookax, Linen's module.py and contextlib."""
    skip = (__file__, linen_module.__file__, contextlib.__file__)
    f: types.FrameType | None = sys._getframe(1)  # the caller: warnings.warn's level 1
    level = 1
    while f is not None and f.f_code.co_filename in skip:
        f, level = f.f_back, level + 1
    return level


def install() -> None:
    """Give Linen's interceptor stack the hookax behaviour (in place, for every thread)."""
    stack = linen_module._global_interceptor_stack
    if not isinstance(stack, _Stack):
        stack.__class__ = _Stack
