"""A two-layer attention-only transformer that learns induction heads, trained on CPU.

Each training sequence is ``half`` random tokens followed by the same tokens again; the model is
trained to predict the next token of the repeated half, which it can only do by finding the
earlier copy of the current token and reading the token after it. Two heads in two layers
learn it (Elhage et al. 2021; Olsson et al. 2022): a *previous-token head* in layer 0 writes
each token's predecessor into its position, and an *induction head* in layer 1 attends, with a
key that reads that write (K-composition), to the position after the earlier copy.

``python -m hookax.examples.induction`` trains the model once (seeded, about a minute on two
CPU cores), caches its weights under ``~/.cache/hookax`` and prints each head's induction and
previous-token scores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .._interp.names import transformer_names

__all__ = [
    "AttnOnly",
    "Config",
    "components",
    "corrupted",
    "in_context_logprob",
    "induction_scores",
    "load_or_train",
    "patterns",
    "periodic_tokens",
    "prev_token_scores",
    "repeated_tokens",
    "train",
]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    half: int = 12  # the random half; sequences are 2 * half tokens
    batch: int = 64
    steps: int = 1500
    lr: float = 1e-2
    seed: int = 0


class Block(nnx.Module):
    """Attention only, no norm: ``x + attn(x)`` under a causal mask."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
        self.attn = nnx.MultiHeadAttention(
            cfg.n_heads, cfg.d_model, decode=False, normalize_qk=False, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        return x + self.attn(x, mask=mask)


class AttnOnly(nnx.Module):
    """Token and position embeddings, ``n_layers`` attention-only blocks, an unembedding."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos_embed = nnx.Embed(2 * cfg.half, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.unembed = nnx.Linear(cfg.d_model, cfg.vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.unembed(x)


def components() -> Any:
    """Where :class:`AttnOnly`'s parts are: an ``hx.Components`` for the residual views and
    the circuit functions."""
    from .._interp.components import Components

    return Components(
        attn="blocks/*/attn",
        blocks="blocks/*",
        embed=("embed", "pos_embed"),
        unembed="unembed",
        heads="blocks/*/attn/out",
        qkv=("blocks/*/attn/query", "blocks/*/attn/key", "blocks/*/attn/value"),
    )


def repeated_tokens(key: jax.Array, batch: int, half: int, vocab: int) -> jax.Array:
    """``(batch, 2 * half)`` int32 tokens: ``half`` random tokens, then the same again."""
    first = jax.random.randint(key, (batch, half), 0, vocab, dtype=jnp.int32)
    return jnp.concatenate([first, first], axis=1)


def periodic_tokens(key: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """Training data: ``(batch, 2 * half)`` tokens, each sequence random tokens repeated with
    a period of its own between ``half // 2`` and ``half`` (a fixed period would let position
    alone find the copy), and the periods."""
    k1, k2 = jax.random.split(key)
    seq = 2 * cfg.half
    period = jax.random.randint(k1, (cfg.batch,), cfg.half // 2, cfg.half + 1)
    first = jax.random.randint(k2, (cfg.batch, seq), 0, cfg.vocab, dtype=jnp.int32)
    pos = jnp.arange(seq)
    return jnp.take_along_axis(first, pos % period[:, None], axis=1), period


def loss_fn(model: AttnOnly, tokens: jax.Array, period: jax.Array) -> jax.Array:
    """Mean cross-entropy of each next token that repeats an earlier one (position ``>=`` the
    sequence's period)."""
    logp = jax.nn.log_softmax(model(tokens)[:, :-1].astype(jnp.float32))
    target = tokens[:, 1:]
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    known = jnp.arange(1, tokens.shape[1])[None] >= period[:, None]
    return jnp.where(known, nll, 0.0).sum() / known.sum().astype(jnp.float32)


def train(cfg: Config = Config(), *, log_every: int = 0) -> tuple[AttnOnly, list[float]]:
    """Train :class:`AttnOnly` on repeated random tokens with Adam; returns the model and the
    loss of every step. Seeded: the same ``cfg`` gives the same weights on the same machine."""
    import optax

    model = AttnOnly(cfg, rngs=nnx.Rngs(cfg.seed))
    opt = nnx.Optimizer(model, optax.adam(cfg.lr), wrt=nnx.Param)

    @nnx.jit
    def step(model: AttnOnly, opt: nnx.Optimizer, key: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model, *periodic_tokens(key, cfg))
        opt.update(model, grads)
        return loss

    keys = jax.random.split(jax.random.key(cfg.seed + 1), cfg.steps)
    losses = []
    for i, key in enumerate(keys):
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count in
            losses.append(float(step(model, opt, key)))
        if log_every and (i % log_every == 0 or i == cfg.steps - 1):
            print(f"step {i:5d}  loss {losses[-1]:.4f}")
    return model, losses


def _cache_path(cfg: Config, cache_dir: str | os.PathLike[str] | None) -> pathlib.Path:
    root = pathlib.Path(cache_dir or os.environ.get("HOOKAX_CACHE", "~/.cache/hookax"))
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode())
    return root.expanduser() / f"induction-{digest.hexdigest()[:12]}.npz"


def load_or_train(
    cfg: Config = Config(), cache_dir: str | os.PathLike[str] | None = None
) -> AttnOnly:
    """The trained model of ``cfg``: its cached weights (``.npz`` under ``cache_dir``, default
    ``$HOOKAX_CACHE`` or ``~/.cache/hookax``), or trained now and cached."""
    path = _cache_path(cfg, cache_dir)
    model = AttnOnly(cfg, rngs=nnx.Rngs(cfg.seed))
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    names = ["/".join(map(str, k)) for k, _ in flat]
    if path.exists():
        with np.load(path) as saved:
            leaves = [jnp.asarray(saved[n]) for n in names]
        return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), leaves))
    trained, _ = train(cfg)
    _, state = nnx.split(trained)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    arrays: dict[str, Any] = dict(zip(names, map(np.asarray, jax.tree.leaves(state))))
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return trained


def patterns(model: AttnOnly, tokens: jax.Array) -> jax.Array:
    """Every head's attention pattern, ``(layer, batch, head, query, key)``, by
    ``hx.transformer_names``' ``pattern``."""
    nm = transformer_names("blocks/*", attention="nnx", mlp="", final_norm=None)
    _, cache = nm.capture(model, "pattern")(tokens)
    return cache["pattern"][:, 0]  # one group of heads


def induction_scores(pattern: jax.Array) -> jax.Array:
    """TransformerLens' induction score of each head, ``(layer, head)``: the mean attention
    from each token of the repeated half (query ``i >= half``) to the token after its earlier
    copy (key ``i - half + 1``). ``pattern``: ``(layer, batch, head, query, key)`` over
    sequences whose second half repeats the first."""
    half = pattern.shape[-1] // 2
    q = jnp.arange(half, 2 * half)
    return pattern[..., q, q - half + 1].mean(axis=(-1, 1))


def prev_token_scores(pattern: jax.Array) -> jax.Array:
    """Each head's mean attention from every token but the first to the token before it,
    ``(layer, head)``, from ``pattern`` ``(layer, batch, head, query, key)``."""
    q = jnp.arange(1, pattern.shape[-1])
    return pattern[..., q, q - 1].mean(axis=(-1, 1))


def corrupted(key: jax.Array, tokens: jax.Array, vocab: int) -> jax.Array:
    """``tokens`` with their first half replaced by fresh random tokens: the second half, the
    same as before, repeats nothing. The queries of the second half read what they read in the
    clean run; what changes is what the earlier positions hold (their keys)."""
    half = tokens.shape[1] // 2
    fresh = jax.random.randint(key, (tokens.shape[0], half), 0, vocab, dtype=tokens.dtype)
    return tokens.at[:, :half].set(fresh)


def in_context_logprob(tokens: jax.Array) -> Any:
    """The metric of ``tokens`` (first half repeated): the logits -> the mean log-probability
    of each token of the repeated half but the first (the ones an induction head predicts)."""
    half = tokens.shape[1] // 2

    def metric(logits: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(logits[:, half:-1].astype(jnp.float32))
        return jnp.take_along_axis(logp, tokens[:, half + 1 :, None], axis=-1).mean()

    return metric


def main() -> None:
    cfg = Config()
    start = time.perf_counter()
    model = load_or_train(cfg)
    tokens = repeated_tokens(jax.random.key(123), 32, cfg.half, cfg.vocab)
    pat = patterns(model, tokens)
    loss = loss_fn(model, tokens, jnp.full((tokens.shape[0],), cfg.half))
    print(f"model ready in {time.perf_counter() - start:.1f} s; loss {loss:.4f}")
    np.set_printoptions(precision=3, suppress=True)
    print("induction scores (layer x head):\n", np.asarray(induction_scores(pat)))
    print("previous-token scores (layer x head):\n", np.asarray(prev_token_scores(pat)))
    from .._circuits.attribute import edge_attribution
    from .._circuits.circuit import faithfulness
    from .._circuits.paths import path_patch

    corrupt = corrupted(jax.random.key(7), tokens, cfg.vocab)
    metric = in_context_logprob(tokens)
    print(f"metric: clean {metric(model(tokens)):.4f}, corrupted {metric(model(corrupt)):.4f}")
    layer1 = [f"L1H{h}.{k}" for h in range(cfg.n_heads) for k in "qkv"]
    grid = path_patch(
        model,
        (tokens,),
        (corrupt,),
        metric,
        components(),
        senders=[f"L0H{h}" for h in range(cfg.n_heads)],
        receivers=layer1,
    )
    print("path patching from layer 0 into layer 1's q, k, v (metric - clean):")
    print("      " + " ".join(f"{r:>7}" for r in layer1[:6]))
    for h, row in enumerate(np.asarray(grid - metric(model(tokens)))):
        print(f"L0H{h}  " + " ".join(f"{v:+7.3f}" for v in row[:6]))
    print("      " + " ".join(f"{r:>7}" for r in layer1[6:]))
    for h, row in enumerate(np.asarray(grid - metric(model(tokens)))):
        print(f"L0H{h}  " + " ".join(f"{v:+7.3f}" for v in row[6:]))
    for steps in (1, 10):
        edges = edge_attribution(model, (tokens,), (corrupt,), metric, components(), steps=steps)
        print(f"EAP, steps={steps}: the top 10 edges" + (" (EAP-IG)" if steps > 1 else ""))
        print(edges.top(10))
        for k in (6, 9, 12, 24):
            f = faithfulness(model, (tokens,), (corrupt,), metric, edges.top(k))
            print(f"faithfulness of the top {k} edges: {f:.3f}")


if __name__ == "__main__":
    main()
