"""Parts of a call site's output: the arrays inside a tuple, dataclass or dict output.

A part is written after the call-site key with dots, one step per level: ``.0`` (a tuple or
list position), ``.hidden_states`` (a field), ``.cache`` (a dict key): ``"decoder/layers_1.0"``
is the first array of the ``(x, cache)`` pair layer 1 returns, ``"decoder/layers[1].0"`` the
same of one layer of a scanned stack. Brackets are left to layers of a scan (``[1]``), so a
position in an output is never read as a layer. Dict keys that are not plain names keep JAX's
notation (``['a/b']``).
"""

from __future__ import annotations

import re
from typing import Any

import jax

__all__ = ["leaf_at", "part_name", "parts", "replace_at", "split_part"]

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


def parts(tree: Any) -> list[tuple[str, Any]]:
    """``(part, leaf)`` for every leaf of ``tree`` (``""`` for a tree that is one leaf)."""
    return [(part_name(kp), leaf) for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


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
    """``tree`` with its leaf named ``part`` replaced by ``value``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [part_name(kp) for kp, _ in flat]
    if part not in names:
        raise KeyError(part)
    leaves = [value if n == part else leaf for n, (_, leaf) in zip(names, flat, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)
