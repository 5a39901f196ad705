"""Value-stable cache keys for user functions.

The active interceptors and hooks are part of the jit cache key (and of JAX's eager
per-operation dispatch key), so their key must not change from call to call when the function
does not. A plain function is keyed by its code object, globals, defaults and closure contents:
a lambda re-created every step over the same objects gets an equal key and hits every cache,
while one closing over a different constant gets a different key and retraces. Closure contents
of simple immutable types (numbers, strings, tuples of them, classes, functions) compare by value;
anything else compares by identity, and the key holds a reference so the id cannot be reused.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["ById", "FnKey", "RecompileWarning", "note_fresh", "reachable"]

_BY_VALUE = (int, float, complex, str, bytes, bool, type(None), type, types.CodeType, range)
_MAX_DEPTH = 4


class _Id:
    """Compares by identity; holds the object so its id stays unique while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Id) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


ById = _Id  # an object as a cache key by identity, holding it so its id stays unique

_EMPTY_CELL = object()


def _value_key(v: Any, depth: int) -> Any:
    if isinstance(v, _BY_VALUE):
        return (type(v), v)
    if type(v) is tuple or type(v) is frozenset:
        return (type(v), tuple(_value_key(x, depth) for x in v))
    if depth < _MAX_DEPTH and isinstance(v, types.FunctionType | types.MethodType):
        return _fn_key(v, depth + 1)
    return _Id(v)


def _fn_key(fn: Any, depth: int = 0) -> Any:
    if isinstance(fn, types.FunctionType):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                contents = _EMPTY_CELL
            cells.append(_value_key(contents, depth))
        return (
            fn.__code__,
            _Id(fn.__globals__),
            _value_key(fn.__defaults__, depth),
            _Id(fn.__kwdefaults__) if fn.__kwdefaults__ else None,
            tuple(cells),
        )
    if isinstance(fn, types.MethodType):
        return ("method", _fn_key(fn.__func__, depth + 1), _Id(fn.__self__))
    if getattr(type(fn), "__hookax_program__", False):  # hx.program(f): keyed as f is
        return ("program", _fn_key(fn.fn, depth + 1))
    return _Id(fn)


class FnKey:
    """A user function plus its value-stable key; equal keys mean interchangeable functions.

    Examples:
      >>> def make(k):
      ...     return lambda x: x * k
      >>> FnKey(make(2)) == FnKey(make(2)), FnKey(make(2)) == FnKey(make(3))
      (True, False)
    """

    __slots__ = ("_hash", "_key", "fn")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._key = _fn_key(fn)
        self._hash = hash(self._key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FnKey):
            return NotImplemented
        return self.fn is other.fn or (self._hash == other._hash and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"FnKey({getattr(self.fn, '__qualname__', self.fn)!r})"


class RecompileWarning(UserWarning):
    """A hook or interceptor re-created over new closure values call after call.

    Its key changes each time, so every jitted function retraces and, eagerly, every operation
    of the hooked call sites recompiles (about 150x slower than a cache hit).
    """


# code object -> [hash of the last key made from it, hash of that key with its arrays masked,
# how many times in a row it changed in its arrays only, warned]. Hashes only: the table must
# not keep a function (or what its closure holds) alive.
_FRESH: dict[Any, list[Any]] = {}
_FRESH_LIMIT = 4  # changes in a row before the warning (each one a compile)


def note_fresh(key: FnKey, who: str, *, limit: int = _FRESH_LIMIT, fix: str | None = None) -> None:
    """Warn once per function when ``who`` (``"hx.intercept"``) keeps getting a new key for the
    same code: a closure over a new array each call (``limit`` changes in a row; ``fix``: what
    to say instead of the default fix)."""
    code = getattr(key.fn, "__code__", None)
    if code is None:
        return
    if _holds_tracer(key._key):
        return  # made inside a trace (each trace is a compile anyway): the fix, not the footgun
    h, masked, ids = key._hash, hash(_masked(key._key)), _cell_ids(key.fn)
    seen = _FRESH.get(code)
    if seen is None:
        if len(_FRESH) > 4096:  # many distinct functions: forget the oldest
            _FRESH.pop(next(iter(_FRESH)))
        _FRESH[code] = [h, masked, 0, False, ids]
        return
    if seen[0] == h:
        seen[2] = 0
        return
    # Only a change of arrays held by identity counts (the footgun: a new array each step);
    # different constants, strings or objects are different functions on purpose.
    only_arrays = seen[1] == masked
    changed = [n for n, (a, b) in zip(code.co_freevars, zip(seen[4], ids)) if a != b]
    seen[0], seen[1], seen[4] = h, masked, ids
    seen[2] = seen[2] + 1 if only_arrays else 0
    if seen[2] >= limit and not seen[3]:
        seen[3] = True
        import warnings

        name = getattr(key.fn, "__qualname__", repr(key.fn))
        what = f"; the value that changed: {', '.join(changed)}" if changed else ""
        fix = fix or (
            "each new value is a new cache key, so jitted functions retrace and eager "
            "operations of the hooked call sites recompile every call (about 150x slower). Fix: "
            "pass the changing value as an argument of a jitted step that enters the block "
            "inside it (jax.jit(step)(model, x, value)), or define the function once outside "
            "the loop."
        )
        warnings.warn(
            f"{who}: {name!r} ({code.co_filename}:{code.co_firstlineno}) was created "
            f"{limit} times in a row over different closure values"
            f"{_changed_cells(key.fn)}{what}; {fix}",
            RecompileWarning,
            stacklevel=4,
        )


def _cell_ids(fn: Any) -> tuple[int, ...]:
    """The identities of ``fn``'s closure contents (for naming the one that changed; ids only,
    nothing is kept alive)."""
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(id(cell.cell_contents))
        except ValueError:
            out.append(0)
    return tuple(out)


class _AnArray:
    """Stands for any array held by identity in a key (see :func:`_masked`)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _AnArray)

    def __hash__(self) -> int:
        return 0


def _masked(key: Any) -> Any:
    """``key`` with every array held by identity replaced by one placeholder."""
    if isinstance(key, _Id):
        import numpy as np

        obj = key.obj
        if isinstance(obj, np.ndarray) or (
            type(obj).__module__.startswith("jax") and hasattr(obj, "shape")
        ):
            return _AnArray()
        return key
    if type(key) is tuple:
        return tuple(_masked(k) for k in key)
    return key


def _holds_tracer(key: Any) -> bool:
    """Whether ``key`` holds a tracer, directly or in a list, tuple or dict (a dict of traced
    values, as a patching hook made inside a trace holds them)."""
    if isinstance(key, _Id):
        return _tracer_in(key.obj, 0)
    return type(key) is tuple and any(_holds_tracer(k) for k in key)


def _tracer_in(obj: Any, depth: int) -> bool:
    from jax.core import Tracer

    if isinstance(obj, Tracer):
        return True
    if depth >= 3:
        return False
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return any(_tracer_in(x, depth + 1) for x in obj[:64])
    return False


def _changed_cells(fn: Any) -> str:
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    kinds = []
    for name, cell in zip(names, getattr(fn, "__closure__", None) or (), strict=False):
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if not isinstance(v, _BY_VALUE) or isinstance(v, float | int):
            kinds.append(f"{name} ({type(v).__name__})")
    return f" (closing over {', '.join(kinds)})" if kinds else ""


def reachable(fn: Any) -> Iterator[Any]:
    """Objects the function reaches besides its arguments: itself, bound self, partial args."""
    seen = 0
    while seen < 8:
        seen += 1
        yield fn
        if isinstance(fn, functools.partial):
            yield fn.args
            yield fn.keywords
            fn = fn.func
        elif hasattr(fn, "__self__"):
            yield fn.__self__
            fn = getattr(fn, "__func__", None)
        else:
            break
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
