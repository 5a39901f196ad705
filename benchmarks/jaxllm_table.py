"""Every hookax feature on jax-llm-examples' own llama3 and qwen3 (dense and MoE), each against
the same program computed or edited by hand without hookax: a Markdown table codebase x feature.

The models are jax-llm-examples' code, unmodified (``llama3/llama3_jax/model.py``,
``qwen3/qwen3_jax/model.py``): they are imported from a checkout given by ``--path`` or the
``JAXLLM_PATH`` environment variable (default ``/work/jaxllm``); without one the script says so
and exits (their code is not part of hookax). They run tiny and random on CPU, the way their
``main.py`` runs them: 4 CPU devices, an Explicit mesh ``("x", "y", "z") = (1, 2, 2)``,
``jax.sharding.set_mesh``, bfloat16, unquantized and int8 (weights and KV cache).

The hand references call their functions step by step (``forward_layer`` per layer) or replace
one of their functions in their module by a hand-edited wrapper for the run
(``attention``, ``forward_layer``), so their file is never changed. Each cell is the largest
absolute difference from the reference ("exact" when there is none), or what failed.

    JAXLLM_PATH=/path/to/jax-llm-examples python benchmarks/jaxllm_table.py [--quant] [--out t.md]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

FEATURES = [
    "summary params",
    "capture forward_layer/*",
    "attention probs (ops=)",
    "activation grads",
    "steering: forward",
    "steering: their decode loop",
    "patch_grid layers x positions",
    "patch_grid heads",
    "attribution_patch",
    "value_grad_and_stats (optax)",
    "find_nonfinite",
    "harvest",
]

B, T = 2, 8  # a batch of 2 prompts of 8 tokens: no padding (their prefill pads to 2**k)
STEPS = 4  # greedy decode steps after prefill


# ---------------------------------------------------------------------------------------------
# Their models, tiny


class Model:
    """One codebase with one config: their module, the config, and the few ways the two
    codebases differ (``rms_norm``'s epsilon argument, ``attention``'s mask arguments, where
    the FFN's down projection is)."""

    def __init__(self, name: str, mod: Any, cfg: Any, quant: bool) -> None:
        self.name, self.mod, self.cfg, self.quant = name, mod, cfg, quant
        self.qwen = hasattr(cfg, "norm_eps")

    def rms_norm(self, x: Any, gamma: Any) -> Any:
        if self.qwen:
            return self.mod.rms_norm(x, gamma, self.cfg.norm_eps)
        return self.mod.rms_norm(x, gamma)

    def head(self, weights: Any) -> Any:
        if self.qwen and self.cfg.tie_embed:
            return weights.embedding.T
        return weights.lm_head

    def cache(self, batch: int) -> Any:
        import jax

        if self.qwen:
            return self.mod.KVCache.init(jax.random.key(1), self.cfg, batch, self.cfg.max_seq_len)
        return self.mod.KVCache.init(jax.random.key(1), self.cfg, batch)

    def prefill(self, tokens: Any, weights: Any, cache: Any) -> Any:
        if self.qwen:
            return self.mod.prefill(tokens, weights, cache, self.cfg, pad_id=0)
        return self.mod.prefill(tokens, weights, cache, self.cfg)

    def down_proj(self, layer: Any) -> tuple[Any, str]:
        """The FFN's last weight of a layer and its field path (``w_down``, ``ffw.w_down``,
        ``ffw.we_down`` for a MoE layer)."""
        if not self.qwen:
            return layer, "w_down"
        return layer.ffw, ("we_down" if hasattr(layer.ffw, "we_down") else "w_down")


def models(path: str, quant: bool) -> list[Model]:
    import jax
    from jax.sharding import AxisType

    sys.path[:0] = [os.path.join(path, "llama3"), os.path.join(path, "qwen3")]
    from llama3_jax import model as l3
    from qwen3_jax import model as q3

    mesh = jax.make_mesh((1, 2, 2), ("x", "y", "z"), axis_types=(AxisType.Explicit,) * 3)
    llama = l3.Config(
        embed=32, ffw_size=64, q_heads=4, kv_heads=2, num_layers=2, head_dim=8, vocab_size=64,
        max_seq_len=32, causal=True, use_prefill_attn_kernel=False,
        use_decode_attn_kernel=False, mesh=mesh, quant_layer=False, quant_cache=False,
    )  # fmt: skip
    dense = q3.Config(
        embed=32, q_heads=4, kv_heads=2, num_layers=2, head_dim=8, vocab_size=64, max_seq_len=32,
        causal=True, moe_ffw_size=-1, moe_experts_per_tok=None, moe_num_experts=None,
        mlp_ffw_size=64, mesh=mesh, quant_cache=False,
    )  # fmt: skip
    moe = dataclasses.replace(
        dense, moe_ffw_size=16, moe_experts_per_tok=2, moe_num_experts=4, mlp_layer_idxs=[0]
    )
    out = []
    for q in (False, True) if quant else (False,):
        tag = " int8" if q else ""
        out.append(
            Model("llama3" + tag, l3, dataclasses.replace(llama, quant_layer=q, quant_cache=q), q)
        )
        for name, cfg in (("qwen3 dense", dense), ("qwen3 MoE", moe)):
            qc = dataclasses.replace(cfg, quant_attn=q, quant_mlp=q, quant_moe=q, quant_cache=q)
            out.append(Model(name + tag, q3, qc, q))
    return out


# ---------------------------------------------------------------------------------------------
# The hand references


@contextlib.contextmanager
def replaced(mod: Any, name: str, fn: Any) -> Iterator[None]:
    """``mod.name`` replaced by ``fn`` for the block (their functions look each other up in
    their module when traced); JAX's caches cleared on both sides, so a jitted function of
    theirs traced before (``decode_step``) is traced again with the replacement and after it."""
    import jax

    old = getattr(mod, name)
    setattr(mod, name, fn)
    jax.clear_caches()
    try:
        yield
    finally:
        setattr(mod, name, old)
        jax.clear_caches()


def hand_forward(
    m: Model,
    tokens: Any,
    seg: Any,
    weights: Any,
    edit: Callable[[int, Any], Any] | None = None,
    head_edit: Callable[[int, Any], Any] | None = None,
) -> tuple[Any, dict[str, list[Any]]]:
    """Their ``forward`` (no cache) step by step, by hand: the embedding, positions, then
    ``forward_layer`` per layer, the final norm and the head. ``edit(i, h)`` replaces the
    residual after layer ``i``; ``head_edit(i, o)`` replaces the output of layer ``i``'s
    ``attention`` function (``[B, q_heads, T, head_dim]``). Returns the logits and the records:
    ``hs`` (the residual after each layer) and ``attn_args`` (``attention``'s arguments)."""
    mod, cfg = m.mod, m.cfg
    rec: dict[str, list[Any]] = {"hs": [], "attn_args": []}
    original = mod.attention
    layer_at = [0]

    def attention(*args: Any, **kwargs: Any) -> Any:
        rec["attn_args"].append((args, kwargs))
        out = original(*args, **kwargs)
        return head_edit(layer_at[0], out) if head_edit is not None else out

    l2p = lambda *a: mod.logical_to_physical(a, cfg.rules)  # noqa: E731
    mod.attention = attention
    try:
        x = weights.embedding.at[tokens, :].get(out_sharding=l2p("batch", "sequence", "act_embed"))
        positions = mod.segment_ids_to_positions(seg)
        sin, cos = mod._generate_pos_embeddings(positions, cfg.head_dim, cfg)
        sin, cos = sin.astype(cfg.dtype), cos.astype(cfg.dtype)
        for i, layer in enumerate(weights.layers):
            layer_at[0] = i
            x, _ = mod.forward_layer(x, seg, layer, sin, cos, i, cfg, None)
            if edit is not None:
                x = edit(i, x)
            rec["hs"].append(x)
    finally:
        mod.attention = original
    x = m.rms_norm(x, weights.gamma_final)
    return mod.einsum("btd,dv->btv", x, m.head(weights)), rec


def hand_probs(m: Model, args: tuple, kwargs: dict) -> Any:
    """The attention probabilities ``[B, q_heads, t, T]`` recomputed from ``attention``'s
    arguments (q, k and the masks), as their ``attention`` computes them before the values."""
    import jax
    import jax.numpy as jnp

    mod, cfg = m.mod, m.cfg
    q, k = args[0], args[1]
    b, qh, t, d = q.shape
    _, kh, tk, _ = k.shape
    qk = mod.einsum("bhgtd,bhTd->bhgtT", q.reshape((b, kh, qh // kh, t, d)), k)
    qk = (qk * cfg.head_dim**-0.5).reshape((b, qh, t, tk))
    if m.qwen:
        mask = mod.make_attention_mask(t, tk, *args[3:7], cfg.causal)
    else:
        q_seg, kv_seg, q_offset, starts = args[3:7]
        mask = mod.make_attention_mask(t, tk, q_seg, kv_seg, q_offset, cfg.causal, starts)
    return jax.nn.softmax(jnp.where(mask, qk, -1e30).astype(jnp.float32), axis=-1)


def split_float(weights: Any) -> tuple[Any, Any]:
    """``(the floating-point leaves, the others)`` (int8 weights cannot be differentiated),
    each with ``None`` where the other has a leaf."""
    import jax
    import jax.numpy as jnp

    floats = jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else None, weights)
    rest = jax.tree.map(lambda a: None if jnp.issubdtype(a.dtype, jnp.inexact) else a, weights)
    return floats, rest


def join(floats: Any, rest: Any) -> Any:
    import jax

    return jax.tree.map(lambda a, b: a if b is None else b, floats, rest, is_leaf=_none)


def _none(x: Any) -> bool:
    return x is None


# ---------------------------------------------------------------------------------------------
# The features, each against its reference


def maxdiff(a: Any, b: Any) -> float:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    return max(
        float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)), initial=0.0))
        for x, y in zip(la, lb, strict=True)
    )


def fmt(d: float) -> str:
    return "exact" if d == 0 else f"{d:.1e}"


class Case:
    """One model's weights, a clean and a corrupted batch, the loss, the metric, the clean run
    by hand."""

    def __init__(self, m: Model) -> None:
        import jax
        import jax.numpy as jnp

        self.m = m
        mod, cfg = m.mod, m.cfg
        self.weights = mod.Weights.init(jax.random.key(0), cfg)
        self.clean = jax.random.randint(jax.random.key(1), (B, T), 1, cfg.vocab_size)
        self.corrupt = self.clean.at[:, 2:4].set(
            jax.random.randint(jax.random.key(2), (B, 2), 1, cfg.vocab_size)
        )
        self.seg = jnp.ones((B, T), jnp.int32)
        self.clean_args = (self.clean, self.seg, self.weights, cfg)
        self.corrupt_args = (self.corrupt, self.seg, self.weights, cfg)
        self.L = cfg.num_layers
        self.hand = jax.jit(
            lambda tokens, seg, w: hand_forward(m, tokens, seg, w)[0:2], static_argnums=()
        )
        self.logits, self.rec = self.hand(self.clean, self.seg, self.weights)

    def ce(self, logits: Any, tokens: Any) -> Any:
        import jax
        import jax.numpy as jnp

        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        onehot = jax.nn.one_hot(tokens[:, 1:], self.m.cfg.vocab_size)
        return -jnp.mean(jnp.sum(logp * onehot, -1))

    def loss(self) -> Callable[..., Any]:
        """``loss(floats, rest, tokens, seg)``: the cross-entropy of their ``forward``, the
        floating-point weights first (the arguments differentiated)."""
        m = self.m

        def loss(floats: Any, rest: Any, tokens: Any, seg: Any) -> Any:
            logits, _ = m.mod.forward(tokens, seg, join(floats, rest), m.cfg)
            return self.ce(logits, tokens)

        return loss

    @staticmethod
    def metric(out: Any) -> Any:
        """A logit difference at the last position of the first prompt. Their logits are
        sharded over the vocabulary (Explicit axes): replicated first, as a user indexes them."""
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P
        from jax.sharding import reshard

        logits = reshard(out[0].astype(jnp.float32), P())
        return logits[0, -1, 1] - logits[0, -1, 2]


def f_summary(c: Case) -> str:
    """``hx.summary``'s parameter total against the weight pytree's size. With int8 weights
    (``QuantArray``), the parameters it counts are the floating-point arrays (the float16
    scales included); the int8 values are reported beside."""
    import jax
    import jax.numpy as jnp

    import hookax as hx

    leaves = jax.tree.leaves(c.weights)
    n = sum(int(a.size) for a in leaves)
    n_float = sum(int(a.size) for a in leaves if jnp.issubdtype(a.dtype, jnp.inexact))
    s = hx.summary(c.m.mod.forward, *c.clean_args)
    if s.totals.params == n:
        return f"exact ({n:,})"
    if s.totals.params == n_float:
        return f"exact ({n_float:,} floating-point; {n - n_float:,} int8 values not counted)"
    return f"fails: {s.totals.params:,} counted, {n:,} in the weights"


def f_capture(c: Case) -> str:
    import jax

    import hookax as hx

    (logits, _), acts = jax.jit(hx.capture(c.m.mod.forward, where="forward_layer/*"))(*c.clean_args)
    d = maxdiff(logits, c.logits)
    for i in range(c.L):
        ((h, _),) = acts[f"forward_layer/{i}"]
        d = max(d, maxdiff(h, c.rec["hs"][i]))
    return fmt(d)


def f_probs(c: Case) -> str:
    import jax

    import hookax as hx

    table = str(hx.ops(c.m.mod.forward, *c.clean_args))
    site = "forward_layer/0/attention_block/attention/attention:softmax"
    if site not in table:
        return f"fails: {site!r} not among hx.ops"
    ops = "forward_layer/*/attention_block/attention/attention:softmax"
    _, acts = jax.jit(hx.capture(c.m.mod.forward, ops=ops))(*c.clean_args)

    @jax.jit
    def want(tokens: Any, seg: Any, w: Any) -> Any:
        rec = hand_forward(c.m, tokens, seg, w)[1]
        return [hand_probs(c.m, a, k) for a, k in rec["attn_args"]]

    ref = want(c.clean, c.seg, c.weights)
    d = max(maxdiff(acts[ops.replace("*", str(i))][0], ref[i]) for i in range(c.L))
    return fmt(d)


def _layer_grads(c: Case, metric_of_logits: Callable[..., Any], tokens: Any) -> Any:
    """d metric / d (the residual after each layer), by hand: a zero added there,
    differentiated."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def grads(tokens: Any, w: Any) -> Any:
        hs = hand_forward(c.m, tokens, c.seg, w)[1]["hs"]

        def f(eps: list[Any]) -> Any:
            return metric_of_logits(hand_forward(c.m, tokens, c.seg, w, lambda i, h: h + eps[i])[0])

        return jax.value_and_grad(f)([jnp.zeros_like(h) for h in hs])

    return grads(tokens, c.weights)


def f_grads(c: Case) -> str:
    import hookax as hx

    floats, rest = split_float(c.weights)
    value, _, acts = hx.value_and_grad(c.loss(), where="forward/forward_layer/*")(
        floats, rest, c.clean, c.seg
    )
    ref_value, ref = _layer_grads(c, lambda lg: c.ce(lg, c.clean), c.clean)
    d = maxdiff(value, ref_value)
    for i in range(c.L):
        d = max(d, maxdiff(acts[f"forward/forward_layer/{i}"][0][0], ref[i]))
    return fmt(d)


def _vector(c: Case) -> Any:
    import jax
    import jax.numpy as jnp

    return (8.0 * jax.random.normal(jax.random.key(3), (c.m.cfg.embed,))).astype(jnp.bfloat16)


def _steered_layer(mod: Any, v: Any) -> Callable[..., Any]:
    """Their ``forward_layer`` with ``v`` added to layer 1's residual output, by hand."""
    original = mod.forward_layer

    def forward_layer(x: Any, seg: Any, layer: Any, sin: Any, cos: Any, idx: int, *a: Any) -> Any:
        out, updates = original(x, seg, layer, sin, cos, idx, *a)
        return (out + v if idx == 1 else out), updates

    return forward_layer


def _add_to_residual(v: Any) -> Callable[..., Any]:
    def interceptor(next_fun: Any, args: Any, kwargs: Any, ctx: Any) -> Any:
        out = next_fun(*args, **kwargs)
        return out[0] + v, out[1]

    return interceptor


def f_steer_forward(c: Case) -> str:
    import jax

    import hookax as hx

    v = _vector(c)
    jitted = jax.jit(hx.program(c.m.mod.forward))
    plain = jitted(*c.clean_args)[0]
    with hx.intercept(_add_to_residual(v), where="forward_layer/1"):
        got = jitted(*c.clean_args)[0]
    after = jitted(*c.clean_args)[0]
    want = jax.jit(lambda t, s, w: hand_forward(c.m, t, s, w, lambda i, h: h + v if i == 1 else h))(
        c.clean, c.seg, c.weights
    )[0]
    if maxdiff(want, c.logits) == 0:
        return "fails: the steering vector changes nothing"
    if maxdiff(after, plain) != 0 or maxdiff(plain, c.logits) != 0:
        return "fails: the plain forward changed"
    return fmt(maxdiff(got, want))


def generate(c: Case) -> tuple[Any, Any]:
    """Their greedy loop, as their ``main.py`` runs it: ``prefill`` (which jits ``forward``
    with the cache donated), then ``decode_step`` (jitted) ``STEPS`` times. The prompt's
    logits and the generated tokens."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    cache = c.m.cache(B)
    next_tokens, logits, cache = c.m.prefill(c.clean, c.weights, cache)
    cur = next_tokens.at[:, cache.iter - 1 : cache.iter].get(out_sharding=P(None, None))
    out = []
    for _ in range(STEPS):
        out.append(cur)
        cur, cache = c.m.mod.decode_step(cur, c.weights, cache, c.m.cfg)
    out.append(cur)
    return logits, jnp.concatenate(jax.device_get(out), -1)


def f_steer_decode(c: Case) -> str:
    import numpy as np

    import hookax as hx

    mod = c.m.mod
    v = _vector(c)
    original = mod.forward
    with replaced(mod, "forward", hx.program(original)):  # once, where forward is defined
        _, plain = generate(c)
        with hx.intercept(_add_to_residual(v), where="**/forward_layer/1"):
            logits, tokens = generate(c)
        after_logits, after = generate(c)
    with replaced(mod, "forward_layer", _steered_layer(mod, v)):
        want_logits, want = generate(c)
    base_logits, base = generate(c)
    if np.array_equal(want, base):
        return "fails: the steering vector changes no token"
    if not (np.array_equal(plain, base) and np.array_equal(after, base)):
        return "fails: the plain loop's tokens changed"
    if not np.array_equal(tokens, want):
        return f"fails: tokens {tokens.tolist()} != {want.tolist()}"
    d = max(maxdiff(logits, want_logits), maxdiff(after_logits, base_logits))
    return f"tokens equal, logits {fmt(d)}"


def f_grid_layers(c: Case) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import hookax as hx

    grid = hx.patch_grid(
        c.m.mod.forward, c.clean_args, c.corrupt_args, c.metric, where="forward_layer/*.0"
    )
    hs = c.rec["hs"]

    @jax.jit
    def one(layer: Any, pos: Any) -> Any:
        def edit(i: int, h: Any) -> Any:
            hit = (jnp.arange(T) == pos)[None, :, None] & (layer == i)
            return jnp.where(hit, hs[i], h)

        return c.metric(hand_forward(c.m, c.corrupt, c.seg, c.weights, edit))

    ref = np.array([[one(i, p) for p in range(T)] for i in range(c.L)])
    if np.shape(grid) != ref.shape:
        return f"fails: shape {np.shape(grid)} != {ref.shape}"
    return fmt(maxdiff(grid, ref))


def f_grid_heads(c: Case) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import hookax as hx

    where = "forward_layer/*/attention_block/attention/attention"
    grid = hx.patch_grid(
        c.m.mod.forward, c.clean_args, c.corrupt_args, c.metric, where=where, heads=1, axis=2
    )
    qh = c.m.cfg.q_heads

    @jax.jit
    def clean_heads(w: Any) -> Any:
        heads: list[Any] = []
        hand_forward(c.m, c.clean, c.seg, w, head_edit=lambda i, o: heads.append(o) or o)
        return heads

    heads = clean_heads(c.weights)

    @jax.jit
    def one(layer: Any, head: Any, pos: Any) -> Any:
        def head_edit(i: int, o: Any) -> Any:
            hit = (jnp.arange(qh) == head)[None, :, None, None]
            hit = hit & (jnp.arange(T) == pos)[None, None, :, None] & (layer == i)
            return jnp.where(hit, heads[i], o)

        return c.metric(hand_forward(c.m, c.corrupt, c.seg, c.weights, head_edit=head_edit))

    ref = np.array([[[one(i, h, p) for p in range(T)] for h in range(qh)] for i in range(c.L)])
    if np.shape(grid) != ref.shape:
        return f"fails: shape {np.shape(grid)} != {ref.shape}"
    return fmt(maxdiff(grid, ref))


def f_attribution(c: Case) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import hookax as hx

    est = hx.attribution_patch(
        c.m.mod.forward, c.clean_args, c.corrupt_args, c.metric, where="forward_layer/*.0"
    )
    corrupt_hs = jax.jit(lambda w: hand_forward(c.m, c.corrupt, c.seg, w)[1]["hs"])(c.weights)
    _, g = _layer_grads(c, lambda lg: c.metric((lg,)), c.corrupt)
    ref = jnp.stack(
        [
            jnp.sum((f32(a) - f32(b)) * f32(gi), (0, 2))
            for a, b, gi in zip(c.rec["hs"], corrupt_hs, g, strict=True)
        ]
    )
    if np.shape(est) != ref.shape:
        return f"fails: shape {np.shape(est)} != {ref.shape}"
    return fmt(maxdiff(est, ref))


def f32(x: Any) -> Any:
    import jax.numpy as jnp

    return x.astype(jnp.float32)


def f_stats(c: Case) -> str:
    import jax
    import jax.numpy as jnp
    import optax

    import hookax as hx

    where = "forward/forward_layer/*/residual/1"
    floats, rest = split_float(c.weights)
    opt = optax.sgd(1e-2)
    loss = c.loss()

    @jax.jit
    def step(floats: Any, state: Any, rest: Any, tokens: Any, seg: Any) -> Any:
        value, g, stats = hx.value_grad_and_stats(loss, where=where, stats=("norm",))(
            floats, rest, tokens, seg
        )
        updates, state = opt.update(g, state, floats)
        return optax.apply_updates(floats, updates), state, value, g, stats

    with jax.numpy_dtype_promotion("standard"):
        new, _, value, g, stats = step(floats, opt.init(floats), rest, c.clean, c.seg)
    want_value, want_g = jax.jit(jax.value_and_grad(loss))(floats, rest, c.clean, c.seg)
    d = max(maxdiff(value, want_value), maxdiff(g, want_g))
    _, layer_g = _layer_grads(c, lambda lg: c.ce(lg, c.clean), c.clean)
    for i in range(c.L):
        s = stats[where.replace("*", str(i))]
        d = max(d, maxdiff(s["act"]["norm"], jnp.linalg.norm(f32(c.rec["hs"][i]))))
        d = max(d, maxdiff(s["grad"]["norm"], jnp.linalg.norm(f32(layer_g[i]))))
    if maxdiff(new, floats) == 0:
        return "fails: no update applied"
    return fmt(d)


def f_nonfinite(c: Case) -> str:
    import hookax as hx

    bad = jax_copy(c.weights)
    owner, field = c.m.down_proj(bad.layers[1])
    w = getattr(owner, field)
    if c.m.quant and hasattr(w, "scale"):  # an int8 weight: its scale holds the NaN
        w = dataclasses.replace(w, scale=poison(w.scale))
    else:
        w = poison(w)
    setattr(owner, field, w)
    loss = c.loss()
    floats, rest = split_float(c.weights)
    if hx.find_nonfinite(loss, floats, rest, c.clean, c.seg) is not None:
        return "fails: found a non-finite value in the clean weights"
    floats, rest = split_float(bad)
    layers = hx.find_nonfinite(loss, floats, rest, c.clean, c.seg, where="forward/forward_layer/*")
    if layers is None or layers.key != "forward/forward_layer/1":
        return f"fails: the layers' search found {layers}"
    # every call site inside forward (the loss's own helpers, which pass the weights on, too
    # hold the NaN)
    first = hx.find_nonfinite(loss, floats, rest, c.clean, c.seg, where="forward/**")
    if first is None or not first.key.startswith("forward/forward_layer/1/"):
        return f"fails: the search found {first}"
    return f"names `{layers.key}`, `{first.key}`"


def poison(a: Any) -> Any:
    """``a`` with a NaN in its first element, on ``a``'s devices and sharding."""
    import jax
    import numpy as np

    x = np.array(a)
    x[(0,) * x.ndim] = np.nan
    return jax.device_put(x, a.sharding)


def jax_copy(tree: Any) -> Any:
    """A copy of a pytree of dataclasses (their ``Weights``), new nodes, the same arrays."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, leaves)


def f_harvest(c: Case) -> str:
    import numpy as np

    import hookax as hx

    key = "forward_layer/1/residual/1"
    with tempfile.TemporaryDirectory() as tmp:
        h = hx.harvest(
            c.m.mod.forward,
            [c.clean_args, c.corrupt_args],
            where=key,
            store=os.path.join(tmp, "acts"),
            row_axes=2,
            progress=False,
        )
        got = np.asarray(h.read(key), np.float32)
    corrupt_hs = c.hand(c.corrupt, c.seg, c.weights)[1]["hs"]
    want = np.concatenate([np.asarray(c.rec["hs"][1]), np.asarray(corrupt_hs[1])])
    want = want.astype(np.float32).reshape(-1, c.m.cfg.embed)
    if got.shape != want.shape:
        return f"fails: shape {got.shape} != {want.shape}"
    return fmt(maxdiff(got, want))


RUNS: dict[str, Callable[[Case], str]] = dict(
    zip(
        FEATURES,
        [
            f_summary,
            f_capture,
            f_probs,
            f_grads,
            f_steer_forward,
            f_steer_decode,
            f_grid_layers,
            f_grid_heads,
            f_attribution,
            f_stats,
            f_nonfinite,
            f_harvest,
        ],
        strict=True,
    )
)


def reason(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"fails: {type(e).__name__}: {text[:160]}"


def run(m: Model, features: list[str], verbose: bool) -> dict[str, str]:
    import jax

    out: dict[str, str] = {}
    with jax.sharding.set_mesh(m.cfg.mesh):
        case = Case(m)
        for f in features:
            t0 = time.perf_counter()
            try:
                out[f] = RUNS[f](case)
            except Exception as e:  # a failure is a cell of the table
                out[f] = reason(e)
                if verbose:
                    traceback.print_exc()
            print(f"{m.name:<16} {f:<32} {time.perf_counter() - t0:6.1f}s  {out[f]}", flush=True)
    return out


def table(results: dict[str, dict[str, str]], features: list[str]) -> str:
    names = list(results)
    lines = [
        "| feature | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for f in features:
        lines.append(f"| {f} | " + " | ".join(results[n].get(f, "") for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default=os.environ.get("JAXLLM_PATH", "/work/jaxllm"))
    p.add_argument("--quant", action="store_true", help="also the int8 configs")
    p.add_argument("--models", default="", help="comma-separated name filter")
    p.add_argument("--features", default="", help="comma-separated name filter")
    p.add_argument("--out", default="", help="write the Markdown table there too")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks")
    a = p.parse_args(argv)
    if not os.path.isdir(os.path.join(a.path, "llama3", "llama3_jax")):
        print(
            f"jax-llm-examples not found at {a.path!r} (give --path or JAXLLM_PATH): skipped",
            file=sys.stderr,
        )
        return 0
    import jax

    import hookax

    ms = [m for m in models(a.path, a.quant) if not a.models or m.name in a.models.split(",")]
    feats = [f for f in FEATURES if not a.features or any(s in f for s in a.features.split(","))]
    results = {m.name: run(m, feats, a.verbose) for m in ms}
    text = table(results, feats)
    text += (
        f"\n\nJAX {jax.__version__}, hookax {hookax.__version__}, "
        f"{jax.devices()[0].platform.upper()} x{jax.device_count()}\n"
    )
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
