"""``hx.Stack``: components of the residual stream on a leading axis, each with a label.

A pytree whose labels are static: a function under ``jax.jit`` may return one, and the labels
come back with the values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .._util.errors import HookaxError

__all__ = ["Stack"]


@dataclasses.dataclass(frozen=True)
class Stack:
    """Values stacked on a leading axis (``values[i]`` is component ``labels[i]``).

    Examples:
      >>> import jax.numpy as jnp
      >>> s = Stack(jnp.arange(6.0).reshape(3, 2), ("embed", "0_attn_out", "0_mlp_out"))
      >>> s["0_attn_out"]
      Array([2., 3.], dtype=float32)
      >>> len(s), s.shape
      (3, (3, 2))
    """

    values: Any
    labels: tuple[str, ...]

    def __post_init__(self) -> None:
        n = self.values.shape[0] if hasattr(self.values, "shape") else None
        if n is not None and n != len(self.labels):
            raise HookaxError(
                f"hx.Stack: {n} values on the leading axis but {len(self.labels)} labels."
            )

    def __getitem__(self, label: str) -> Any:
        """The component called ``label``."""
        return self.values[self.index(label)]

    def index(self, label: str) -> int:
        try:
            return self.labels.index(label)
        except ValueError:
            shown = ", ".join(repr(x) for x in self.labels[:8])
            raise KeyError(f"no component {label!r} in this stack; its labels: {shown}") from None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def sum(self) -> Any:
        """The components added up (the residual stream they decompose)."""
        return self.values.sum(0)


jax.tree_util.register_dataclass(Stack, data_fields=["values"], meta_fields=["labels"])
