"""A decoder-only transformer (Llama-style: RMSNorm, causal attention, SwiGLU MLP).

With ``tie_embeddings=True`` the unembedding holds the very ``nnx.Param`` of the embedding, so
the summary shows the shared weight on both rows and counts it once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 172
    seq_len: int = 32
    tie_embeddings: bool = True
    dtype: str = "float32"  # compute and parameter dtype

    def params(self) -> int:
        """The exact parameter count of :class:`Decoder` with this configuration."""
        d = self.d_model
        block = 4 * d * d + 3 * d * self.d_ff + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab
        return self.vocab * d + self.n_layers * block + d + head


# LLAMA_7B.params() == 6_738_415_616
LLAMA_7B = Config(
    vocab=32_000,
    d_model=4096,
    n_heads=32,
    n_layers=32,
    d_ff=11_008,
    seq_len=2048,
    tie_embeddings=False,
    dtype="bfloat16",
)


def _linear(a: int, b: int, cfg: Config, rngs: nnx.Rngs) -> nnx.Linear:
    dt = jnp.dtype(cfg.dtype)
    return nnx.Linear(a, b, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)


def _norm(cfg: Config, rngs: nnx.Rngs) -> nnx.RMSNorm:
    dt = jnp.dtype(cfg.dtype)
    return nnx.RMSNorm(cfg.d_model, dtype=dt, param_dtype=dt, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q, self.k, self.v, self.o = (_linear(d, d, cfg, rngs) for _ in range(4))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads

        def heads(y: jax.Array) -> jax.Array:
            return y.reshape(b, t, h, d // h)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        out = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
        return self.o(out.reshape(b, t, d))


class MLP(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.gate = _linear(cfg.d_model, cfg.d_ff, cfg, rngs)
        self.up = _linear(cfg.d_model, cfg.d_ff, cfg, rngs)
        self.down = _linear(cfg.d_ff, cfg.d_model, cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Unembed(nnx.Module):
    """Logits from the embedding matrix itself: holds the same ``nnx.Param`` as the embedding."""

    def __init__(self, embedding: nnx.Param) -> None:
        self.embedding = embedding

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.embedding[...].T


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        dt = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = _norm(cfg, rngs)
        self.lm_head: Unembed | nnx.Linear = (
            Unembed(self.embed.embedding)
            if cfg.tie_embeddings
            else _linear(cfg.d_model, cfg.vocab, cfg, rngs)
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


CONFIG = Config()
PARAMS = CONFIG.params()
# Random token inputs for gradflow stay below this.
INT_HIGH = CONFIG.vocab


def make_model(rngs: nnx.Rngs, cfg: Config = CONFIG) -> Decoder:
    return Decoder(cfg, rngs=rngs)


def example_inputs(cfg: Config = CONFIG) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((2, cfg.seq_len), jnp.int32),)
