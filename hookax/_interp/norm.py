"""The final norm applied to a stack of residual-stream components, two ways.

*Frozen*: with the scale the norm used in the forward, read from its own input and output (so its
epsilon convention does not matter), applied to every component alike. Linear: the components'
results add up to the norm's output less its bias. This is TransformerLens' ``apply_ln_to_stack``
and direct logit attribution.

*Recomputed*: the norm applied to each component as if it were the stream, with that
component's own statistics and the norm's epsilon. This is the logit lens: TransformerLens'
``accumulated_resid(apply_ln=True)``. Not linear; each entry is a stream of its own.

Examples:
  >>> import jax.numpy as jnp
  >>> from hookax._interp.weights import Norm
  >>> ln = Norm(scale=None, bias=None, centered=True, eps=0.0)
  >>> recomputed(ln, jnp.array([[1.0, 3.0], [2.0, 6.0]]), "ln_f", "hx.ResidualStream")
  Array([[-1.,  1.],
         [-1.,  1.]], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax

from .._util.errors import HookaxError
from .weights import Norm

__all__ = ["forward_scale", "frozen", "recomputed"]


def forward_scale(norm: Norm, x: Any, y: Any) -> Any:
    """The scale the norm divided ``x`` by to give ``y`` (``sqrt(var + eps)`` of a LayerNorm,
    the RMS of an RMSNorm), per vector: ``(..., 1)``."""
    if norm.centered:
        x = x - x.mean(-1, keepdims=True)
    u = x if norm.scale is None else x * norm.scale
    if norm.bias is not None:
        y = y - norm.bias
    return (u * u).sum(-1, keepdims=True) / (u * y).sum(-1, keepdims=True)


def frozen(norm: Norm, values: Any, scale: Any, *, weight: bool = True) -> Any:
    """``values`` centred (a LayerNorm), divided by the forward's ``scale``, times the norm's
    weight (``weight=False``: without it)."""
    if norm.centered:
        values = values - values.mean(-1, keepdims=True)
    values = values / scale
    if weight and norm.scale is not None:
        values = values * norm.scale
    return values


def recomputed(norm: Norm, values: Any, path: str, who: str) -> Any:
    """The norm, weight and bias included, applied to each vector of ``values`` with its own
    statistics: what the norm module returns for it."""
    if norm.eps is None:
        raise HookaxError(
            f"{who}: the final norm {path!r} holds no epsilon to recompute it with (Linen's "
            f"variables do not keep it). Fix: give Components(norm_eps=...) (nn.LayerNorm's "
            f"default is 1e-6), or frozen_ln=True for the forward's scale, frozen."
        )
    if norm.centered:
        values = values - values.mean(-1, keepdims=True)
    values = values * jax.lax.rsqrt((values * values).mean(-1, keepdims=True) + norm.eps)
    if norm.scale is not None:
        values = values * norm.scale
    return values if norm.bias is None else values + norm.bias
