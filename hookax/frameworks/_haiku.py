"""Haiku: ride on Haiku's own method wrapping; paths from Haiku's module names.

Haiku's metaclass wraps every method of every ``hk.Module`` subclass (name scopes, then
``run_interceptors``, where ``hk.intercept_methods`` interceptors run). Installing replaces that
one function, which Haiku's wrappers look up by name on every call, by one that passes straight
through unless a hookax scope is active; then the call's method runs as a hookax call site inside
Haiku's own interceptors (innermost), inside the module's name scope. The idle cost is one check.

Call sites are the calls ``hk.intercept_methods`` reports: ``__call__`` and the public methods of
every module class, Haiku's own layers (``hk.Linear``, ``hk.nets.MLP``) included; constructors,
properties, methods marked ``@hk.transparent`` (Haiku does not wrap them), ``hk.Module``'s own
methods (``params_dict``) and Haiku's internal modules (the ``LiftingModule`` behind ``hk.lift``
and ``hk.layer_stack``, name scopes) are not call sites.

Paths are Haiku's module names, split at ``/``, without the ``~`` segments that mark a module
created in its parent's constructor; a module created in another method keeps that method's
segment (``~encode``), so two modules never share a path. Every module is keyed by its whole name,
the outermost one too (there is no root module object: the model is the function given to
``hk.transform``)::

    Haiku module_name                        hookax key
    mlp                                      mlp
    mlp/~/linear_0                           mlp/linear_0
    block/~encode/linear (made in encode)    block/~encode/linear  (the method: block:encode)
    block (in hk.layer_stack(3, "layers"))   layers/block, one layer: layers/block[2]
    block (the same, in tower's __call__)    tower/layers/block
    vlin (in hk.vmap), rblock (in hk.remat)  vlin, rblock (the transforms add no name)
    core (called in hk.scan)                 core, one iteration: core[1]

Inside ``hk.layer_stack`` (and ``hk.lift``) Haiku runs the layer in a transform of its own, whose
modules are named afresh (``block``); their parameters live under the lifting module's name
(``layers/block``), and so do their keys. ``hk.vmap``, ``hk.remat``, ``hk.scan``, ``hk.cond`` and
``transform_with_state`` leave names as they are. A scan entered anywhere inside ``apply``
(``hk.layer_stack``, ``hk.scan``) runs layers: ``[i]`` addresses one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from haiku._src import base as hk_base
from haiku._src import lift as hk_lift
from haiku._src import module as hk_module

from .._engine import context as _context
from .._engine import dispatch as _dispatch

__all__ = ["ADAPTER", "haiku_path", "install"]

_active = _context._ACTIVE_VALUE
_call = _dispatch.call
_BASE_NAMES = frozenset(n for n in dir(hk_module.Module) if n != "__call__")
_INTERNAL: tuple[type, ...] = (hk_lift.LiftingModule, hk_module.NameScopeModule)


def haiku_path(module_name: str) -> tuple[str, ...]:
    """A Haiku module name as a hookax path: split at ``/``, the ``~`` segments dropped.

    Examples:
      >>> haiku_path("mlp/~/linear_0")
      ('mlp', 'linear_0')
      >>> haiku_path("block/~encode/linear")
      ('block', '~encode', 'linear')
    """
    return tuple(s for s in module_name.split("/") if s and s != "~")


class _Local(threading.local):
    def __init__(self) -> None:
        # Haiku frame id of each transform entered while hookax was active -> the path prefix
        # of its modules (a lifted transform's: the lifting module's name) and the JAX trace it
        # was entered in.
        self.fresh: dict[int, tuple[tuple[str, ...], Any]] = {}
        # Haiku frame id -> the prefix of the last lifting module called in it: the prefix of
        # the transforms entered next from it (``hk.layer_stack`` calls its lifting module,
        # then runs the layer's own transform).
        self.lifted: dict[int, tuple[str, ...]] = {}


_LOCAL = _Local()


def _transform_of() -> tuple[int | None, tuple[str, ...], Any]:
    """The innermost transform entered while hookax was active: its frame id, the prefix of its
    modules' paths, and the trace of the outermost one (None where none was recorded)."""
    fresh = _LOCAL.fresh
    if not fresh:
        return None, (), None
    found: tuple[int | None, tuple[str, ...]] = (None, ())
    outer = None
    for frame in hk_base.frame_stack:  # innermost first
        hit = fresh.get(frame.frame_id)
        if hit is not None:
            if found[0] is None:
                found = (frame.frame_id, hit[0])
            outer = hit[1]
    return found[0], found[1], outer


class HaikuAdapter:
    name = "haiku"
    immutable = True

    def __reduce__(self) -> str:
        return "ADAPTER"

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, hk_module.Module)

    def iter_modules(self, root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
        """Only the root: Haiku creates submodules while its methods run."""
        yield (), root

    def own_path(self, module: Any) -> tuple[Any, ...]:
        """``module``'s Haiku name as a path, below its lifting module's (``hk.layer_stack``)."""
        name = getattr(module, "module_name", None)
        if not isinstance(name, str):  # pragma: no cover - a call site always has its name
            return ()
        return _transform_of()[1] + haiku_path(name)

    def outer_trace(self) -> Any:
        """The JAX trace the outermost Haiku transform (``apply``) started in."""
        return _transform_of()[2]

    def aliases(self, module: Any) -> Iterator[Any]:
        yield module

    def root_done(self) -> None:
        pass


ADAPTER = HaikuAdapter()

# class -> method name -> whether it is a call site (weak: classes defined in a function die)
_SITES: weakref.WeakKeyDictionary[type, dict[str, bool]] = weakref.WeakKeyDictionary()


def _is_call_site(module: Any, name: str) -> bool:
    """``__call__`` and the public methods of the module's class (not properties, not
    ``hk.Module``'s own methods, not Haiku's internal modules)."""
    cls = type(module)
    known = _SITES.get(cls)
    if known is None:
        known = _SITES[cls] = {}
    hit = known.get(name)
    if hit is None:
        hit = known[name] = not issubclass(cls, _INTERNAL) and (
            name == "__call__"
            or (
                name.isidentifier()
                and not name.startswith("_")
                and name not in _BASE_NAMES
                and not isinstance(getattr(cls, name, None), property)
            )
        )
    return hit


class _Bound:
    """Haiku's bound method in the ``fn(module, *args, **kwargs)`` form of ``_dispatch``."""

    __slots__ = ("method",)

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method

    def __call__(self, _module: Any, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)


class _Site:
    """The method as Haiku's interceptors call it: the hookax call site, run innermost."""

    __slots__ = ("bound", "module", "name")

    def __init__(self, bound: Callable[..., Any], name: str, module: Any) -> None:
        self.bound, self.name, self.module = bound, name, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call(_Bound(self.bound), self.name, self.module, args, kwargs, ADAPTER)


_orig_run_interceptors: Callable[..., Any] = hk_module.run_interceptors


def run_interceptors(
    bound_method: Callable[..., Any],
    method_name: str,
    self: Any,
    orig_class: type,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Haiku's ``run_interceptors``, with the call as a hookax call site while hookax is active."""
    if not _active.value:
        return _orig_run_interceptors(bound_method, method_name, self, orig_class, *args, **kwargs)
    if _is_call_site(self, method_name):
        bound_method = _Site(bound_method, method_name, self)
    elif method_name == "__call__" and isinstance(self, hk_lift.LiftingModule):
        _note_lift(self)
    return _orig_run_interceptors(bound_method, method_name, self, orig_class, *args, **kwargs)


def _note_lift(lifting: Any) -> None:
    """A lifting module was called: the transforms entered next from this one (the lifted
    function's) name their modules below its parameters' prefix."""
    frame_id, prefix, _ = _transform_of()
    if frame_id is not None:
        _LOCAL.lifted[frame_id] = prefix + haiku_path(lifting.prefix_name)


_orig_enter = hk_base.HaikuContext.__enter__
_orig_exit = hk_base.HaikuContext.__exit__


def _enter(self: Any) -> Any:
    out = _orig_enter(self)
    if _active.value:
        parent, _, _ = _transform_of()
        prefix = _LOCAL.lifted.get(parent, ()) if parent is not None else ()
        frame = hk_base.frame_stack.peek()
        _LOCAL.fresh[frame.frame_id] = (prefix, _context.current_trace())
    return out


def _exit(self: Any, *exc: Any) -> Any:
    local = _LOCAL
    if local.fresh and hk_base.frame_stack:
        frame_id = hk_base.frame_stack.peek().frame_id
        local.fresh.pop(frame_id, None)
        local.lifted.pop(frame_id, None)
    return _orig_exit(self, *exc)


def install() -> None:
    """Route Haiku's method calls through hookax while hookax is active (once, never undone)."""
    if hk_module.run_interceptors is not run_interceptors:
        hk_module.run_interceptors = run_interceptors
    context = hk_base.HaikuContext
    if context.__enter__ is not _enter:
        context.__enter__ = _enter  # type: ignore[method-assign]
        context.__exit__ = _exit  # type: ignore[method-assign]
