"""The arrays a function closes over, as arguments of the program that calls it.

A metric that closes over answer tokens, or a forward that closes over a model or a steering
vector, is part of a compiled program's static key. Keyed by its arrays' identities (as
:class:`~hookax._util.fnkey.FnKey` keys them), every new array compiles the program again; baked
into the program as constants, a changed global would be read stale. :func:`lift` cuts a
function into the arrays it reads (closure cells, the globals its code names, and the arrays
inside the lists, tuples, dicts and modules those hold) and a hashable template; :func:`rebuild`
makes the same function again around other values (the program's traced arguments). Equal
templates mean the same program serves both functions, whatever their arrays hold; Python ints
can be lifted too (answer token ids), where the function does not use them as static values.

Examples:
  >>> import jax.numpy as jnp
  >>> def metric_for(answers):
  ...     return lambda logits: logits[answers].sum()
  >>> leaves, a = lift(metric_for(jnp.array([0, 1])))
  >>> _, b = lift(metric_for(jnp.array([2, 3])))
  >>> a == b, len(leaves)
  (True, 1)
  >>> rebuild(a, [jnp.array([2, 3])])(jnp.arange(4.0))
  Array(5., dtype=float32)
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .fnkey import _Id, _value_key

__all__ = ["ARRAYS", "INTS", "NONE", "Lifted", "lift", "rebuild"]

NONE, ARRAYS, INTS = 0, 1, 2  # what to lift: nothing, arrays, arrays and Python ints
_MAX_DEPTH = 3


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


class _Static:
    """A value kept in the template, compared as :class:`FnKey` compares closure contents."""

    __slots__ = ("_hash", "key", "obj")

    def __init__(self, obj: Any, key: Any = None) -> None:
        self.obj, self.key = obj, _value_key(obj, 0) if key is None else key
        self._hash = hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and (other.obj is self.obj or other.key == self.key)

    def __hash__(self) -> int:
        return self._hash


_ARRAY, _INT = ("array",), ("int",)
_SCALARS = (int, float, complex, str, bytes, bool, type(None), range)
_OPAQUE = (*_SCALARS, type, types.ModuleType, types.FunctionType)  # never lifted


def _template(v: Any, level: int, depth: int, out: list[Any]) -> Any:
    """The template of one value; its lifted leaves appended to ``out``."""
    if _is_array(v):
        out.append(v)
        return _ARRAY
    if level >= INTS and type(v) is int:
        out.append(v)
        return _INT
    if isinstance(v, types.FunctionType) and depth < _MAX_DEPTH:
        return _fn_template(v, level, depth + 1, out)
    if isinstance(v, _OPAQUE):
        return _Static(v)
    try:
        leaves, treedef = jax.tree.flatten(v)
        hash(treedef)
    except Exception:  # not a pytree with a hashable structure
        return _Static(v)
    if not any(_liftable(x, level) for x in leaves):
        return _Static(v)
    return ("tree", treedef, tuple(_leaf(x, level, out) for x in leaves))


def _liftable(x: Any, level: int) -> bool:
    return _is_array(x) or (level >= INTS and type(x) is int)


def _leaf(x: Any, level: int, out: list[Any]) -> Any:
    if _liftable(x, level):
        out.append(x)
        return _ARRAY
    return _Static(x)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):  # a comprehension or an inner function
            names |= _global_names(c)
    return names


def _lifted_global(v: Any, level: int) -> bool:
    """Whether a global is read afresh on every call: arrays, ints (at :data:`INTS`), and
    containers or modules that hold arrays (an NNX model defined in a notebook)."""
    if _liftable(v, level):
        return True
    if isinstance(v, _OPAQUE):
        return False
    if isinstance(v, list | tuple | dict) or _is_module(v):
        return any(_liftable(x, level) for x in jax.tree.leaves(v))
    return False


def _is_module(v: Any) -> bool:
    for name, cls in (("flax.nnx", "Module"), ("equinox", "Module")):
        mod = sys.modules.get(name)
        if mod is not None and isinstance(v, getattr(mod, cls)):
            return True
    return False


def _fn_template(fn: types.FunctionType, level: int, depth: int, out: list[Any]) -> Any:
    cells = []
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(("empty",))
            continue
        cells.append(_template(contents, level, depth, out))
    g = fn.__globals__
    lifted = []
    for name in sorted(_global_names(fn.__code__)):
        if name in g and _lifted_global(g[name], level):
            lifted.append((name, _template(g[name], level, depth, out)))
        elif name in g and isinstance(g[name], _SCALARS):
            lifted.append((name, _Static(g[name])))  # a changed global constant: a new program
    return (
        "fn",
        _Static(fn, _code_key(fn)),
        tuple(cells),
        tuple(lifted),
    )


def _code_key(fn: types.FunctionType) -> Any:
    """What ``fn`` is without its closure: code, globals and defaults (as FnKey keys them)."""
    return (
        fn.__code__,
        _Id(fn.__globals__),
        _value_key(fn.__defaults__, 0),
        _Id(fn.__kwdefaults__) if fn.__kwdefaults__ else None,
    )


class Lifted:
    """The template of a function: equal for functions that differ only in lifted values."""

    __slots__ = ("_hash", "fn", "template")

    def __init__(self, fn: Any, template: Any) -> None:
        self.fn, self.template = fn, template
        self._hash = hash(template)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Lifted) and self.template == other.template

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Lifted({getattr(self.fn, '__qualname__', self.fn)!r})"


def lift(fn: types.FunctionType, level: int = INTS) -> tuple[list[Any], Lifted]:
    """``(leaves, template)``: the values of ``fn``'s closure and named globals that
    :func:`rebuild` takes back (arrays; Python ints too at :data:`INTS`), and the rest."""
    out: list[Any] = []
    return out, Lifted(fn, _fn_template(fn, level, 0, out))


def rebuild(lifted: Lifted, leaves: list[Any]) -> Any:
    """The function ``lifted`` stands for, reading ``leaves`` where its lifted values were."""
    it = iter(leaves)
    return _build(lifted.template, it)


def _build(t: Any, it: Iterator[Any]) -> Any:
    if isinstance(t, _Static):
        return t.obj
    kind = t[0]
    if kind in ("array", "int"):
        return next(it)
    if kind == "tree":
        return jax.tree.unflatten(t[1], [_build(x, it) for x in t[2]])
    _, static, cells, lifted = t
    fn = static.obj
    closure = []
    for c in cells:
        closure.append(types.CellType() if c == ("empty",) else types.CellType(_build(c, it)))
    g = fn.__globals__
    if any(not isinstance(x, _Static) for _, x in lifted):
        g = dict(g)  # the function reads its lifted globals from a copy
        g.update({name: _build(x, it) for name, x in lifted if not isinstance(x, _Static)})
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, tuple(closure) or None)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    return new
