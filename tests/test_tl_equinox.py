"""TransformerLens' names and sweeps on Equinox: ``hx.transformer_names(attention="equinox")``
(``eqx.nn.MultiheadAttention``) and ``hx.patch_head_every`` / ``hx.patch_block_every`` on a
model written Equinox's way (one example; ``jax.vmap`` over the batch), against the forward
written out by hand from the modules' weights."""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hookax as hx

L, H, D, T, V, B = 2, 4, 16, 5, 13, 2
DH = D // H
TOKENS = jnp.array([[1, 4, 7, 2, 9], [3, 3, 10, 0, 5]])
CORRUPT = TOKENS.at[:, 1].set(jnp.array([6, 8]))
ANSWER = jnp.array([2, 5])
KINDS = ("z", "q", "k", "v", "pattern")


class MLP(eqx.Module):
    """On the positions of one example ``(T, D)``, each through ``jax.vmap``."""

    fc_in: eqx.nn.Linear
    fc_out: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.fc_out)(jax.nn.gelu(jax.vmap(self.fc_in)(x)))


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: MLP

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((T, T), bool)))
        return x + self.mlp(jax.vmap(self.ln2)(x))


class GPT(eqx.Module):
    """One example of tokens ``(T,)`` -> logits ``(T, V)``; run as ``jax.vmap(model)``."""

    embed: eqx.nn.Embedding
    pos_embed: eqx.nn.Embedding
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos_embed)(jnp.arange(T))
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembed)(jax.vmap(self.ln_f)(x))


def _norm(key: Any) -> eqx.nn.LayerNorm:
    g, b = 1.0 + 0.2 * jax.random.normal(key, (2, D))
    return eqx.tree_at(lambda m: (m.weight, m.bias), eqx.nn.LayerNorm(D), (g, b))


def _biased(attn: eqx.nn.MultiheadAttention, key: Any) -> eqx.nn.MultiheadAttention:
    """The projections' biases drawn at random (Equinox starts them at zero)."""
    projs = lambda a: [a.query_proj, a.key_proj, a.value_proj, a.output_proj]  # noqa: E731
    keys = jax.random.split(key, 4)
    biases = [0.3 * jax.random.normal(k, p.bias.shape) for k, p in zip(keys, projs(attn))]
    return eqx.tree_at(lambda a: [p.bias for p in projs(a)], attn, biases)


def make_model(seed: int = 0) -> GPT:
    ks = iter(jax.random.split(jax.random.key(seed), 8 + 8 * L))
    blocks = []
    for _ in range(L):
        attn = eqx.nn.MultiheadAttention(
            H,
            D,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=next(ks),
        )
        mlp = MLP(eqx.nn.Linear(D, 4 * D, key=next(ks)), eqx.nn.Linear(4 * D, D, key=next(ks)))
        blocks.append(Block(_norm(next(ks)), _biased(attn, next(ks)), _norm(next(ks)), mlp))
    return GPT(
        eqx.nn.Embedding(V, D, key=next(ks)),
        eqx.nn.Embedding(T, D, key=next(ks)),
        blocks,
        _norm(next(ks)),
        eqx.nn.Linear(D, V, key=next(ks)),
    )


MODEL = make_model()
NM = hx.transformer_names("blocks/*", attention="equinox", pos_embed="pos_embed")


def forward(model: GPT) -> Any:
    return jax.vmap(model)


# --- the forward by hand --------------------------------------------------------------------


def _keep(name: str, layer: int, value: jax.Array) -> jax.Array:
    return value


def layer_norm(x: jax.Array, ln: eqx.nn.LayerNorm) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + ln.eps) * ln.weight + ln.bias


def linear(x: jax.Array, lin: eqx.nn.Linear) -> jax.Array:
    return x @ lin.weight.T + lin.bias


def hand(tokens: jax.Array, model: GPT = MODEL, edit: Any = _keep) -> dict[str, Any]:
    """The batched forward from the modules' weights, every named value per layer, in the
    layout a capture of ``jax.vmap(model)`` has (batch first, then one example's axes).
    ``edit(name, layer, value)`` rewrites each value as it is computed (a hand patch)."""
    out: dict[str, Any] = {
        "embed": model.embed.weight[tokens],
        "pos_embed": model.pos_embed.weight[jnp.arange(T)],
    }
    x = out["embed"] + out["pos_embed"]
    acc: dict[str, list[Any]] = {k: [] for k in ("resid_pre", "attn_out", "mlp_out", *KINDS)}
    causal = jnp.tril(jnp.ones((T, T), bool))
    for layer, blk in enumerate(model.blocks):
        x = edit("resid_pre", layer, x)
        acc["resid_pre"].append(x)
        h = layer_norm(x, blk.ln1)
        a = blk.attn
        q, k, v = (
            edit(n, layer, linear(h, proj).reshape(B, T, H, DH))
            for n, proj in [("q", a.query_proj), ("k", a.key_proj), ("v", a.value_proj)]
        )
        scores = jnp.einsum("bqhe,bkhe->bhqk", q / math.sqrt(DH), k)
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        pattern = edit("pattern", layer, jax.nn.softmax(scores, -1))
        z = edit("z", layer, jnp.einsum("bhqk,bkhe->bhqe", pattern, v))  # (b, head, pos, e)
        attn = edit(
            "attn_out", layer, linear(z.transpose(0, 2, 1, 3).reshape(B, T, D), a.output_proj)
        )
        x = x + attn
        mlp = linear(jax.nn.gelu(linear(layer_norm(x, blk.ln2), blk.mlp.fc_in)), blk.mlp.fc_out)
        mlp = edit("mlp_out", layer, mlp)
        x = x + mlp
        for n, val in [("attn_out", attn), ("mlp_out", mlp), ("q", q), ("k", k), ("v", v)]:
            acc[n].append(val)
        acc["pattern"].append(pattern)
        acc["z"].append(z)
    out |= {k: jnp.stack(v) for k, v in acc.items()}
    out["resid_post"] = jnp.concatenate([out["resid_pre"][1:], x[None]])
    out["ln_final"] = layer_norm(x, model.ln_f)
    out["logits"] = linear(out["ln_final"], model.unembed)
    return out


HAND = jax.jit(hand)(TOKENS)
CORRUPTED = jax.jit(hand)(CORRUPT)
CLEAN = HAND


def close(a: Any, b: Any, tol: float = 1e-5) -> float:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)
    return float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))


def test_the_hand_forward_is_the_model() -> None:
    close(eqx.filter_jit(lambda m, t: forward(m)(t))(MODEL, TOKENS), HAND["logits"])
    # the corrupted input changes the values patched below
    assert float(jnp.abs(CORRUPTED["logits"] - HAND["logits"]).max()) > 1e-2


# --- names ------------------------------------------------------------------------------------


def test_equinox_names_and_their_axes() -> None:
    assert NM.act("q", 1) == "blocks/1/attn:reshape"
    assert (NM.k, NM.v) == ("blocks/*/attn:reshape#1", "blocks/*/attn:reshape#2")
    assert NM.act("z", 0) == "blocks/0/attn:dot_general#1" and NM.z.kind == "op"
    assert NM.pattern == "blocks/*/attn:softmax" and NM.resid_pre.kind == "input"
    # one example's axes: what heads=/axis= of a patch inside jax.vmap(model) index
    assert (NM.axis("q", "head"), NM.axis("q", "pos"), NM.axis("z", "head")) == (1, 0, 0)
    assert (NM.axis("pattern", "head"), NM.axis("pattern", "query")) == (0, 1)
    assert NM.axis("resid_pre", "pos") == 0 and NM.axis("z", "pos") == 1
    # every address names an operation or call site of the model, one per layer
    listed = set(hx.ops(forward(MODEL), TOKENS).addresses)
    for kind in KINDS:
        assert {str(NM.act(kind, i)) for i in range(L)} <= listed, kind


def _capture(mode: str) -> tuple[Any, dict[str, Any]]:
    which = tuple(NM)
    if mode == "eager":
        return NM.capture(forward(MODEL), *which)(TOKENS)

    if mode == "filter_jit":

        @eqx.filter_jit
        def run(model: GPT, tokens: jax.Array) -> Any:
            return NM.capture(forward(model), *which)(tokens)

        return run(MODEL, TOKENS)
    # jax.jit: the model's arrays an argument, the rest (Dropout's flags) static, as Equinox has it
    params, static = eqx.partition(MODEL, eqx.is_array)

    @jax.jit
    def run_jax(params: Any, tokens: jax.Array) -> Any:
        return NM.capture(forward(eqx.combine(params, static)), *which)(tokens)

    return run_jax(params, TOKENS)


@pytest.mark.parametrize("mode", ["eager", "filter_jit", "jax.jit"])
def test_capture_by_name_equals_the_hand_forward(mode: str) -> None:
    logits, cache = _capture(mode)
    close(logits, HAND["logits"])
    assert set(cache) == set(NM)
    # the vmap over the batch comes first, then each layer's values as one example has them
    assert cache["z"].shape == (L, B, H, T, DH) and cache["q"].shape == (L, B, T, H, DH)
    assert cache["pattern"].shape == (L, B, H, T, T)
    for name in cache:
        want = HAND[name] if name != "pos_embed" else HAND["pos_embed"][None]
        close(cache[name], jnp.broadcast_to(want, cache[name].shape))
    # the names are told apart: q is not k, layer 1 is not layer 0
    assert float(jnp.abs(cache["q"] - cache["k"]).max()) > 1e-2
    assert float(jnp.abs(cache["z"][1] - cache["z"][0]).max()) > 1e-2


# --- sweeps -----------------------------------------------------------------------------------


def metric(logits: jax.Array) -> jax.Array:
    return logits[:, -1][jnp.arange(B), ANSWER].sum()


EDITABLE = ("resid_pre", "attn_out", "mlp_out", *KINDS)


@jax.jit
def hand_patched(kind: jax.Array, layer: jax.Array, pos: jax.Array, head: jax.Array) -> Any:
    """The metric of the corrupted forward by hand with one value patched from the clean run:
    ``EDITABLE[kind]`` at layer ``layer``, at the positions of the mask ``pos`` (the query
    positions of the pattern), of head ``head`` (-1: a value without heads). Vmapped over the
    patches: one program for every patch of a grid."""

    def one(kind: Any, layer: Any, pos: Any, head: Any) -> jax.Array:
        def edit(n: str, i: int, v: jax.Array) -> jax.Array:
            on = (kind == EDITABLE.index(n)) & (layer == i)
            if n in ("z", "pattern"):  # (batch, head, pos, ...)
                m = (jnp.arange(H) == head)[:, None] & pos[None]
            elif n in ("q", "k", "v"):  # (batch, pos, head, d_head)
                m = pos[:, None] & (jnp.arange(H) == head)[None]
            else:  # (batch, pos, d_model)
                m = pos
            m = m.reshape(1, *m.shape, *(1,) * (v.ndim - 1 - m.ndim))
            return jnp.where(on & m, CLEAN[n][i], v)

        return metric(hand(CORRUPT, edit=edit)["logits"])

    return jax.vmap(one)(kind, layer, pos, head)


def by_hand(kinds: tuple[str, ...], positions: Any, heads: bool) -> np.ndarray:
    """The grid by hand, ``[kind, layer, pos, head]`` (``positions=None``: no pos axis;
    ``heads=False``: no head axis)."""
    masks = jnp.eye(T, dtype=bool) if positions == "each" else jnp.ones((1, T), bool)
    hs = jnp.arange(H) if heads else jnp.array([-1])
    grid = jnp.stack(
        jnp.meshgrid(
            jnp.array([EDITABLE.index(k) for k in kinds]),
            jnp.arange(L),
            jnp.arange(len(masks)),
            hs,
            indexing="ij",
        ),
        -1,
    ).reshape(-1, 4)
    got = hand_patched(grid[:, 0], grid[:, 1], masks[grid[:, 2]], grid[:, 3])
    got = np.asarray(got).reshape(len(kinds), L, len(masks), len(hs))
    if positions != "each":
        got = got[:, :, 0]
    return got if heads else got[..., 0]


def _check_head_every(which: tuple[str, ...], positions: Any) -> float:
    got = hx.patch_head_every(
        forward(MODEL), (TOKENS,), (CORRUPT,), metric, NM, which=which, positions=positions
    )
    want = by_hand(which, positions, heads=True)
    assert got.shape == want.shape
    # patching changes the metric somewhere in every kind (the grid is not the corrupted run)
    corrupt = float(metric(CORRUPTED["logits"]))
    moved = np.abs(want - corrupt).reshape(len(which), -1).max(1)
    assert (moved > 1e-3).all(), moved
    return close(got, want)


def test_patch_head_every_z_equals_the_hand_patched_forward() -> None:
    """Each head's ``z`` whole, at each layer (TransformerLens' ``[kind, layer, head]``): the
    fast variant of the test below."""
    _check_head_every(("z",), None)


@pytest.mark.parametrize("positions", ["each", None])
def test_patch_head_every_equals_the_hand_patched_forward(positions: Any) -> None:
    """``z``, ``q``, ``k``, ``v`` and the pattern, by position and whole heads."""
    _check_head_every(KINDS, positions)


def test_patch_block_every_on_one_example_axes() -> None:
    """``jax.vmap(model)``: the patches index one example's values, ``axis=`` given by name."""
    components = hx.Components(attn="blocks/*/attn", mlp="blocks/*/mlp", blocks="blocks/*")
    got = hx.patch_block_every(
        forward(MODEL),
        (TOKENS,),
        (CORRUPT,),
        metric,
        components,
        axis=NM.axis("resid_pre", "pos"),
    )
    want = by_hand(("resid_pre", "attn_out", "mlp_out"), "each", heads=False)
    assert got.shape == (3, L, T)
    close(got, want)
