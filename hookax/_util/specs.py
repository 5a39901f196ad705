"""Short array specs: ``f32[8,224,224,3]`` <-> ``jax.ShapeDtypeStruct``, for tables and the CLI."""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "DTYPES",
    "Shown",
    "SpecError",
    "describe",
    "describe_flat",
    "describe_tree",
    "format_spec",
    "parse_spec",
]

# Short name -> numpy dtype name. The short names are what tables print and the CLI parses.
DTYPES: dict[str, str] = {
    "bool": "bool",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "bf16": "bfloat16",
    "f16": "float16",
    "f32": "float32",
    "f64": "float64",
    "c64": "complex64",
    "c128": "complex128",
}
_SHORT = {v: k for k, v in DTYPES.items()}
_SPEC = re.compile(r"^\s*([a-z0-9]+)\s*\[\s*((?:\d+\s*(?:,\s*\d+\s*)*)?)\]\s*$")


class SpecError(ValueError):
    """An input spec that does not parse."""


def format_spec(shape: tuple[int, ...], dtype: Any) -> str:
    """The short form of an array's shape and dtype.

    Examples:
      >>> import numpy as np
      >>> format_spec((8, 64), np.float32)
      'f32[8,64]'
    """
    import numpy as np

    try:
        name = np.dtype(dtype).name
    except TypeError:  # extended dtypes (PRNG keys) are not numpy dtypes
        name = str(dtype)
    return f"{_SHORT.get(name, name)}[{','.join(str(d) for d in shape)}]"


def parse_spec(text: str) -> Any:
    """Parse ``"f32[8,224,224,3]"`` into a ``jax.ShapeDtypeStruct``.

    Examples:
      >>> parse_spec("bf16[2, 3]")
      ShapeDtypeStruct(shape=(2, 3), dtype=bfloat16)
      >>> parse_spec("i32[]").shape
      ()
    """
    import jax
    import jax.numpy as jnp

    m = _SPEC.match(text)
    if m is None or m.group(1) not in DTYPES:
        raise SpecError(
            f"cannot parse input spec {text!r}: expected DTYPE[DIM,...] like f32[8,224,224,3] "
            f"with DTYPE one of {', '.join(sorted(DTYPES))}"
        )
    dims = tuple(int(d) for d in m.group(2).split(",")) if m.group(2).strip() else ()
    return jax.ShapeDtypeStruct(dims, jnp.dtype(DTYPES[m.group(1)]))


def describe(x: Any) -> str:
    """One leaf as a short string: arrays (and tracers, specs) as ``f32[8,64]``, others by repr.

    Examples:
      >>> describe(3)
      '3'
    """
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return format_spec(tuple(shape), dtype)
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


class Shown:
    """A leaf whose ``repr`` is its short description (for :func:`describe_tree`)."""

    def __init__(self, x: Any) -> None:
        try:
            self.text = describe(x)
        except Exception:  # a leaf whose own repr fails
            self.text = type(x).__name__

    def __repr__(self) -> str:
        return self.text


def describe_tree(x: Any) -> str:
    """A pytree with each leaf described (:func:`describe`), in the tree's own notation.

    Examples:
      >>> import jax.numpy as jnp
      >>> describe_tree((None, jnp.ones((1, 8), jnp.float32)))
      '(None, f32[1,8])'
    """
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return describe(x)
    import jax

    leaves, treedef = jax.tree.flatten(x)
    return describe_flat(treedef, leaves)


def describe_flat(treedef: Any, leaves: list[Any]) -> str:
    """:func:`describe_tree` of the tree ``treedef`` holds ``leaves`` in. A class of the user's
    whose ``__init__`` or ``__repr__`` cannot take descriptions for leaves (a ``__repr__`` that
    reads ``.shape``) is shown as its name and its leaves: its own code is never in the way.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> leaves, treedef = jax.tree.flatten({"a": jnp.ones(2)})
      >>> describe_flat(treedef, leaves)
      "{'a': f32[2]}"
    """
    shown = [Shown(leaf) for leaf in leaves]
    try:
        return repr(treedef.unflatten(shown))
    except Exception:
        data = treedef.node_data() if hasattr(treedef, "node_data") else None
        name = getattr(data[0], "__name__", "?") if data else "?"
        return f"{name}({', '.join(map(repr, shown))})"
