"""A GPT in Flax NNX, written the usual way (``nnx.MultiHeadAttention``, ``nnx.LayerNorm``,
``nnx.Linear``, learned positions, biases everywhere), and loaders of TransformerLens'
``HookedTransformer`` weights and of Hugging Face's ``GPT2LMHeadModel`` weights into it.

The loaders take ``{name: numpy array}`` (``model.state_dict()`` converted), so this module
does not import torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hookax as hx

EPS = 1e-5  # TransformerLens' LayerNorm epsilon


# The GPT's parts and TransformerLens' names for them, as the parity checks use them.
PARTS = hx.Components(
    attn="blocks/*/attn",
    mlp="blocks/*/mlp",
    blocks="blocks/*",
    embed=("embed", "pos_embed"),
    final_norm="ln_f",
    unembed="unembed",
    heads="blocks/*/attn/out",
)
NAMES = hx.transformer_names("blocks/*", attention="nnx", pos_embed="pos_embed")
# The GPT that adds its positions inline (:class:`InlineGPT`): only the token embedding is a call.
INLINE_PARTS = dataclasses.replace(PARTS, embed="embed")


class MLP(nnx.Module):
    def __init__(self, d: int, d_mlp: int, rngs: nnx.Rngs) -> None:
        self.fc_in = nnx.Linear(d, d_mlp, rngs=rngs)
        self.fc_out = nnx.Linear(d_mlp, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(jax.nn.gelu(self.fc_in(x), approximate=True))  # TL's gelu_new


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, d_head: int, d_mlp: int, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(d, epsilon=EPS, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            heads, d, qkv_features=heads * d_head, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(d, epsilon=EPS, rngs=rngs)
        self.mlp = MLP(d, d_mlp, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
    def __init__(
        self,
        *,
        vocab: int,
        n_ctx: int,
        d: int,
        heads: int,
        d_head: int,
        d_mlp: int,
        depth: int,
        rngs: nnx.Rngs,
    ) -> None:
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos_embed = nnx.Embed(n_ctx, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, d_head, d_mlp, rngs) for _ in range(depth)])
        self.ln_f = nnx.LayerNorm(d, epsilon=EPS, rngs=rngs)
        self.unembed = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


class InlineGPT(nnx.Module):
    """``gpt``'s layers with its positions a table indexed inline (an ``nnx.Param``, no module
    call), as GPT-2 ports often write them."""

    def __init__(self, gpt: GPT) -> None:
        self.embed = gpt.embed
        self.pos = nnx.Param(gpt.pos_embed.embedding.get_value())
        self.blocks = gpt.blocks
        self.ln_f = gpt.ln_f
        self.unembed = gpt.unembed

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


def _set(var: Any, value: np.ndarray) -> None:
    array = jnp.asarray(value, jnp.float32)
    if var.shape != array.shape:
        raise ValueError(f"shape {array.shape} for a variable of shape {var.shape}")
    var.set_value(array)


def from_transformer_lens(sd: Mapping[str, np.ndarray], cfg: Mapping[str, int]) -> GPT:
    """The NNX GPT holding a ``HookedTransformer``'s weights: ``sd`` its state dict as numpy
    arrays, ``cfg`` its ``n_layers``, ``d_model``, ``n_heads``, ``d_head``, ``d_mlp``,
    ``d_vocab``, ``n_ctx``."""
    model = GPT(
        vocab=cfg["d_vocab"],
        n_ctx=cfg["n_ctx"],
        d=cfg["d_model"],
        heads=cfg["n_heads"],
        d_head=cfg["d_head"],
        d_mlp=cfg["d_mlp"],
        depth=cfg["n_layers"],
        rngs=nnx.Rngs(0),
    )
    _set(model.embed.embedding, sd["embed.W_E"])
    _set(model.pos_embed.embedding, sd["pos_embed.W_pos"])
    for i, block in enumerate(model.blocks):
        p = f"blocks.{i}."
        for ln, tl in [(block.ln1, "ln1"), (block.ln2, "ln2")]:
            _set(ln.scale, sd[p + tl + ".w"])
            _set(ln.bias, sd[p + tl + ".b"])
        for lin, n in [(block.attn.query, "Q"), (block.attn.key, "K"), (block.attn.value, "V")]:
            # TransformerLens' [head, d_model, d_head] -> Flax's [d_model, head, d_head]
            _set(lin.kernel, sd[p + f"attn.W_{n}"].transpose(1, 0, 2))
            _set(lin.bias, sd[p + f"attn.b_{n}"])
        _set(block.attn.out.kernel, sd[p + "attn.W_O"])  # [head, e, d]
        _set(block.attn.out.bias, sd[p + "attn.b_O"])
        _set(block.mlp.fc_in.kernel, sd[p + "mlp.W_in"])
        _set(block.mlp.fc_in.bias, sd[p + "mlp.b_in"])
        _set(block.mlp.fc_out.kernel, sd[p + "mlp.W_out"])
        _set(block.mlp.fc_out.bias, sd[p + "mlp.b_out"])
    _set(model.ln_f.scale, sd["ln_final.w"])
    _set(model.ln_f.bias, sd["ln_final.b"])
    _set(model.unembed.kernel, sd["unembed.W_U"])
    _set(model.unembed.bias, sd["unembed.b_U"])
    return model


def from_gpt2(sd: Mapping[str, np.ndarray], n_heads: int) -> GPT:
    """The NNX GPT holding a Hugging Face ``GPT2LMHeadModel``'s weights: ``sd`` its state dict as
    numpy arrays. GPT-2's ``Conv1D`` layers store ``[in, out]`` kernels, as Flax does; the
    attention's query, key and value are one fused ``c_attn``; the unembedding is the token
    embedding, transposed, with no bias."""
    vocab, d = sd["transformer.wte.weight"].shape
    depth = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("transformer.h."))
    d_head = d // n_heads
    model = GPT(
        vocab=vocab,
        n_ctx=sd["transformer.wpe.weight"].shape[0],
        d=d,
        heads=n_heads,
        d_head=d_head,
        d_mlp=sd["transformer.h.0.mlp.c_fc.weight"].shape[1],
        depth=depth,
        rngs=nnx.Rngs(0),
    )
    _set(model.embed.embedding, sd["transformer.wte.weight"])
    _set(model.pos_embed.embedding, sd["transformer.wpe.weight"])
    for i, block in enumerate(model.blocks):
        p = f"transformer.h.{i}."
        for ln, hf in [(block.ln1, "ln_1"), (block.ln2, "ln_2")]:
            _set(ln.scale, sd[p + hf + ".weight"])
            _set(ln.bias, sd[p + hf + ".bias"])
        qkv_w = np.split(sd[p + "attn.c_attn.weight"], 3, axis=1)  # [d, 3d] -> 3 x [d, d]
        qkv_b = np.split(sd[p + "attn.c_attn.bias"], 3)
        for lin, w, b in zip([block.attn.query, block.attn.key, block.attn.value], qkv_w, qkv_b):
            _set(lin.kernel, w.reshape(d, n_heads, d_head))  # heads are contiguous columns
            _set(lin.bias, b.reshape(n_heads, d_head))
        _set(block.attn.out.kernel, sd[p + "attn.c_proj.weight"].reshape(n_heads, d_head, d))
        _set(block.attn.out.bias, sd[p + "attn.c_proj.bias"])
        _set(block.mlp.fc_in.kernel, sd[p + "mlp.c_fc.weight"])
        _set(block.mlp.fc_in.bias, sd[p + "mlp.c_fc.bias"])
        _set(block.mlp.fc_out.kernel, sd[p + "mlp.c_proj.weight"])
        _set(block.mlp.fc_out.bias, sd[p + "mlp.c_proj.bias"])
    _set(model.ln_f.scale, sd["transformer.ln_f.weight"])
    _set(model.ln_f.bias, sd["transformer.ln_f.bias"])
    _set(model.unembed.kernel, sd["transformer.wte.weight"].T)  # tied: lm_head is wte
    _set(model.unembed.bias, np.zeros(vocab, np.float32))
    return model
