"""A model or function, and its arguments, as arguments of a cached compiled program.

``split`` cuts a pytree (an NNX or Equinox module, a tuple of arguments) into its arrays, which
the program takes as arguments, and a hashable :class:`Static` rest (tree structure, functions,
options), which picks the compiled program. A compiled grid is reused by every later call with
an equal rest: functions compare like interceptors (:class:`~hookax._util.fnkey.FnKey`: code
and closure), other objects by value when hashable, else by identity. A function that closes
over an NNX module is never reused (the module can change in place behind the same closure); a
module passed itself, or among the arguments, is read afresh on every call, and enters the
program as ``nnx.split`` state merged inside (:mod:`hookax._util.nnxsplit`).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import jax
import numpy as np

from .._util import nnxsplit
from .._util.fnkey import FnKey

__all__ = ["Static", "join", "reusable", "split", "static_key", "value_of"]


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


class _ById:
    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ById) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


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


def split(tree: Any) -> tuple[list[Any], Static]:
    """``(arrays, rest)``: the array leaves (None elsewhere) and the hashable rest. NNX modules
    are split into graphdef (in the rest) and state (:mod:`hookax._util.nnxsplit`)."""
    leaves, treedef = jax.tree.flatten(nnxsplit.lift(tree))
    dyn = [x if is_array(x) else None for x in leaves]
    rest = tuple(None if is_array(x) else static_key(x) for x in leaves)
    return dyn, Static(treedef, rest)


def join(dyn: list[Any], rest: Static) -> Any:
    """The pytree :func:`split` cut: arrays from ``dyn``, the other leaves from ``rest``."""
    leaves = [d if s is None else value_of(s) for d, s in zip(dyn, rest.leaves)]
    return nnxsplit.lower(jax.tree.unflatten(rest.treedef, leaves))
