"""``hx.Components``: where a transformer's parts are, by call-site path, and the capture of
what ``hx.ResidualStream``'s views read from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._capture.capture import capture
from .._engine.select import Select, glob_to_regex, split_method

__all__ = ["Components", "as_tuple"]


def as_tuple(x: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if x is None else (x,) if isinstance(x, str) else tuple(x)


@dataclasses.dataclass(frozen=True)
class Components:
    """Where a transformer's parts are, by call-site path (globs over layers, or a scanned
    stack's one key).

    Args:
      attn: the attention outputs each block adds to the residual stream (``"blocks/*/attn"``).
      mlp: the MLP outputs (``"blocks/*/mlp"``); None for an attention-only model.
      blocks: the blocks, whose inputs are ``resid_pre`` (``"blocks/*"``); None: the stream is
        the embeddings plus the outputs added so far.
      embed: the embeddings whose sum starts the stream (``("embed", "pos_embed")``).
      final_norm: the norm before the unembedding (``"ln_f"``).
      unembed: the unembedding: a linear layer, or an embedding used tied.
      heads: the attention's output projection (``"blocks/*/attn/out"``): a linear layer whose
        input is the heads' outputs, concatenated (``nnx.Linear``, ``eqx.nn.Linear``,
        ``nn.Dense``: give ``n_heads``) or on their own axis (``nnx.MultiHeadAttention``'s
        ``out``, Linen's ``DenseGeneral``).
      n_heads: the number of heads, for a projection of concatenated heads.
      qkv: the attention's query, key and value projections (``("blocks/*/attn/query",
        "blocks/*/attn/key", "blocks/*/attn/value")``), whose inputs are each head's query, key
        and value inputs: the receivers of [`hx.edge_attribution`][hookax.edge_attribution]'s
        edges into heads.
      norms: in pre-norm blocks, the norms before the attention and before the MLP
        (``("blocks/*/ln1", "blocks/*/ln2")``; either may be None): the stream they read is the
        receivers' input, each head's query, key and value reading a copy of its own through
        the norm (needs ``n_heads``).
      norm_kind: ``"layer"`` or ``"rms"`` when the final norm's type does not say (a Linen
        LayerNorm without a bias).
      norm_eps: the final norm's epsilon, for recomputing it (``accumulated_resid(apply_ln=
        True)``) where the weights do not hold it (Linen's variables); NNX and Equinox norms
        give their own.
      embed_rest: whether the decompositions carry ``"embed_rest"``, what the named embeddings
        do not explain of the first block's input (needs ``blocks``). ``None``: where the
        values are known, when it is not zero; under a transform (labels cannot wait for
        values), always. ``True``: always. ``False``: never; a known rest that is not zero
        raises.
    """

    attn: str
    mlp: str | None = None
    blocks: str | None = None
    embed: str | tuple[str, ...] = ()
    final_norm: str | None = None
    unembed: str | None = None
    heads: str | None = None
    n_heads: int | None = None
    qkv: tuple[str, str, str] | None = None
    norms: tuple[str | None, str | None] | None = None
    norm_kind: str | None = None
    norm_eps: float | None = None
    embed_rest: bool | None = None

    def sites(self) -> tuple[str, ...]:
        """Every call site a view reads (their outputs and inputs are captured)."""
        names = [self.attn, self.mlp, self.blocks, self.final_norm, self.heads]
        return tuple(n for n in [*as_tuple(self.embed), *names] if n is not None)

    def wanted(self) -> tuple[str, ...]:
        """The captured keys (as patterns) a view uses; the rest are dropped."""
        out = [*as_tuple(self.embed), self.attn]
        out += [] if self.mlp is None else [self.mlp]
        out += [] if self.blocks is None else [f"{self.blocks}:in", self.blocks]
        out += [] if self.final_norm is None else [f"{self.final_norm}:in", self.final_norm]
        out += [] if self.heads is None else [f"{self.heads}:in"]
        return tuple(out)

    def capture(self, fn: Callable[..., Any]) -> Callable[..., tuple[Any, dict[str, Any]]]:
        """``hx.capture`` of what a view needs: ``y, acts = components.capture(fn)(*args)``;
        ``hx.ResidualStream(acts, components, weights)`` is the view."""
        forward = capture(fn, where=Select(paths=self.sites()), inputs=True)
        wanted = [(glob_to_regex(split_method(w)[0]), split_method(w)[1]) for w in self.wanted()]

        def run(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
            y, acts = forward(*args, **kwargs)
            keep = {}
            for key, values in acts.items():
                path, method = split_method(key)
                if any(rx.fullmatch(path) and m == method for rx, m in wanted):
                    keep[key] = values
            return y, keep

        return run
