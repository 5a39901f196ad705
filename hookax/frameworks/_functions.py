"""Programs without modules: call sites from the program's own functions and named scopes.

A function given to a hookax API that calls no module of a framework (a JAX program written as
functions over a weight pytree) is traced for its call sites (:mod:`hookax._transforms.program`)
and run with each of them going through the dispatcher, as a module's method call does. The
"modules" of this adapter are :class:`~hookax._transforms.program.Site` objects, which know
their own paths.
"""

from __future__ import annotations

import collections
import functools
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .._engine.context import _ACTIVE_VALUE as _ACTIVE
from .._transforms import program as _program
from .._util.fnkey import ById as _ById
from .._util.fnkey import FnKey, reachable
from .._util.jaxcompat import core

__all__ = ["ADAPTER", "as_program", "install"]


class FunctionsAdapter:
    name = "functions"
    immutable = True

    def __reduce__(self) -> str:
        return "ADAPTER"

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, _program.Site)

    def iter_modules(self, root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
        yield (), root

    def aliases(self, module: Any) -> Iterator[Any]:
        yield module

    def relative_path(self, root: Any, module: Any) -> tuple[Any, ...] | None:
        if isinstance(module, _program.Site):
            return module.path
        return None

    def root_done(self) -> None:
        pass


ADAPTER = FunctionsAdapter()


def install() -> None:
    """Nothing to wrap: call sites come from the traced program."""


# ---------------------------------------------------------------------------------------------
# Discovered programs, cached like JAX's own traces: by function (its value-stable key),
# argument structure, shapes and dtypes, and static leaves.

_CACHE: collections.OrderedDict[Any, Any] = collections.OrderedDict()
_CACHE_SIZE = 64
_LOCK = threading.Lock()
_MODULES = object()  # the verdict for a function that calls a framework's modules


def _leaf_key(x: Any) -> Any:
    if isinstance(x, jax.Array | core.Tracer | np.ndarray | np.generic):
        return ("array", tuple(np.shape(x)), str(x.dtype), getattr(x, "weak_type", False))
    try:
        hash(x)
    except TypeError:
        return _ById(x)
    return (type(x), x)


def _cache_key(fn: Any, args: tuple, kwargs: dict) -> Any:
    from .._util.jaxcompat import config

    leaves, treedef = jax.tree.flatten((args, kwargs))
    # softmax as one operation (while ops= is active) changes the traced program
    flags = (config.softmax_custom_jvp.value,)
    return (FnKey(fn), treedef, tuple(_leaf_key(x) for x in leaves), flags)


def _holds_tracer(closed: Any) -> bool:
    return any(isinstance(c, core.Tracer) for c in getattr(closed, "consts", ()))


def program_of(fn: Any, args: tuple, kwargs: dict) -> _program.Program | None:
    """The discovered program of ``fn(*args, **kwargs)``, or None where ``fn`` calls modules."""
    try:
        key = _cache_key(fn, args, kwargs)
    except TypeError:
        key = None
    if key is not None:
        with _LOCK:
            hit = _CACHE.get(key)
            if hit is not None:
                _CACHE.move_to_end(key)
                return None if hit is _MODULES else hit
    # staged as JAX stages it, with jax.disable_jit too: a scan's body is one call site for
    # every layer (the names the same as under jit; hx.run_circuit unrolls its layers so)
    with jax.disable_jit(False):
        prog = _program.discover(fn, args, kwargs)
    if key is not None and (prog is None or not _holds_tracer(prog.closed)):
        with _LOCK:
            _CACHE[key] = _MODULES if prog is None else prog
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return prog


def _jitted(fn: Any) -> bool:
    """Whether ``fn`` is a ``jax.jit`` function (or a partial of one)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return hasattr(fn, "lower") and hasattr(fn, "eval_shape")


def _tracing(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(x, core.Tracer) for x in jax.tree.leaves((args, kwargs)))


def _compiled(prog: _program.Program) -> Callable[..., Any]:
    """``(args, kwargs) -> output``: the program's evaluation under ``jax.jit`` (its static
    leaves closed over), made once per program."""
    hit = prog.compiled
    if hit is None:
        spec = prog.in_spec
        treedef = prog.in_tree

        def run(dyn: list[Any]) -> Any:
            leaves = [dyn[s] if isinstance(s, int) else s.value for s in spec]
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            return _program.Evaluator(prog, ADAPTER).run(args, kwargs)

        jitted = jax.jit(run)

        def hit(args: tuple, kwargs: dict) -> Any:
            leaves = jax.tree.leaves((args, kwargs))
            return jitted([x for x, s in zip(leaves, spec, strict=True) if isinstance(s, int)])

        prog.compiled = hit
    return hit


def _mentions_module(fn: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a framework's module is among what ``fn`` reaches without running (itself, a
    bound ``self``, a partial's arguments, closure cells, defaults, the globals its code names,
    the attributes of plain objects among them, a few levels deep) or among the arguments.

    A function that calls a module it reaches this way runs as it is, with no trace to look
    for call sites of its own; any other is traced once for them (and still runs as it is if
    that trace meets a module)."""
    seen: set[int] = set()
    return _reaches(fn, 0, seen) or _reaches(args, 0, seen) or _reaches(kwargs, 0, seen)


_DEPTH = 4
_WIDTH = 64
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)


def _reaches(obj: Any, depth: int, seen: set[int]) -> bool:
    if depth > _DEPTH or isinstance(obj, _LEAVES) or id(obj) in seen:
        return False
    if isinstance(obj, jax.Array | np.ndarray | core.Tracer | _program.Site):
        return False
    seen.add(id(obj))
    from .._engine.adapters import adapter_for, is_haiku_model

    # A Haiku transform (or its apply) calls Haiku's modules, which its adapter sees.
    if adapter_for(obj) is not None or is_haiku_model(obj):
        return True
    items: list[Any]
    if isinstance(obj, list | tuple):
        items = list(obj[:_WIDTH])
    elif isinstance(obj, dict):
        items = list(obj.values())[:_WIDTH]
    elif isinstance(obj, functools.partial):
        items = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.MethodType):
        items = [obj.__self__, obj.__func__]
    elif isinstance(obj, types.FunctionType):
        items = list(reachable(obj))[1:]
        items += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        g = obj.__globals__
        items += [g[n] for n in obj.__code__.co_names if n in g][:_WIDTH]
    elif isinstance(obj, _ProgramFn):
        items = [obj.fn]
    elif hasattr(obj, "__wrapped__"):
        items = [obj.__wrapped__]
    else:
        try:
            d = vars(obj)
        except TypeError:
            return False
        items = list(d.values())[:_WIDTH]
    return any(_reaches(x, depth + 1, seen) for x in items)


def as_program(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a function whose calls see its call sites when it calls no module.

    A function that calls a framework's modules (found among its arguments or closure, or
    seen calling one while it is traced) runs as it is; any other runs through its traced
    program, each call of its Python functions and each named scope a call site.
    """
    if isinstance(fn, _ProgramFn) or not callable(fn) or _mentions_module(fn, (), {}):
        return fn
    # The same wrapper for the same function (the last few): caches keyed by the wrapper's id
    # (a capture of a jitted function made anew per step) hit. A wrapper holds its function, so
    # the table is bounded rather than weak.
    with _LOCK:
        hit = _WRAPPERS.get(id(fn))
        if hit is not None and hit.fn is fn:
            _WRAPPERS.move_to_end(id(fn))
            return hit
        hit = _WRAPPERS[id(fn)] = _ProgramFn(fn)
        while len(_WRAPPERS) > _CACHE_SIZE:
            _WRAPPERS.popitem(last=False)
    return hit


_WRAPPERS: collections.OrderedDict[int, _ProgramFn] = collections.OrderedDict()


class _ProgramFn:
    """``fn`` seen as a program; equal (and hashing equal) to another over an equal ``fn``."""

    __hookax_program__ = True

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.key = FnKey(fn)
        functools.update_wrapper(self, fn)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ProgramFn) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"hx.program({getattr(self.fn, '__qualname__', self.fn)!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.fn
        entries = _ACTIVE.value
        if not entries or entries == _program.DISCOVERING:
            # Nothing of hookax's is active (the program as it is, at no cost), or an enclosing
            # program is being traced for its call sites (they are seen there).
            return fn(*args, **kwargs)
        if _mentions_module(fn, args, kwargs):
            return fn(*args, **kwargs)
        prog = program_of(fn, args, kwargs)
        if prog is None:
            return fn(*args, **kwargs)
        if _jitted(fn) and not _tracing(args, kwargs):
            # A jitted program stays compiled: its evaluation is jitted in turn (hookax's active
            # hooks are part of the jit cache key, as for any function).
            return _compiled(prog)(args, kwargs)
        return _program.Evaluator(prog, ADAPTER).run(args, kwargs)

    def program(self, *args: Any, **kwargs: Any) -> _program.Program | None:
        """The traced program of ``fn(*args, **kwargs)`` (None where it calls modules)."""
        if _mentions_module(self.fn, args, kwargs):
            return None
        return program_of(self.fn, args, kwargs)


def program(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, with the call sites of a program without modules visible to hookax's blocks.

    A JAX program written as functions over a weight pytree calls no module, so its call sites
    are the calls of its own Python functions and its ``jax.named_scope`` blocks (see "Models
    without modules" in the docs). The functions that take ``fn`` (``hx.capture``,
    ``hx.value_and_grad``, ``hx.patch_grid``, ...) find them by themselves; a block
    (``hx.intercept``, ``hx.hooks``, ``hx.intercept_op``, ``hx.patching``) sees only what is
    called inside it, so the program is called through ``hx.program(fn)`` there. A function
    that calls modules is returned as it is.

    Args:
      fn: the program: a function of arrays and pytrees of arrays (other arguments are static).

    Returns:
      A function with ``fn``'s signature and results.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import hookax as hx
      >>> def layer(x, w):
      ...     return jnp.tanh(x @ w)
      >>> def forward(ws, x):
      ...     for w in ws:
      ...         x = layer(x, w)
      ...     return x
      >>> ws = [jnp.eye(2), 2 * jnp.eye(2)]
      >>> def double(next_fun, args, kwargs, ctx):
      ...     return 2 * next_fun(*args, **kwargs)
      >>> with hx.intercept(double, where="layer/1"):
      ...     y = hx.program(forward)(ws, jnp.ones(2))
      >>> bool(jnp.allclose(y, 2 * jnp.tanh(2 * jnp.tanh(jnp.ones(2)))))
      True
    """
    return as_program(fn)
