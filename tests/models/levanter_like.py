"""A Llama written the way Levanter writes it, for the tests of Levanter's structure.

The package registry's Levanter (1.1, 2023) and Haliax (1.3, 2024) do not import on the JAX
hookax supports (``jax._src.tree_util.BuiltInKeyEntry`` is gone), so this model keeps what
matters to hookax in their structure: Equinox modules; every module takes and returns a
NamedArray-like pytree (one array and its axes as static data, registered as Haliax registers
its NamedArray); the decoder layers stacked in one module whose forward is ``lax.scan`` with the
stacked module passed as ``xs`` (Haliax's ``Stacked.fold``). The reference forward
(``unrolled``) runs the same layers one by one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

V, D, HEADS, HEAD_DIM, MLP, LAYERS = 64, 32, 4, 8, 64, 3


@dataclasses.dataclass(frozen=True)
class Axis:
    """A named axis and its size (Haliax's ``Axis``)."""

    name: str
    size: int


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Named:
    """One array with its axes, as Haliax's ``NamedArray`` is: a registered pytree whose one
    child is the array and whose static data is the ``Axis`` tuple; ``.shape`` is a dict of
    sizes by name. Axes may be given by name (their sizes are then the array's)."""

    array: jax.Array
    axes: tuple[Axis, ...]

    def __post_init__(self) -> None:
        if any(isinstance(a, str) for a in self.axes):
            sizes = self.array.shape
            axes = tuple(Axis(a, n) if isinstance(a, str) else a for a, n in zip(self.axes, sizes))
            object.__setattr__(self, "axes", axes)

    @property
    def shape(self) -> dict[str, int]:
        return {a.name: a.size for a in self.axes}

    @property
    def dtype(self) -> Any:
        return self.array.dtype

    @property
    def ndim(self) -> int:
        return self.array.ndim

    def tree_flatten(self) -> tuple[tuple[jax.Array], tuple[Axis, ...]]:
        return (self.array,), self.axes

    @classmethod
    def tree_unflatten(cls, axes: tuple[Axis, ...], children: Any) -> Named:
        new = object.__new__(cls)  # no checks: a transform's leaves may be anything
        object.__setattr__(new, "array", children[0])
        object.__setattr__(new, "axes", axes)
        return new


def _dense(key: jax.Array, n_in: int, n_out: int) -> jax.Array:
    return jax.random.normal(key, (n_in, n_out), jnp.float32) / jnp.sqrt(n_in)


class Linear(eqx.Module):
    weight: jax.Array

    def __call__(self, x: Named, out_axes: tuple[str, ...]) -> Named:
        return Named(x.array @ self.weight, out_axes)


class RMSNorm(eqx.Module):
    scale: jax.Array

    def __call__(self, x: Named) -> Named:
        a = x.array
        return Named(
            a * jax.lax.rsqrt(jnp.mean(a * a, -1, keepdims=True) + 1e-6) * self.scale, x.axes
        )


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding over ``[batch, pos, heads, head_dim]``."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(ang)[None, :, None, :], jnp.cos(ang)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


HeadEdit = Callable[[jax.Array], jax.Array] | None


class Attention(eqx.Module):
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear

    def __call__(
        self, x: Named, head_edit: HeadEdit = None, probs_out: list | None = None
    ) -> Named:
        b, t = x.array.shape[:2]
        axes = ("batch", "position", "heads", "head_size")
        q, k, v = (
            p(x, ("batch", "position", "qkv")).array.reshape(b, t, HEADS, HEAD_DIM)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = rope(q), rope(k)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(HEAD_DIM))
        causal = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        if probs_out is not None:
            probs_out.append(probs)
        heads = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        if head_edit is not None:
            heads = head_edit(heads)
        merged = Named(heads.reshape(b, t, HEADS * HEAD_DIM), (*axes[:2], "qkv"))
        return self.o_proj(merged, ("batch", "position", "embed"))


class Mlp(eqx.Module):
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    def __call__(self, x: Named) -> Named:
        hidden = ("batch", "position", "mlp")
        h = jax.nn.silu(self.gate_proj(x, hidden).array) * self.up_proj(x, hidden).array
        return self.down_proj(Named(h, hidden), x.axes)


class Block(eqx.Module):
    input_norm: RMSNorm
    self_attn: Attention
    post_attn_norm: RMSNorm
    mlp: Mlp

    def __call__(
        self, x: Named, head_edit: HeadEdit = None, probs_out: list | None = None
    ) -> Named:
        attn = self.self_attn(self.input_norm(x), head_edit, probs_out)
        h = Named(x.array + attn.array, x.axes)
        return Named(h.array + self.mlp(self.post_attn_norm(h)).array, x.axes)


class Stacked(eqx.Module):
    """The layers' parameters stacked on a leading axis; the forward scans the stacked module
    as ``xs`` (Haliax ``Stacked.fold``)."""

    stacked: Block

    def __call__(self, x: Named) -> Named:
        def body(carry: Named, block: Block) -> tuple[Named, None]:
            return block(carry), None

        return jax.lax.scan(body, x, self.stacked)[0]

    def layer(self, i: int) -> Block:
        arrays, static = eqx.partition(self.stacked, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda a: a[i], arrays), static)


class Embedding(eqx.Module):
    weight: jax.Array

    def __call__(self, ids: jax.Array) -> Named:
        return Named(self.weight[ids], ("batch", "position", "embed"))


class LlamaLMHeadModel(eqx.Module):
    embeddings: Embedding
    transformer: Stacked
    norm: RMSNorm
    lm_head: Linear

    def __call__(self, ids: jax.Array) -> Named:
        x = self.transformer(self.embeddings(ids))
        return self.lm_head(self.norm(x), ("batch", "position", "vocab"))


def _block(key: jax.Array) -> Block:
    k = jax.random.split(key, 7)
    return Block(
        input_norm=RMSNorm(jnp.ones(D)),
        self_attn=Attention(*(Linear(_dense(k[i], D, D)) for i in range(4))),
        post_attn_norm=RMSNorm(jnp.ones(D)),
        mlp=Mlp(
            Linear(_dense(k[4], D, MLP)), Linear(_dense(k[5], D, MLP)), Linear(_dense(k[6], MLP, D))
        ),
    )


def make(key: jax.Array) -> LlamaLMHeadModel:
    k_emb, k_layers, k_head = jax.random.split(key, 3)
    blocks = [_block(k) for k in jax.random.split(k_layers, LAYERS)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *blocks)
    return LlamaLMHeadModel(
        embeddings=Embedding(jax.random.normal(k_emb, (V, D), jnp.float32)),
        transformer=Stacked(stacked),
        norm=RMSNorm(jnp.ones(D)),
        lm_head=Linear(_dense(k_head, D, V)),
    )


def unrolled(
    model: LlamaLMHeadModel,
    ids: jax.Array,
    edit: Callable[[int, jax.Array], jax.Array] | None = None,
    head_edit: Callable[[int, jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, list[jax.Array], list[jax.Array], list[jax.Array]]:
    """The forward with the layers one by one: ``(logits, residual after each layer, per-head
    attention output of each layer, attention probabilities of each layer)``, with
    ``edit(i, x)`` / ``head_edit(i, h)`` written in."""
    x = model.embeddings(ids)
    hs: list[jax.Array] = []
    heads: list[jax.Array] = []
    probs: list[jax.Array] = []
    for i in range(LAYERS):

        def one(h: jax.Array, i: int = i) -> jax.Array:
            h = h if head_edit is None else head_edit(i, h)
            heads.append(h)
            return h

        x = model.transformer.layer(i)(x, one, probs)
        if edit is not None:
            x = Named(edit(i, x.array), x.axes)
        hs.append(x.array)
    logits = model.lm_head(model.norm(x), ("batch", "position", "vocab")).array
    return logits, hs, heads, probs


def logits(model: Any, ids: jax.Array) -> jax.Array:
    return model(ids).array
