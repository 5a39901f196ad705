"""A Llama-style decoder written as functions over a weight pytree, with no module anywhere.

The way jax-ml/jax-llm-examples writes its models: the weights are a pytree of arrays (a dict
with a list of per-layer dicts), ``forward`` is a plain function with a Python loop over the
layers, and each layer's attention and feed-forward blocks are ``jax.named_scope`` blocks. The
unembedding reads the embedding table itself (tied embeddings). Its call sites are the calls of
these functions and the named scopes (``embed``, ``forward_layer/0/attention``, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 172
    seq_len: int = 32

    def params(self) -> int:
        """The exact number of elements of :func:`init_weights`' pytree."""
        d = self.d_model
        layer = 4 * d * d + 3 * d * self.d_ff + 2 * d
        return self.vocab * d + self.n_layers * layer + d


CONFIG = Config()
PARAMS = CONFIG.params()
# Random token inputs stay below this.
INT_HIGH = CONFIG.vocab


def init_weights(key: jax.Array, cfg: Config = CONFIG) -> dict[str, Any]:
    """The weight pytree: ``embed``, ``layers`` (one dict per layer) and the final ``norm``."""
    d, f = cfg.d_model, cfg.d_ff
    keys = iter(jax.random.split(key, 1 + 7 * cfg.n_layers))

    def dense(*shape: int) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[0])

    layers = [
        {
            "attn_norm": jnp.ones((d,), jnp.float32),
            "q": dense(d, d),
            "k": dense(d, d),
            "v": dense(d, d),
            "wo": dense(d, d),
            "mlp_norm": jnp.ones((d,), jnp.float32),
            "w_gate": dense(d, f),
            "w_up": dense(d, f),
            "w_down": dense(f, d),
        }
        for _ in range(cfg.n_layers)
    ]
    embed = jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32) * 0.02
    return {"embed": embed, "layers": layers, "norm": jnp.ones((d,), jnp.float32)}


def rms_norm(x: jax.Array, gamma: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gamma


def embed(tokens: jax.Array, table: jax.Array) -> jax.Array:
    return table[tokens]


def unembed(x: jax.Array, table: jax.Array) -> jax.Array:
    return x @ table.T


def forward_layer(x: jax.Array, layer: dict[str, jax.Array], cfg: Config) -> jax.Array:
    b, t, d = x.shape
    h = cfg.n_heads
    with jax.named_scope("attention"):
        y = rms_norm(x, layer["attn_norm"])
        q, k, v = ((y @ layer[w]).reshape(b, t, h, d // h).swapaxes(1, 2) for w in "qkv")
        scores = q @ k.swapaxes(-1, -2) / jnp.sqrt(d // h)
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        x = x + (probs @ v).swapaxes(1, 2).reshape(b, t, d) @ layer["wo"]
    with jax.named_scope("ffn"):
        y = rms_norm(x, layer["mlp_norm"])
        x = x + (jax.nn.silu(y @ layer["w_gate"]) * (y @ layer["w_up"])) @ layer["w_down"]
    return x


def forward(weights: dict[str, Any], tokens: jax.Array, cfg: Config = CONFIG) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` of ``tokens`` ``[batch, seq]``."""
    x = embed(tokens, weights["embed"])
    for layer in weights["layers"]:
        x = forward_layer(x, layer, cfg)
    return unembed(rms_norm(x, weights["norm"]), weights["embed"])


def make_program(cfg: Config = CONFIG) -> tuple[Any, dict[str, Any]]:
    """The program and its weights: ``forward(weights, *example_inputs())``."""
    return forward, init_weights(jax.random.key(0), cfg)


def example_inputs(cfg: Config = CONFIG) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((2, cfg.seq_len), jnp.int32),)
