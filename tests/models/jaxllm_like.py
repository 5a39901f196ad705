"""A Llama written the way the JAX team writes its reference LLMs (jax-llm-examples' ``llama3``,
``qwen3``, ...), for the tests of programs without modules.

Its structure is theirs, in our own code: no module classes anywhere; the weights a pytree of
dataclasses registered with ``jax.tree_util.register_dataclass`` (``Weights`` holding a list of
``Layer``); a ``Config`` registered with ``register_static`` (a pytree without leaves, passed as
an ordinary argument, an unhashable dataclass as theirs is); plain functions ``forward`` ->
``forward_layer`` -> ``attention_block`` / ``ffn_block`` -> ``attention`` and the helpers
``einsum``, ``rms_norm``, ``apply_rotary_embedding``, ``make_attention_mask``; their
``jax.named_scope`` names (``attn_pre_norm``, ``qkv_matmul``, ``rope``, ``cache_update``,
``attention``, ``projection``, ``residual`` twice per layer, ``attn_post_norm``, ``ffn``,
``gate``, ``up_proj``, ``down_proj``); a Python loop over the layers; a ``KVCache`` dataclass
(one buffer per layer) that ``forward`` fills and returns; ``prefill`` (a ``jax.jit`` of
``forward`` made on each call, the cache donated), ``decode_step`` (``jax.jit`` at definition,
``donate_argnames=("cache",)``) and a greedy Python loop over decode steps (``generate``).

What is left out: sharding (``logical_to_physical``, ``reshard``, ``auto_axes``, ``shard_map``
and the mesh), the Pallas kernels, int8 quantization (``QuantArray``), padding of prompts and
the ring buffer of the cache. Differences kept small on purpose: float32 throughout (theirs is
bfloat16), ``forward_layer`` takes the layer's weights second, so that ``lax.scan`` can call it
directly (``forward_scan``: the variant over stacked layer weights, which they do not write).

The second half holds the hookax-free references: the same program edited by hand
(``ref_forward`` with an ``edit`` of each layer's residual output, a ``head_edit`` of each
layer's per-head attention output, and the attention probabilities appended to a list), the
patching grids, the attribution estimate and the steered generation computed from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


@jax.tree_util.register_static
@dataclasses.dataclass
class Config:
    """The model's sizes; static (a pytree node without leaves), passed as an argument."""

    embed: int = 32
    ffw_size: int = 64
    q_heads: int = 4
    kv_heads: int = 2
    num_layers: int = 3
    head_dim: int = 8
    vocab_size: int = 64
    max_seq_len: int = 16
    causal: bool = True
    dtype: Any = jnp.float32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


CFG = Config()


def _normal(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(jnp.float32(fan_in))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    """One decoder layer's weights; each field an array (a stacked layer: one more axis first)."""

    q: jax.Array  # [embed, q_heads, head_dim]
    k: jax.Array  # [embed, kv_heads, head_dim]
    v: jax.Array  # [embed, kv_heads, head_dim]
    o: jax.Array  # [q_heads, head_dim, embed]
    w_gate: jax.Array  # [embed, ffw]
    w_up: jax.Array  # [embed, ffw]
    w_down: jax.Array  # [ffw, embed]
    attn_pre_gamma: jax.Array  # [embed]
    attn_post_gamma: jax.Array  # [embed]

    @classmethod
    def init(cls, key: jax.Array, cfg: Config) -> Layer:
        k = jax.random.split(key, 9)
        d, f = cfg.embed, cfg.ffw_size
        return cls(
            q=_normal(k[0], (d, cfg.q_heads, cfg.head_dim), d),
            k=_normal(k[1], (d, cfg.kv_heads, cfg.head_dim), d),
            v=_normal(k[2], (d, cfg.kv_heads, cfg.head_dim), d),
            o=_normal(k[3], (cfg.q_heads, cfg.head_dim, d), cfg.q_heads * cfg.head_dim),
            w_gate=_normal(k[4], (d, f), d),
            w_up=_normal(k[5], (d, f), d),
            w_down=_normal(k[6], (f, d), f),
            attn_pre_gamma=1.0 + 0.1 * jax.random.normal(k[7], (d,), jnp.float32),
            attn_post_gamma=1.0 + 0.1 * jax.random.normal(k[8], (d,), jnp.float32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    """The whole model's weights: a list of layers (or one stacked ``Layer``: ``stack_layers``)."""

    layers: Any  # list[Layer], or a Layer of stacked arrays for forward_scan
    embedding: jax.Array  # [vocab, embed]
    gamma_final: jax.Array  # [embed]
    lm_head: jax.Array  # [embed, vocab]

    @classmethod
    def init(cls, key: jax.Array, cfg: Config) -> Weights:
        k_layers, k_emb, k_gamma, k_head = jax.random.split(key, 4)
        layers = [Layer.init(k, cfg) for k in jax.random.split(k_layers, cfg.num_layers)]
        return cls(
            layers=layers,
            embedding=jax.random.normal(k_emb, (cfg.vocab_size, cfg.embed), jnp.float32),
            gamma_final=1.0 + 0.1 * jax.random.normal(k_gamma, (cfg.embed,), jnp.float32),
            lm_head=_normal(k_head, (cfg.embed, cfg.vocab_size), cfg.embed),
        )


def init_weights(key: jax.Array, cfg: Config) -> Weights:
    """``Weights.init`` compiled (the config, a pytree without leaves, is part of the trace)."""
    return jax.jit(Weights.init)(key, cfg)


def stack_layers(weights: Weights) -> Weights:
    """The same weights with the layers stacked on a leading axis (``forward_scan``'s input)."""
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *weights.layers)
    return dataclasses.replace(weights, layers=stacked)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """One key and one value buffer per layer, ``[batch, kv_heads, max_seq_len, head_dim]``;
    ``iter`` counts the positions written so far."""

    k: list[jax.Array]
    v: list[jax.Array]
    iter: jax.Array  # [] int32
    size: int = dataclasses.field(default=16, metadata=dict(static=True))
    time_axis: int = dataclasses.field(default=2, metadata=dict(static=True))

    @classmethod
    def init(cls, cfg: Config, batch_size: int) -> KVCache:
        shape = (batch_size, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim)
        return cls(
            k=[jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers)],
            v=[jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers)],
            iter=jnp.zeros((), jnp.int32),
            size=cfg.max_seq_len,
        )

    def fill_len(self) -> jax.Array:
        return self.iter


def einsum(subscripts: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """Their wrapper around ``jnp.einsum`` (where quantized weights would be handled)."""
    return jnp.einsum(subscripts, lhs, rhs)


def segment_ids_to_positions(segment_ids: jax.Array) -> jax.Array:
    """The position of each token inside its segment, by an associative scan (as theirs is: a
    user function that ``lax.associative_scan`` calls several times while tracing)."""

    def combine(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> Any:
        count_a, seg_a = a
        count_b, seg_b = b
        return jnp.where(seg_a == seg_b, count_a + count_b, count_b), seg_b

    counts, _ = jax.lax.associative_scan(
        combine, (jnp.ones_like(segment_ids), segment_ids), axis=-1
    )
    return counts - 1


def _generate_pos_embeddings(
    positions: jax.Array, features: int, cfg: Config
) -> tuple[jax.Array, jax.Array]:
    """Sine and cosine of each position at ``features // 2`` frequencies: ``[B, T, features/2]``."""
    fraction = jnp.arange(0, features, 2, dtype=jnp.float32) / features
    frequency = 1.0 / (cfg.rope_theta**fraction)
    angles = positions.astype(jnp.float32)[..., None] * frequency
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary_embedding(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate ``x`` ``[B, heads, T, head_dim]`` by the positions' angles (``sin``/``cos``
    ``[B, T, head_dim/2]``), the two halves of the head dimension as a complex number."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    sin, cos = sin[:, None], cos[:, None]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def rms_norm(x: jax.Array, gamma: jax.Array, eps: float) -> jax.Array:
    mean_square = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (gamma * x / jnp.sqrt(mean_square + eps)).astype(x.dtype)


def make_attention_mask(
    q_len: int,
    k_len: int,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    q_offset: jax.Array,
    causal: bool,
) -> jax.Array:
    """``[B, 1, q_len, k_len]``: same segment, and (causal) no key after the query."""
    same = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
    if not causal:
        return same
    shape = (1, 1, q_len, k_len)
    q_pos = jax.lax.broadcasted_iota(jnp.int32, shape, 2) + q_offset[:, None, None, None]
    k_pos = jax.lax.broadcasted_iota(jnp.int32, shape, 3)
    return same & (q_pos >= k_pos)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    q_offset: jax.Array,
    cfg: Config,
) -> jax.Array:
    """Grouped-query attention: ``q`` ``[B, q_heads, t, d]``, ``k``/``v`` ``[B, kv_heads, T, d]``
    -> ``[B, q_heads, t, d]``. The probabilities are the one ``softmax`` here."""
    b, qh, t, d = q.shape
    kh, big_t = k.shape[1], k.shape[2]
    grouped = q.reshape((b, kh, qh // kh, t, d))
    scores = einsum("bhgtd,bhTd->bhgtT", grouped, k) * (cfg.head_dim**-0.5)
    scores = scores.reshape((b, qh, t, big_t))
    mask = make_attention_mask(t, big_t, q_segment_ids, kv_segment_ids, q_offset, cfg.causal)
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e30).astype(jnp.float32), axis=-1)
    out = einsum("bhgtT,bhTd->bhgtd", probs.reshape((b, kh, qh // kh, t, big_t)), v)
    return out.astype(cfg.dtype).reshape((b, qh, t, d))


def update_slice(x: jax.Array, y: jax.Array, pos: jax.Array, update_axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), pos, axis=update_axis)


def ref_attention_inputs(
    x: jax.Array,
    segment_ids: jax.Array,
    layer: Layer,
    sin: jax.Array,
    cos: jax.Array,
    cfg: Config,
    cache: KVCache | None,
    idx: int | None,
) -> Any:
    """Not a part of the model: the references' copy of ``attention_block`` up to the
    attention (queries, keys, values, masks), shared so both compute the same operations."""
    q = einsum("btd,dhq->bhtq", x, layer.q).astype(cfg.dtype)
    k = einsum("btd,dhq->bhtq", x, layer.k).astype(cfg.dtype)
    v = einsum("btd,dhq->bhtq", x, layer.v).astype(cfg.dtype)
    q, k = apply_rotary_embedding(q, sin, cos), apply_rotary_embedding(k, sin, cos)
    if cache is not None:
        assert idx is not None
        k = update_slice(cache.k[idx], k, cache.iter, update_axis=cache.time_axis)
        v = update_slice(cache.v[idx], v, cache.iter, update_axis=cache.time_axis)
        written = cache.fill_len() + x.shape[1]
        valid = jnp.arange(cache.size)[None, :] < written
        kv_segment_ids = jnp.broadcast_to(valid, (x.shape[0], cache.size)).astype(jnp.int32)
        q_segment_ids = jnp.where(segment_ids != 0, 1, 0).astype(jnp.int32)
        q_offset = jnp.broadcast_to(cache.fill_len(), (x.shape[0],))
    else:
        q_segment_ids, kv_segment_ids = segment_ids, segment_ids
        q_offset = jnp.zeros((x.shape[0],), jnp.int32)
    return q, k, v, q_segment_ids, kv_segment_ids, q_offset


def attention_block(
    x: jax.Array,
    segment_ids: jax.Array,
    layer: Layer,
    sin: jax.Array,
    cos: jax.Array,
    cfg: Config,
    cache: KVCache | None = None,
    idx: int | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Self-attention of one layer: ``(output [B, T, embed], (keys, values))``, the keys and
    values being the layer's full cache buffers when a cache is given."""
    with jax.named_scope("qkv_matmul"):
        q = einsum("btd,dhq->bhtq", x, layer.q).astype(cfg.dtype)
        k = einsum("btd,dhq->bhtq", x, layer.k).astype(cfg.dtype)
        v = einsum("btd,dhq->bhtq", x, layer.v).astype(cfg.dtype)

    with jax.named_scope("rope"):
        q, k = apply_rotary_embedding(q, sin, cos), apply_rotary_embedding(k, sin, cos)

    with jax.named_scope("cache_update"):
        if cache is not None:
            assert idx is not None
            k = update_slice(cache.k[idx], k, cache.iter, update_axis=cache.time_axis)
            v = update_slice(cache.v[idx], v, cache.iter, update_axis=cache.time_axis)
            written = cache.fill_len() + x.shape[1]
            valid = jnp.arange(cache.size)[None, :] < written
            kv_segment_ids = jnp.broadcast_to(valid, (x.shape[0], cache.size)).astype(jnp.int32)
            q_segment_ids = jnp.where(segment_ids != 0, 1, 0).astype(jnp.int32)
            q_offset = jnp.broadcast_to(cache.fill_len(), (x.shape[0],))
        else:
            q_segment_ids, kv_segment_ids = segment_ids, segment_ids
            q_offset = jnp.zeros((x.shape[0],), jnp.int32)
        cache_updates = (k, v)

    with jax.named_scope("attention"):
        attn_out = attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, cfg)

    with jax.named_scope("projection"):
        attn_out = einsum("bhtq,hqd->btd", attn_out, layer.o).astype(cfg.dtype)
    return attn_out, cache_updates


def ffn_block(x: jax.Array, layer: Layer, cfg: Config) -> jax.Array:
    with jax.named_scope("gate"):
        ff_gate = jax.nn.silu(einsum("btd,df->btf", x, layer.w_gate)).astype(cfg.dtype)
    with jax.named_scope("up_proj"):
        ff_up = einsum("btd,df->btf", x, layer.w_up).astype(cfg.dtype)
    with jax.named_scope("down_proj"):
        ff_out = einsum("btf,fd->btd", ff_gate * ff_up, layer.w_down).astype(cfg.dtype)
    return ff_out


def forward_layer(
    x: jax.Array,
    layer: Layer,
    segment_ids: jax.Array,
    sin: jax.Array,
    cos: jax.Array,
    idx: int | None,
    cfg: Config,
    cache: KVCache | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One decoder layer: ``(residual stream after it, (keys, values))``."""
    x = x.astype(cfg.dtype)
    with jax.named_scope("attn_pre_norm"):
        attn_in = rms_norm(x, layer.attn_pre_gamma, cfg.norm_eps)
    attn_out, cache_updates = attention_block(
        attn_in, segment_ids, layer, sin, cos, cfg, cache, idx
    )
    with jax.named_scope("residual"):
        x = x + attn_out.astype(cfg.dtype)
    with jax.named_scope("attn_post_norm"):
        ff_in = rms_norm(x, layer.attn_post_gamma, cfg.norm_eps)
    with jax.named_scope("ffn"):
        ff_out = ffn_block(ff_in, layer, cfg)
    with jax.named_scope("residual"):
        x = x + ff_out.astype(cfg.dtype)
    return x, cache_updates


def ref_embed_and_positions(
    x: jax.Array, segment_ids: jax.Array, weights: Weights, cfg: Config, cache: KVCache | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Not a part of the model (the references' copy of ``forward``'s first lines)."""
    h = weights.embedding[x].astype(cfg.dtype)
    positions = segment_ids_to_positions(segment_ids)
    if cache is not None:
        positions = positions + cache.fill_len()
    sin, cos = _generate_pos_embeddings(positions, cfg.head_dim, cfg)
    return h, sin.astype(cfg.dtype), cos.astype(cfg.dtype)


def forward(
    x: jax.Array,
    segment_ids: jax.Array,
    weights: Weights,
    cfg: Config,
    cache: KVCache | None = None,
) -> tuple[jax.Array, Any]:
    """Tokens ``[B, T]`` -> ``(logits [B, T, vocab], cache)``; without a cache, the second value
    is the list of each layer's ``(keys, values)``."""
    x = weights.embedding[x].astype(cfg.dtype)
    positions = segment_ids_to_positions(segment_ids)
    if cache is not None:
        positions = positions + cache.fill_len()
    sin, cos = _generate_pos_embeddings(positions, cfg.head_dim, cfg)
    sin, cos = sin.astype(cfg.dtype), cos.astype(cfg.dtype)

    all_cache_updates = []
    for idx, layer in enumerate(weights.layers):
        x, cache_updates = forward_layer(x, layer, segment_ids, sin, cos, idx, cfg, cache)
        all_cache_updates.append(cache_updates)

    x = rms_norm(x, weights.gamma_final, cfg.norm_eps)
    logits = einsum("btd,dv->btv", x, weights.lm_head)
    if cache is not None:
        # As theirs does: the traced cache argument's fields are assigned, then replaced.
        cache.k, cache.v = [z[0] for z in all_cache_updates], [z[1] for z in all_cache_updates]
        return logits, dataclasses.replace(cache, iter=cache.iter + x.shape[1])
    return logits, all_cache_updates


def forward_scan(
    x: jax.Array, segment_ids: jax.Array, weights: Weights, cfg: Config
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``forward`` (no cache) over stacked layer weights (``stack_layers``): ``lax.scan`` calls
    ``forward_layer`` itself once per layer; the keys and values come back stacked."""
    x = weights.embedding[x].astype(cfg.dtype)
    positions = segment_ids_to_positions(segment_ids)
    sin, cos = _generate_pos_embeddings(positions, cfg.head_dim, cfg)
    sin, cos = sin.astype(cfg.dtype), cos.astype(cfg.dtype)
    layer_fn = partial(forward_layer, segment_ids=segment_ids, sin=sin, cos=cos, idx=None, cfg=cfg)
    x, all_cache_updates = jax.lax.scan(layer_fn, x, weights.layers)
    x = rms_norm(x, weights.gamma_final, cfg.norm_eps)
    return einsum("btd,dv->btv", x, weights.lm_head), all_cache_updates


def prefill(
    tokens: jax.Array, weights: Weights, cache: KVCache, cfg: Config
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Run the prompt ``[B, T]`` into an empty cache: ``(greedy next tokens [B, T], logits,
    cache)``, by a ``jax.jit`` of ``forward`` made here, the cache donated."""
    segment_ids = jnp.ones(tokens.shape, jnp.int32)
    logits, cache = jax.jit(forward, donate_argnums=(4,))(tokens, segment_ids, weights, cfg, cache)
    next_tokens = jax.jit(partial(jnp.argmax, axis=-1))(logits)
    return next_tokens, logits, cache


@partial(jax.jit, donate_argnames=("cache",))
def decode_step(
    last_tokens: jax.Array, weights: Weights, cache: KVCache, cfg: Config
) -> tuple[jax.Array, KVCache]:
    """One token per sequence ``[B, 1]`` -> the greedy next ``[B, 1]`` and the cache."""
    segment_ids = jnp.ones(last_tokens.shape, jnp.int32)
    next_logits, cache = forward(last_tokens, segment_ids, weights, cfg, cache)
    return jnp.argmax(next_logits, -1), cache


def generate(tokens: jax.Array, weights: Weights, cfg: Config, steps: int) -> jax.Array:
    """Greedy generation: ``prefill`` then ``steps - 1`` calls of ``decode_step`` in a Python
    loop (their ``main.py``): ``[B, steps]``, the first column prefill's prediction."""
    cache = KVCache.init(cfg, tokens.shape[0])
    next_tokens, _, cache = prefill(tokens, weights, cache, cfg)
    current = next_tokens[:, -1:]
    out = [current]
    for _ in range(steps - 1):
        current, cache = decode_step(current, weights, cache, cfg)
        out.append(current)
    return jnp.concatenate(out, axis=-1)


def n_params(weights: Weights) -> int:
    return sum(int(a.size) for a in jax.tree.leaves(weights))


def segments(tokens: jax.Array) -> jax.Array:
    """The segment ids of unpadded prompts (one segment each)."""
    return jnp.ones(tokens.shape, jnp.int32)


# ---------------------------------------------------------------------------------------------
# The hookax-free references: the program edited by hand
# ---------------------------------------------------------------------------------------------

Edit = Callable[[int, jax.Array], jax.Array]


@dataclasses.dataclass
class Trace:
    """What the hand-edited forward records: the residual stream after each layer (``hs``) and
    entering each layer (``ins``), each layer's per-head
    attention output ``[B, q_heads, T, head_dim]`` as it enters the projection (``heads``,
    after ``head_edit``) and its attention probabilities ``[B, q_heads, t, T]`` (``probs``)."""

    hs: list[jax.Array] = dataclasses.field(default_factory=list)
    ins: list[jax.Array] = dataclasses.field(default_factory=list)
    heads: list[jax.Array] = dataclasses.field(default_factory=list)
    probs: list[jax.Array] = dataclasses.field(default_factory=list)


def ref_forward(
    x: jax.Array,
    segment_ids: jax.Array,
    weights: Weights,
    cfg: Config,
    cache: KVCache | None = None,
    *,
    edit: Edit | None = None,
    head_edit: Edit | None = None,
) -> tuple[jax.Array, Any, Trace]:
    """``forward`` written out again with the edits in the code: ``edit(i, x)`` replaces the
    residual stream after layer ``i``, ``head_edit(i, h)`` the per-head attention output of layer
    ``i`` before its projection. Returns ``(logits, cache or per-layer keys/values, Trace)``.
    Works on the layer list (``forward``'s weights)."""
    rec = Trace()
    h, sin, cos = ref_embed_and_positions(x, segment_ids, weights, cfg, cache)
    updates = []
    for i, layer in enumerate(weights.layers):
        rec.ins.append(h)
        attn_in = rms_norm(h, layer.attn_pre_gamma, cfg.norm_eps)
        q, k, v, q_seg, kv_seg, q_off = ref_attention_inputs(
            attn_in, segment_ids, layer, sin, cos, cfg, cache, i
        )
        b, qh, t, d = q.shape
        kh, big_t = k.shape[1], k.shape[2]
        scores = einsum("bhgtd,bhTd->bhgtT", q.reshape((b, kh, qh // kh, t, d)), k)
        scores = (scores * (cfg.head_dim**-0.5)).reshape((b, qh, t, big_t))
        mask = make_attention_mask(t, big_t, q_seg, kv_seg, q_off, cfg.causal)
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30).astype(jnp.float32), axis=-1)
        rec.probs.append(probs)
        out = einsum("bhgtT,bhTd->bhgtd", probs.reshape((b, kh, qh // kh, t, big_t)), v)
        out = out.astype(cfg.dtype).reshape((b, qh, t, d))
        if head_edit is not None:
            out = head_edit(i, out)
        rec.heads.append(out)
        h = h + einsum("bhtq,hqd->btd", out, layer.o).astype(cfg.dtype)
        ff_in = rms_norm(h, layer.attn_post_gamma, cfg.norm_eps)
        gate = jax.nn.silu(einsum("btd,df->btf", ff_in, layer.w_gate)).astype(cfg.dtype)
        up = einsum("btd,df->btf", ff_in, layer.w_up).astype(cfg.dtype)
        h = h + einsum("btf,fd->btd", gate * up, layer.w_down).astype(cfg.dtype)
        if edit is not None:
            h = edit(i, h)
        rec.hs.append(h)
        updates.append((k, v))
    logits = einsum("btd,dv->btv", rms_norm(h, weights.gamma_final, cfg.norm_eps), weights.lm_head)
    if cache is not None:
        new = dataclasses.replace(
            cache,
            k=[u[0] for u in updates],
            v=[u[1] for u in updates],
            iter=cache.iter + x.shape[1],
        )
        return logits, new, rec
    return logits, updates, rec


def ref_generate(
    tokens: jax.Array, weights: Weights, cfg: Config, steps: int, edit: Edit | None
) -> jax.Array:
    """``generate`` with ``ref_forward`` (and its ``edit``) in place of ``forward``, in
    prefill and in every decode step."""

    @jax.jit
    def step(tok: jax.Array, weights: Weights, cache: KVCache) -> tuple[jax.Array, KVCache]:
        logits, cache, _ = ref_forward(tok, segments(tok), weights, cfg, cache, edit=edit)
        return jnp.argmax(logits[:, -1:], -1), cache

    current, cache = step(tokens, weights, KVCache.init(cfg, tokens.shape[0]))
    out = [current]
    for _ in range(steps - 1):
        current, cache = step(current, weights, cache)
        out.append(current)
    return jnp.concatenate(out, axis=-1)


def metric(out: tuple[jax.Array, Any]) -> jax.Array:
    """A logit difference at the last position of the first prompt, of ``forward``'s output."""
    logits = out[0]
    return logits[0, -1, 1] - logits[0, -1, 2]


def _at(n: int, axis: int, ndim: int, index: jax.Array) -> jax.Array:
    shape = [1] * ndim
    shape[axis] = n
    return (jnp.arange(n) == index).reshape(shape)


@jax.jit
def _ref_run(tokens: jax.Array, weights: Weights, cfg: Config) -> Any:
    logits, updates, rec = ref_forward(tokens, segments(tokens), weights, cfg)
    return logits, updates, dataclasses.astuple(rec)


def ref_run(tokens: jax.Array, weights: Weights, cfg: Config) -> tuple[jax.Array, Any, Trace]:
    """``ref_forward`` without edits, compiled once: ``(logits, keys/values, Trace)``."""
    logits, updates, fields = _ref_run(tokens, weights, cfg)
    return logits, updates, Trace(*fields)


def ref_layer_grid(
    weights: Weights, cfg: Config, clean: jax.Array, corrupt: jax.Array
) -> jax.Array:
    """``[layer, position]``: ``metric`` of the corrupted run with the residual stream after that
    layer, at that position, replaced by the clean run's."""
    rec = ref_run(clean, weights, cfg)[2]
    seq = clean.shape[1]

    @jax.jit
    def one(layer: jax.Array, pos: jax.Array) -> jax.Array:
        def edit(i: int, h: jax.Array) -> jax.Array:
            return jnp.where(_at(seq, 1, 3, pos) & (layer == i), rec.hs[i], h)

        return metric(ref_forward(corrupt, segments(corrupt), weights, cfg, edit=edit))

    return jnp.array(
        [[one(jnp.int32(i), jnp.int32(p)) for p in range(seq)] for i in range(cfg.num_layers)]
    )


def ref_head_grid(weights: Weights, cfg: Config, clean: jax.Array, corrupt: jax.Array) -> jax.Array:
    """``[layer, head, position]``: ``metric`` of the corrupted run with one head's attention
    output (``[B, head, T, head_dim]``, entering the projection) at one position replaced by
    the clean run's."""
    rec = ref_run(clean, weights, cfg)[2]
    seq = clean.shape[1]

    @jax.jit
    def one(layer: jax.Array, head: jax.Array, pos: jax.Array) -> jax.Array:
        def head_edit(i: int, h: jax.Array) -> jax.Array:
            hit = _at(cfg.q_heads, 1, 4, head) & _at(seq, 2, 4, pos) & (layer == i)
            return jnp.where(hit, rec.heads[i], h)

        out = ref_forward(corrupt, segments(corrupt), weights, cfg, head_edit=head_edit)
        return metric(out)

    return jnp.array(
        [
            [
                [one(jnp.int32(i), jnp.int32(h), jnp.int32(p)) for p in range(seq)]
                for h in range(cfg.q_heads)
            ]
            for i in range(cfg.num_layers)
        ]
    )


def ref_layer_grads(
    loss: Callable[[jax.Array], jax.Array],
    weights: Weights,
    cfg: Config,
    tokens: jax.Array,
) -> tuple[jax.Array, list[jax.Array]]:
    """``(value, [d value / d residual after layer i])`` of ``loss(logits)``: a zero added to
    each layer's output as an argument, differentiated."""

    @jax.jit
    def value_and_grads(tokens: jax.Array, weights: Weights) -> tuple[jax.Array, list[jax.Array]]:
        _, _, rec = ref_forward(tokens, segments(tokens), weights, cfg)

        def f(eps: list[jax.Array]) -> jax.Array:
            edit = lambda i, h: h + eps[i]  # noqa: E731
            return loss(ref_forward(tokens, segments(tokens), weights, cfg, edit=edit)[0])

        return jax.value_and_grad(f)([jnp.zeros_like(h) for h in rec.hs])

    return value_and_grads(tokens, weights)


def ref_attribution(
    weights: Weights, cfg: Config, clean: jax.Array, corrupt: jax.Array
) -> jax.Array:
    """``[layer, position]``: attribution patching by hand, the gradient of ``metric`` at the
    corrupted run with respect to each layer's output times (clean - corrupted), summed over
    the batch and the embedding."""

    @jax.jit
    def estimate(clean: jax.Array, corrupt: jax.Array, weights: Weights) -> jax.Array:
        _, _, clean_rec = ref_forward(clean, segments(clean), weights, cfg)
        _, _, corrupt_rec = ref_forward(corrupt, segments(corrupt), weights, cfg)

        def f(eps: list[jax.Array]) -> jax.Array:
            edit = lambda i, h: h + eps[i]  # noqa: E731
            return metric(ref_forward(corrupt, segments(corrupt), weights, cfg, edit=edit))

        grads = jax.grad(f)([jnp.zeros_like(h) for h in corrupt_rec.hs])
        return jnp.stack(
            [
                jnp.sum((c - k) * g, axis=(0, 2))
                for c, k, g in zip(clean_rec.hs, corrupt_rec.hs, grads, strict=True)
            ]
        )

    return estimate(clean, corrupt, weights)


def poisoned(weights: Weights, layer: int = 2, value: float = float("nan")) -> Weights:
    """The weights with ``value`` written into one entry of layer ``layer``'s ``w_down``."""
    layers = list(weights.layers)
    bad = layers[layer]
    layers[layer] = dataclasses.replace(bad, w_down=bad.w_down.at[0, 0].set(value))
    return dataclasses.replace(weights, layers=layers)
