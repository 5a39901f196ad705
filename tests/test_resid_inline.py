"""A positional embedding added inline (a parameter indexed in the model's own code, no module
call): ``hx.ResidualStream``'s decompositions carry it as ``"embed_rest"`` and add up to the
stream, on NNX, Linen and Equinox, eagerly and under ``jax.jit``, against the GPT's forward by
hand (``tests/gpt_models.py``, whose weights these models share)."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

from . import gpt_models as g

HAND = g.hand(g.TOKENS)
W_POS = jnp.broadcast_to(g.WEIGHTS["W_pos"], HAND["resid_final"].shape)
ANSWER = jnp.array([2, 5])
DECOMPOSED = ("embed", "embed_rest", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out")


def close(a: Any, b: Any, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


class NInline(g.NGPT):
    def __init__(self) -> None:
        super().__init__()
        del self.pos_embed
        self.pos = nnx.Param(g.WEIGHTS["W_pos"])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


class LInline(g.LGPT):
    def setup(self) -> None:
        self.embed = nn.Embed(g.V, g.D)
        self.pos = self.param("pos", nn.initializers.zeros, (g.T, g.D))
        self.blocks = [g.LBlock() for _ in range(g.L)]
        self.ln_f, self.unembed = nn.LayerNorm(epsilon=g.EPS), nn.Dense(g.V)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


class EInline(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: list[g.EBlock]
    ln_f: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = g.per_token(self.embed, tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return g.per_token(self.unembed, g.per_token(self.ln_f, x))


def make(name: str) -> g.GPT:
    if name == "nnx":
        m = NInline()
        return g.GPT(name, m, (), m, "blocks/*")
    if name == "linen":
        variables = g.linen_variables()
        params = dict(variables["params"])
        del params["pos_embed"]
        variables = {"params": params | {"pos": g.WEIGHTS["W_pos"]}}
        return g.GPT(name, LInline().apply, (variables,), variables, "blocks_*")
    e = g.EGPT()
    m = EInline(e.embed, g.WEIGHTS["W_pos"], e.blocks, e.ln_f, e.unembed)
    return g.GPT(name, m, (), m, "blocks/*")


def components(m: g.GPT, **kw: Any) -> hx.Components:
    b = m.blocks
    return hx.Components(
        attn=f"{b}/attn",
        mlp=f"{b}/mlp",
        blocks=b,
        embed="embed",
        final_norm="ln_f",
        unembed="unembed",
        heads=f"{b}/attn/out",
        n_heads=g.H,
        **kw,
    )


def views(m: g.GPT, c: hx.Components, state: Any, tokens: jax.Array) -> tuple[Any, ...]:
    fn, pre = (m.fn, (state,)) if m.name == "linen" else (state, ())
    logits, acts = c.capture(fn)(*pre, tokens)
    rs = hx.ResidualStream(acts, c, state)
    full = rs.full_resid_decomposition()
    dla = rs.logit_attrs(rs.full_resid_decomposition(pos=-1), ANSWER, pos=-1)
    return logits, rs.decompose_resid(), rs.decompose_resid(1), full, dla


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ["nnx", "linen", "equinox"])
def test_an_inline_positional_embedding_is_embed_rest_and_the_views_add_up(
    name: str, jit: bool
) -> None:
    m = make(name)
    c = components(m)

    def run(state: Any, tokens: jax.Array) -> tuple[Any, ...]:
        return views(m, c, state, tokens)

    logits, dec, dec1, full, dla = (jax.jit(run) if jit else run)(m.weights, g.TOKENS)
    close(logits, HAND["logits"])  # the model is the hand forward
    assert dec.labels == DECOMPOSED
    close(dec["embed_rest"], W_POS)
    close(dec["embed"], HAND["embed"])
    close(dec.sum(), HAND["resid_final"])
    assert dec1.labels == DECOMPOSED[:4]
    close(dec1.sum(), HAND["resid_pre"][1])
    assert full.labels[-3:] == ("embed", "embed_rest", "bias")
    close(full["embed_rest"], W_POS)
    close(full.sum(), HAND["resid_final"])
    # direct logit attribution of the full decomposition adds up to the logits
    beta = g.WEIGHTS["ln_f"][1]
    constant = (beta @ g.WEIGHTS["W_U"] + g.WEIGHTS["b_U"])[ANSWER]
    close(dla.sum(0) + constant, HAND["logits"][:, -1][jnp.arange(g.B), ANSWER])


def test_embed_rest_false_says_what_is_missing() -> None:
    m = make("nnx")
    c = components(m, embed_rest=False)
    _, acts = c.capture(m.fn)(g.TOKENS)
    with pytest.raises(
        hx.HookaxError, match=r"'embed' do not make up the input of 'blocks/\*'"
    ) as e:
        hx.ResidualStream(acts, c, m.weights)
    gap = float(jnp.abs(g.WEIGHTS["W_pos"]).max())
    assert f"differs from their sum by up to {gap:.3g}" in str(e.value)
    assert "Fix: name the missing embedding in Components(embed=...)" in str(e.value)


def test_module_embeddings_leave_no_rest_where_values_are_known() -> None:
    m = g.make("nnx")
    c = dataclasses.replace(components(m), embed=("embed", "pos_embed"))
    _, acts = c.capture(m.fn)(g.TOKENS)
    dec = hx.ResidualStream(acts, c, m.weights).decompose_resid()
    assert dec.labels[:3] == ("embed", "pos_embed", "0_attn_out")
    always = hx.ResidualStream(acts, dataclasses.replace(c, embed_rest=True), m.weights)
    dec = always.decompose_resid()
    assert dec.labels[:3] == ("embed", "pos_embed", "embed_rest")
    close(dec["embed_rest"], jnp.zeros_like(W_POS), 1e-6)


def test_under_jit_the_rest_is_always_there_unless_embed_rest_is_false() -> None:
    """Labels are made before values are known: a traced view carries the rest (zeros for a
    model whose embeddings are all named); ``embed_rest=False`` leaves it out."""
    m = g.make("nnx")
    c = dataclasses.replace(components(m), embed=("embed", "pos_embed"))

    @jax.jit
    def labelled(model: Any, tokens: jax.Array) -> tuple[hx.Stack, hx.Stack]:
        _, acts = c.capture(model)(tokens)
        bare = dataclasses.replace(c, embed_rest=False)
        return (
            hx.ResidualStream(acts, c, model).decompose_resid(),
            hx.ResidualStream(acts, bare, model).decompose_resid(),
        )

    dec, bare = labelled(m.fn, g.TOKENS)
    assert dec.labels[:3] == ("embed", "pos_embed", "embed_rest")
    close(dec["embed_rest"], jnp.zeros_like(W_POS), 1e-6)
    assert bare.labels[:3] == ("embed", "pos_embed", "0_attn_out")
    close(dec.sum(), HAND["resid_final"])
    close(bare.sum(), HAND["resid_final"])
