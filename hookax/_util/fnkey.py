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

import types
from typing import Any

__all__ = ["FnKey"]

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
