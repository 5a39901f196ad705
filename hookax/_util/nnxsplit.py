"""NNX modules inside a pytree, carried into a JAX transform as graphdef + state.

hookax compiles programs around the user's model (grids, attribution, ``find_nonfinite``,
harvest, splice). An NNX module goes into them the way the functional NNX API recommends: as
state through ``jax.jit``, rebuilt inside. A module that is a pytree (NNX's default) is already
that: ``jax.jit`` flattens it to its variables' arrays and rebuilds it inside (0.1 ms for 24
layers). A module declared ``pytree=False`` (graph mode) is no pytree: handed to ``jax.jit`` it
is refused as an argument, and closed over, a variable it creates on first use (a lazily built
RoPE cache) is set from inside a trace (``TraceContextError``); :func:`lift` splits those with
``nnx.split`` (one split of all of them, so modules shared between arguments stay shared) and
:func:`lower` merges them inside. Never ``nnx.jit`` around the model: it walks the module graph
on every call (10-20 ms per call measured). What the model sets on itself during the call (a
lazily created variable) stays in the program, as under ``jax.jit`` over ``nnx.split`` state.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any

import jax

__all__ = ["Split", "is_module", "lift", "lift_flat", "lower"]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th module was (a pytree without leaves)."""

    index: int


@jax.tree_util.register_pytree_node_class
class Split:
    """A pytree whose modules were cut out: ``tree`` holds a :class:`_Slot` for each, ``state``
    their arrays (pytree children), ``graphdef`` their structure (static, hashable)."""

    def __init__(self, tree: Any, state: Any, graphdef: Any) -> None:
        self.tree, self.state, self.graphdef = tree, state, graphdef

    def tree_flatten(self) -> tuple[tuple[Any, Any], Any]:
        return (self.tree, self.state), self.graphdef

    @classmethod
    def tree_unflatten(cls, graphdef: Any, children: Any) -> Split:
        tree, state = children
        return cls(tree, state, graphdef)


def is_module(x: Any) -> bool:
    """Whether ``x`` is an NNX module (without importing Flax)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)


# module type -> whether JAX takes its instances as leaves (pytree registration is per type)
_NO_PYTREE: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _no_pytree(x: Any) -> bool:
    """Whether ``x`` is an NNX module that JAX takes as a leaf (``pytree=False``)."""
    if not is_module(x):
        return False
    kind = type(x)
    leaf = _NO_PYTREE.get(kind)
    if leaf is None:
        one_level = jax.tree.structure(x, is_leaf=lambda y: y is not x)
        leaf = _NO_PYTREE[kind] = jax.tree_util.treedef_is_leaf(one_level)
    return leaf


def lift(tree: Any) -> Any:
    """``tree`` with its NNX modules that are no pytrees split out (a :class:`Split`), or
    ``tree`` itself when it holds none."""
    if "flax.nnx" not in sys.modules:
        return tree
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_no_pytree)
    modules = [x for x in leaves if _no_pytree(x)]
    if not modules:
        return tree
    from flax import nnx

    graphdef, state = nnx.split(tuple(modules))
    slots = iter(range(len(modules)))
    marked = [_Slot(next(slots)) if _no_pytree(x) else x for x in leaves]
    return Split(jax.tree.unflatten(treedef, marked), state, graphdef)


def lift_flat(tree: Any) -> tuple[list[Any], Any]:
    """``jax.tree.flatten(lift(tree))``, flattening ``tree`` once where no module in it needs a
    split (the usual case: a model's pytree takes milliseconds to flatten)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_no_pytree)
    if any(_no_pytree(x) for x in leaves):
        return jax.tree.flatten(lift(tree))
    return leaves, treedef


def lower(tree: Any) -> Any:
    """The pytree :func:`lift` split, with fresh modules merged from the state."""
    if not isinstance(tree, Split):
        return tree
    from flax import nnx

    modules = nnx.merge(tree.graphdef, tree.state)
    return jax.tree.map(
        lambda x: modules[x.index] if isinstance(x, _Slot) else x,
        tree.tree,
        is_leaf=lambda x: isinstance(x, _Slot),
    )
