"""A model or function, and its arguments, as arguments of a cached compiled program.

``split`` cuts a pytree (an NNX or Equinox module, a tuple of arguments) into its arrays, which
the program takes as arguments, and a hashable :class:`Static` rest (tree structure, functions,
options), which picks the compiled program. A compiled grid is reused by every later call with
an equal rest. A function's closure and the globals it names are lifted too
(:mod:`hookax._util.lift`): the arrays they hold (answer tokens, a steering vector, an NNX model
defined in a notebook) are arguments of the program, read afresh on every call, so new values
reuse the program; a metric's Python ints are lifted as well (:func:`retrying` traces again
without them where the function needs them static). Other objects compare by value when
hashable, else by identity; a function whose values cannot be lifted compares like interceptors
(:class:`~hookax._util.fnkey.FnKey`: code and closure), and one that closes over an NNX module
then is never reused (the module can change in place behind the same closure).
An NNX module passed itself, or among the arguments, is read afresh on every call, and
enters the program as ``nnx.split`` state merged inside (:mod:`hookax._util.nnxsplit`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import numpy as np

from .._engine import firstcall
from .._util import lift, nnxsplit
from .._util.errors import HookaxError
from .._util.fnkey import ById as _ById
from .._util.fnkey import FnKey, note_fresh

__all__ = [
    "Static",
    "avals",
    "join",
    "retrying",
    "reusable",
    "split",
    "static_key",
    "value_of",
]

T = TypeVar("T")
_LEVEL = contextvars.ContextVar("hookax_lift_level", default=lift.ARRAYS)


def is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


class _Once:
    """Equal to nothing but itself: a rest that must never hit a cache."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def reusable(key: Any) -> bool:
    """Whether a :func:`static_key` may pick a compiled program again (not a function that
    closes over an NNX module)."""
    return not isinstance(key, _Once)


def _holds_nnx_module(fn: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return False
    cells = []
    for f in (fn, getattr(fn, "__func__", None)):
        cells += [c for c in getattr(f, "__closure__", None) or ()]
    objs: list[Any] = [getattr(fn, "__self__", None)]
    for cell in cells:
        try:
            objs.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    leaves = jax.tree.leaves(objs, is_leaf=lambda x: isinstance(x, nnx.Module))
    return any(isinstance(leaf, nnx.Module) for leaf in leaves)


def value_of(key: Any) -> Any:
    """The object a :func:`static_key` stands for."""
    return key.fn if isinstance(key, FnKey) else key.obj


def static_key(obj: Any) -> Any:
    """A hashable stand-in for ``obj`` that holds it (``.obj``): equal stand-ins mean the same
    compiled program may serve both."""
    if isinstance(obj, types.FunctionType | types.MethodType):
        return _Once(obj) if _holds_nnx_module(obj) else FnKey(obj)
    try:
        hash(obj)
    except TypeError:
        return _ById(obj)
    return _ByValue(obj)


class _ByValue:
    __slots__ = ("_hash", "obj")

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self._hash = hash((type(obj), obj))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _ByValue) or type(other.obj) is not type(self.obj):
            return False
        try:
            return bool(other.obj == self.obj)
        except Exception:  # an __eq__ that returns arrays or raises
            return other.obj is self.obj

    def __hash__(self) -> int:
        return self._hash


@dataclasses.dataclass(frozen=True)
class Static:
    """The non-array rest of a pytree: its structure and stand-ins for its other leaves."""

    treedef: Any
    leaves: tuple[Any, ...]  # None where the leaf is an array


def split(tree: Any, *, ints: bool = False) -> tuple[list[Any], Static]:
    """``(arrays, rest)``: the array leaves (for a function, the values it closes over; None
    elsewhere) and the hashable rest. ``ints``: a function's Python ints are lifted too (at
    the level :func:`retrying` allows)."""
    level = _LEVEL.get() if ints else min(_LEVEL.get(), lift.ARRAYS)
    leaves, treedef = nnxsplit.lift_flat(tree)  # NNX modules: split state
    dyn: list[Any] = []
    rest: list[Any] = []
    for x in leaves:
        if is_array(x):
            dyn.append(x)
            rest.append(None)
            continue
        if level and isinstance(x, types.FunctionType):
            held, template = lift.lift(x, level)
            if held:
                dyn.append(held)
                rest.append(template)
                continue
        dyn.append(None)
        rest.append(static_key(x))
    return dyn, Static(treedef, tuple(rest))


def join(dyn: list[Any], rest: Static) -> Any:
    """The pytree :func:`split` cut: arrays from ``dyn``, the other leaves from ``rest``."""
    leaves = [
        d if s is None else lift.rebuild(s, d) if isinstance(s, lift.Lifted) else value_of(s)
        for d, s in zip(dyn, rest.leaves)
    ]
    return nnxsplit.lower(jax.tree.unflatten(rest.treedef, leaves))


def avals(dyn: list[Any]) -> Any:
    """A hashable key of ``dyn``'s structure, shapes and dtypes (a cache key with ``rest``)."""
    leaves, treedef = jax.tree.flatten(dyn)
    return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)


# code objects of the functions of a call -> the lift level their last successful trace used
_LEVELS: dict[Any, int] = {}


def retrying(who: str, fns: tuple[Any, ...], run: Callable[[], T]) -> T:
    """``run()`` with the values of ``fns`` lifted into arguments; where a trace fails with a
    lifted value (a metric that uses an int as a shape, numpy on a closed-over array), it runs
    again with fewer lifted (ints, then arrays) and remembers it for those functions' code.
    Without lifting, a function over new arrays compiles again: said by
    ``hx.RecompileWarning``."""
    codes = tuple(getattr(f, "__code__", None) for f in fns)
    level = _LEVELS.get(codes, lift.INTS)
    while True:
        try:
            with _level(level), firstcall.working():
                out = run()
        except HookaxError:
            raise
        except (TypeError, IndexError):
            if level == lift.NONE:
                raise
            level -= 1
            continue
        if len(_LEVELS) > 256:
            _LEVELS.clear()
        _LEVELS[codes] = level
        if level == lift.NONE:
            for f in fns:
                if isinstance(f, types.FunctionType):
                    note_fresh(FnKey(f), who, limit=2, fix=_FIX)
        return out


_FIX = (
    "it could not be lifted into an argument of the compiled program (tracing with it as an "
    "argument failed: it is used as a static value, e.g. a shape, or with numpy). Fix: compute "
    "with jax.numpy on it, or pass it among the function's arguments."
)


@contextlib.contextmanager
def _level(level: int) -> Iterator[None]:
    token = _LEVEL.set(level)
    try:
        yield
    finally:
        _LEVEL.reset(token)
