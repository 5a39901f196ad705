"""The weights a residual view reads, found by call-site path in the model itself.

A path (``"blocks/0/attn/out"``) is walked in what the user passes: an NNX or Equinox module
(attributes and list indices, as the call-site keys name them) or Linen's variables (the
``"params"`` collection, keyed by module name). What is read is the layer's own parameters,
oriented as ``x @ kernel``: a linear layer's kernel and bias, a norm's scale and bias, an
unembedding's matrix. Inside a jitted function the walked model holds tracers, so every view
built on these is traceable; a scanned stack's module holds its layers stacked, and so do the
arrays read from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from .._util.errors import HookaxError

__all__ = ["Linear", "Norm", "linear_at", "module_at", "norm_at", "unembed_at"]


def _value(x: Any) -> Any:
    """An NNX variable's array (``x[...]``), or ``x`` itself."""
    if x is None:
        return None
    return x.get_value() if hasattr(x, "get_value") else x


def module_at(root: Any, path: str, who: str) -> Any:
    """The module (NNX, Equinox) or parameter dict (Linen variables) at ``path`` of ``root``."""
    node = root
    if isinstance(node, Mapping) and "params" in node:
        node = node["params"]
    for seg in [s for s in path.split("/") if s]:
        try:
            if isinstance(node, Mapping):
                node = node[seg]
            elif seg.isdigit() and not hasattr(node, seg):
                node = node[int(seg)]
            else:
                node = getattr(node, seg)
        except (KeyError, IndexError, AttributeError, TypeError):
            raise HookaxError(
                f"{who}: no module at {path!r} in the {type(root).__name__} given as weights "
                f"(segment {seg!r} not found). Fix: pass the model the components' paths "
                f"name (NNX, Equinox), or Linen's variables ({{'params': ...}})."
            ) from None
    return node


@dataclasses.dataclass(frozen=True)
class Linear:
    """A linear layer as ``y = x @ kernel + bias``; ``kernel`` is ``(*in, out)`` (a scanned
    stack's has the layer axis in front)."""

    kernel: Any
    bias: Any


def linear_at(root: Any, path: str, who: str) -> Linear:
    """The kernel and bias of the linear layer at ``path``: ``nnx.Linear``/``LinearGeneral``
    (``kernel``), ``eqx.nn.Linear`` (``weight``, transposed here), Linen ``nn.Dense``/
    ``DenseGeneral`` (``{"kernel", "bias"}``)."""
    m = module_at(root, path, who)
    if isinstance(m, Mapping):
        if "kernel" in m:
            return Linear(m["kernel"], m.get("bias"))
    elif hasattr(m, "kernel"):
        return Linear(_value(m.kernel), _value(getattr(m, "bias", None)))
    elif hasattr(m, "weight") and hasattr(m, "in_features"):  # eqx.nn.Linear: (out, in)
        w = jnp.swapaxes(_value(m.weight), -1, -2)
        return Linear(w, _value(getattr(m, "bias", None)))
    raise HookaxError(
        f"{who}: {path!r} is a {type(m).__name__}, not a linear layer whose kernel can be read "
        f"(nnx.Linear, nnx.LinearGeneral, eqx.nn.Linear, nn.Dense, nn.DenseGeneral). Fix: "
        f"name the output projection itself (e.g. 'blocks/*/attn/out')."
    )


@dataclasses.dataclass(frozen=True)
class Norm:
    """A norm's learned affine part, whether it centers (LayerNorm) or not (RMSNorm), and its
    epsilon where the module holds one (``None``: Linen's variables, which do not)."""

    scale: Any
    bias: Any
    centered: bool
    eps: float | None = None


def norm_at(root: Any, path: str, who: str, kind: str | None = None) -> Norm:
    """The scale, bias and kind of the norm at ``path``: ``nnx.LayerNorm``/``RMSNorm``,
    ``eqx.nn.LayerNorm``/``RMSNorm``, Linen ``nn.LayerNorm``/``RMSNorm`` (a Linen norm with a
    bias is a LayerNorm, one without an RMSNorm, unless ``kind`` says). The epsilon is the
    module's ``epsilon`` (NNX) or ``eps`` (Equinox); Linen's variables hold none."""
    m = module_at(root, path, who)
    if isinstance(m, Mapping):
        if "scale" in m or "bias" in m:
            centered = "bias" in m if kind is None else kind == "layer"
            return Norm(m.get("scale"), m.get("bias"), centered)
    else:
        name = type(m).__name__
        if kind is None and "RMS" in name:
            kind = "rms"
        elif kind is None and "LayerNorm" in name:
            kind = "layer"
        if kind is not None:
            scale = getattr(m, "scale", getattr(m, "weight", None))
            eps = getattr(m, "epsilon", getattr(m, "eps", None))
            eps = float(eps) if isinstance(eps, int | float) else None
            return Norm(_value(scale), _value(getattr(m, "bias", None)), kind == "layer", eps)
    raise HookaxError(
        f"{who}: {path!r} is a {type(m).__name__}, not a norm whose scale can be read "
        f"(LayerNorm or RMSNorm of NNX, Linen or Equinox). Fix: name the final norm, or pass "
        f"norm_kind='layer' / 'rms' for a norm of your own with 'scale' and 'bias' attributes."
    )


def unembed_at(root: Any, path: str, who: str) -> Linear:
    """The unembedding at ``path`` as a ``(d_model, vocab)`` kernel and its bias: a linear
    layer, or an embedding used tied (``nnx.Embed``, ``eqx.nn.Embedding``, Linen ``nn.Embed``;
    its ``(vocab, d_model)`` table transposed, no bias)."""
    m = module_at(root, path, who)
    table = None
    if isinstance(m, Mapping) and "embedding" in m:
        table = m["embedding"]
    elif hasattr(m, "embedding"):
        table = _value(m.embedding)
    elif hasattr(m, "weight") and hasattr(m, "num_embeddings"):
        table = _value(m.weight)
    if table is not None:
        return Linear(jnp.swapaxes(table, -1, -2), None)
    return linear_at(root, path, who)
