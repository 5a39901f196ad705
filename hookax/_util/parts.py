"""Parts of a call site's output: the arrays inside a tuple, dataclass or dict output.

A part is written after the call-site key with dots, one step per level: ``.0`` (a tuple or
list position), ``.hidden_states`` (a field), ``.cache`` (a dict key): ``"decoder/layers_1.0"``
is the first array of the ``(x, cache)`` pair layer 1 returns, ``"decoder/layers[1].0"`` the
same of one layer of a scanned stack. Brackets are left to layers of a scan (``[1]``), so a
position in an output is never read as a layer. Dict keys that are not plain names keep JAX's
notation (``['a/b']``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, cast

import jax
import numpy as np

from .jaxcompat import treedef_from

__all__ = [
    "leaf_at",
    "part_name",
    "parts",
    "replace_at",
    "sole_array",
    "split_part",
    "unwrap_sole",
    "with_axes",
]

_STEP = re.compile(r"[A-Za-z_0-9]+")
_PART = re.compile(r"^(.*?[^.])((?:\.[A-Za-z_0-9]+|\['[^']*'\])+)$", re.S)


def _step(k: Any) -> str:
    for attr in ("idx", "name", "key"):
        if hasattr(k, attr):
            v = getattr(k, attr)
            text = str(v)
            if isinstance(v, int) or _STEP.fullmatch(text):
                return f".{text}"
            return f"[{text!r}]"
    return jax.tree_util.keystr((k,))


def part_name(keypath: tuple[Any, ...]) -> str:
    """The part of a leaf at ``keypath`` (``jax.tree_util`` keys) inside an output.

    Examples:
      >>> import jax
      >>> [part_name(kp) for kp, _ in jax.tree_util.tree_flatten_with_path((1.0, {"k": 2.0}))[0]]
      ['.0', '.1.k']
    """
    return "".join(_step(k) for k in keypath)


def _flat(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``tree``'s leaves with their paths, a NamedArray-like subtree (:func:`sole_array`) being
    one leaf."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: sole_array(x) is not None)


def parts(tree: Any) -> list[tuple[str, Any]]:
    """``(part, leaf)`` for every leaf of ``tree`` (``""`` for a tree that is one leaf); a
    NamedArray-like subtree is one leaf, its array (its names are kept by :func:`replace_at`).

    Examples:
      >>> import jax.numpy as jnp
      >>> [p for p, _ in parts((jnp.ones(2), {"k": jnp.ones(3)}))]
      ['.0', '.1.k']
    """
    return [(part_name(kp), unwrap_sole(leaf)) for kp, leaf in _flat(tree)[0]]


def split_part(text: str) -> tuple[str, str]:
    """A target as ``(call-site key or glob, part)``; ``""`` when it names no part.

    Examples:
      >>> split_part("decoder/layers[1].0"), split_part("enc:encode.out.0")
      (('decoder/layers[1]', '.0'), ('enc:encode', '.out.0'))
      >>> split_part("layers/0")
      ('layers/0', '')
    """
    m = _PART.match(text)
    if m is None or m.group(1).endswith("/") or not m.group(1):
        return text, ""
    return m.group(1), m.group(2)


def leaf_at(tree: Any, part: str) -> Any:
    """The leaf of ``tree`` named ``part``; ``KeyError`` listing the parts when none is."""
    found = parts(tree)
    for name, leaf in found:
        if name == part:
            return leaf
    raise KeyError(part)


def replace_at(tree: Any, part: str, value: Any) -> Any:
    """``tree`` with its leaf named ``part`` replaced by ``value`` (an array replacing a
    NamedArray-like leaf keeps its names)."""
    flat, treedef = _flat(tree)
    names = [part_name(kp) for kp, _ in flat]
    if part not in names:
        raise KeyError(part)
    leaves = [
        _rewrap(leaf, value) if n == part else leaf
        for n, (_, leaf) in zip(names, flat, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _rewrap(old: Any, value: Any) -> Any:
    found = sole_array(old)
    if found is None or not hasattr(value, "dtype") or sole_array(value) is not None:
        return value
    return found[1].unflatten([value])


def sole_array(tree: Any) -> tuple[Any, Any] | None:
    """``(array, treedef)`` of a registered pytree holding exactly one array (a Haliax
    ``NamedArray``: its array, and its axis names as static data), else None (arrays, tuples,
    lists, dicts and trees of several leaves). Such a tree is that array wherever hookax takes
    one (a patching target, a patch value); ``treedef.unflatten([new])`` rebuilds it.

    Examples:
      >>> import jax.numpy as jnp
      >>> sole_array(jnp.ones(2)), sole_array((jnp.ones(2),))
      (None, None)
    """
    if isinstance(tree, jax.Array | np.ndarray) or not hasattr(tree, "shape"):
        return None
    leaves, treedef = jax.tree.flatten(tree)
    node = cast(Any, treedef).node_data()
    if len(leaves) != 1 or node is None:
        return None
    if node[0] in (tuple, list, dict) or not hasattr(leaves[0], "dtype"):
        return None
    return leaves[0], treedef


def unwrap_sole(tree: Any) -> Any:
    """``tree``'s one array when :func:`sole_array` says it is one, else ``tree``."""
    found = sole_array(tree)
    return tree if found is None else found[0]


def axis_names(tree: Any) -> tuple[str, ...] | None:
    """The axis names of a NamedArray-like tree (:func:`sole_array`, its static data naming
    one axis each), else None.

    Examples:
      >>> import jax.numpy as jnp
      >>> axis_names(jnp.ones(2)) is None
      True
    """
    found = sole_array(tree)
    if found is None:
        return None
    aux = cast(Any, found[1]).node_data()[1]
    if not _names(aux) or len(aux) != getattr(found[0], "ndim", -1):
        return None
    return tuple(a if isinstance(a, str) else a.name for a in aux)


def _names(aux: Any) -> bool:
    """Whether ``aux`` lists axes: names, or Haliax-like ``Axis(name, size)`` dataclasses."""
    return (
        isinstance(aux, tuple)
        and bool(aux)
        and (
            all(isinstance(a, str) for a in aux)
            or all(dataclasses.is_dataclass(a) and hasattr(a, "size") for a in aux)
        )
    )


def _axis(like: Any, name: str, size: int) -> Any:
    return name if isinstance(like, str) else dataclasses.replace(like, name=name, size=size)


def with_axes(treedef: Any, lead: tuple[tuple[str, int], ...] = (), drop: int | None = None) -> Any:
    """``treedef`` with the axis names of its NamedArray-like nodes (one array, the names as
    static data) given ``lead`` (``(name, size)``) axes in front, or without the axis ``drop``:
    the names of a value that a scan stacked (the layer axis, ``"layers"``), or of one layer
    taken from it. Other nodes are kept."""
    nd = treedef.node_data()
    if nd is None:
        return treedef
    kids = [with_axes(c, lead, drop) for c in treedef.children()]
    node_type, aux = nd
    one_array = len(kids) == 1 and kids[0].node_data() is None
    if node_type in (tuple, list, dict) or not one_array or not _names(aux):
        return treedef_from(node_type, aux, kids)
    taken = {a if isinstance(a, str) else a.name for a in aux}
    added = []
    for name, size in lead:
        unique = name
        while unique in taken:
            unique += "_"
        taken.add(unique)
        added.append(_axis(aux[0], unique, size))
    aux = (*added, *aux)
    if drop is not None:
        aux = aux[:drop] + aux[drop + 1 :]
    return treedef_from(node_type, aux, kids)
