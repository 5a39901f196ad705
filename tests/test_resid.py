"""Residual-stream views (``hx.Components``, ``hx.ResidualStream``), names (``hx.names``,
``hx.transformer_names``) and the TransformerLens-layout sweeps, against the GPT's forward by
hand (``tests/gpt_models.py``) on NNX (``nn.Linear`` attention and ``nnx.MultiHeadAttention``),
Linen, Equinox and a scanned NNX stack."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hookax as hx

from . import gpt_models as g

HAND = g.hand(g.TOKENS)
W_O = g.WEIGHTS["W_O"].reshape(g.L, g.H, g.DH, g.D)
ANSWER = jnp.array([2, 5])


def close(a: Any, b: Any, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def components(m: g.GPT) -> hx.Components:
    b = m.blocks
    return hx.Components(
        attn=f"{b}/attn",
        mlp=f"{b}/mlp",
        blocks=b,
        embed=("embed", "pos_embed"),
        final_norm="ln_f",
        unembed="unembed",
        heads=f"{b}/attn/out",
        n_heads=g.H,
    )


def captured(m: g.GPT, c: hx.Components, tokens: jax.Array = g.TOKENS) -> tuple[Any, Any]:
    """``c.capture`` of the model, jitted with the model (Linen: its variables) an argument."""

    @jax.jit
    def run(state: Any, tokens: jax.Array) -> tuple[Any, Any]:
        fn, pre = (m.fn, (state,)) if m.name == "linen" else (state, ())
        return c.capture(fn)(*pre, tokens)

    return run(m.weights, tokens)


@pytest.fixture(scope="module", params=g.FRAMEWORKS)
def gpt(request: Any) -> tuple[g.GPT, hx.ResidualStream]:
    m = g.make(request.param)
    c = components(m)
    logits, acts = captured(m, c)
    close(logits, HAND["logits"])  # the model is the hand forward
    return m, hx.ResidualStream(acts, c, m.weights)


def test_accumulated_resid(gpt: Any) -> None:
    _, rs = gpt
    acc = rs.accumulated_resid()
    assert acc.labels == ("0_pre", "1_pre", "final_post")
    close(acc.values, jnp.concatenate([HAND["resid_pre"], HAND["resid_final"][None]]))
    mid = rs.accumulated_resid(1, incl_mid=True, pos=-1)
    assert mid.labels == ("0_pre", "0_mid", "1_pre")
    close(mid["0_mid"], HAND["resid_mid"][0][:, -1])
    assert rs.accumulated_resid(0).labels == ("0_pre",)


def test_accumulated_resid_apply_ln_recomputes_the_final_norm_per_entry(gpt: Any) -> None:
    """``apply_ln=True`` is the logit lens: the final norm applied to each entry with its own
    statistics (TransformerLens 3.9); ``frozen_ln=True`` the forward's scale, frozen."""
    m, rs = gpt
    gamma, beta = g.WEIGHTS["ln_f"]
    acc = jnp.concatenate([HAND["resid_pre"], HAND["resid_final"][None]])
    if m.name == "linen":  # Linen's variables hold no epsilon
        with pytest.raises(hx.HookaxError, match=r"holds no epsilon .* Components\(norm_eps="):
            rs.accumulated_resid(apply_ln=True)
        rs = hx.ResidualStream(
            rs.acts, dataclasses.replace(rs.components, norm_eps=g.EPS), m.weights
        )
    lens = rs.accumulated_resid(apply_ln=True)
    assert lens.labels == ("0_pre", "1_pre", "final_post")
    close(lens.values, g.layer_norm(acc, gamma, beta))
    close(lens["final_post"] @ g.WEIGHTS["W_U"] + g.WEIGHTS["b_U"], HAND["logits"])
    part = rs.accumulated_resid(1, incl_mid=True, apply_ln=True, pos=-1)
    assert part.labels == ("0_pre", "0_mid", "1_pre")
    close(part["0_mid"], g.layer_norm(HAND["resid_mid"][0][:, -1], gamma, beta))
    frozen = rs.accumulated_resid(frozen_ln=True)
    centred = acc - acc.mean(-1, keepdims=True)
    close(frozen.values, centred / HAND["scale"] * gamma)
    close(frozen.values, rs.apply_ln_to_stack(rs.accumulated_resid()).values)
    with pytest.raises(hx.HookaxError, match="give one of them"):
        rs.accumulated_resid(apply_ln=True, frozen_ln=True)


def test_decompose_resid_adds_up_to_the_stream(gpt: Any) -> None:
    _, rs = gpt
    dec = rs.decompose_resid()
    assert dec.labels == (
        "embed",
        "pos_embed",
        "0_attn_out",
        "0_mlp_out",
        "1_attn_out",
        "1_mlp_out",
    )
    close(dec["1_attn_out"], HAND["attn_out"][1])
    close(dec["pos_embed"], jnp.broadcast_to(HAND["pos_embed"], dec["embed"].shape))
    close(dec.sum(), HAND["resid_final"])
    one = rs.decompose_resid(1, mode="attn", incl_embeds=False)
    assert one.labels == ("0_attn_out",)
    close(rs.decompose_resid(1).sum(), HAND["resid_pre"][1])


def test_head_results_split_the_output_projection_by_heads(gpt: Any) -> None:
    _, rs = gpt
    want = jnp.einsum("lbqhe,lhed->lhbqd", HAND["z"], W_O)
    close(rs.head_results(), want)
    stack = rs.stack_head_results(incl_remainder=True, pos=-1)
    assert stack.labels == ("L0H0", "L0H1", "L1H0", "L1H1", "remainder")
    close(stack["L1H0"], want[1, 0][:, -1])
    close(stack.sum(), HAND["resid_final"][:, -1])


def test_full_decomposition_adds_up_and_its_bias_is_the_projections(gpt: Any) -> None:
    _, rs = gpt
    full = rs.full_resid_decomposition()
    assert full.labels[-3:] == ("embed", "pos_embed", "bias")
    assert full.labels[:5] == ("L0H0", "L0H1", "L1H0", "L1H1", "0_mlp_out")
    close(full.sum(), HAND["resid_final"])
    close(full["bias"], jnp.broadcast_to(g.WEIGHTS["b_O"].sum(0), full["bias"].shape))
    close(rs.full_resid_decomposition(1).sum(), HAND["resid_pre"][1])


def test_final_norm_with_its_scale_frozen_and_direct_logit_attribution(gpt: Any) -> None:
    _, rs = gpt
    gamma, beta = g.WEIGHTS["ln_f"]
    close(rs.norm_scale(), HAND["scale"], 1e-6)
    dec = rs.decompose_resid(pos=-1)
    normed = rs.apply_ln_to_stack(dec, pos=-1)
    x = dec.values
    want = (x - x.mean(-1, keepdims=True)) / HAND["scale"][:, -1] * gamma
    close(normed.values, want)
    close(rs.apply_ln_to_stack(dec.values, pos=-1, weight=False), want / gamma)
    # the attributions add up to the logits, less the norm's bias and the unembedding's
    dla = rs.logit_attrs(dec, ANSWER, pos=-1)
    assert dla.shape == (len(dec), g.B)
    logits = HAND["logits"][:, -1][jnp.arange(g.B), ANSWER]
    constant = (beta @ g.WEIGHTS["W_U"] + g.WEIGHTS["b_U"])[ANSWER]
    close(dla.sum(0) + constant, logits)
    diff = rs.logit_attrs(dec, ANSWER, jnp.array([0, 0]), pos=-1)
    close(diff, dla - rs.logit_attrs(dec, jnp.array([0, 0]), pos=-1))
    close(rs.unembed_directions(ANSWER), g.WEIGHTS["W_U"][:, ANSWER].T)


def test_views_under_jit_return_labelled_stacks(gpt: Any, traces: Any) -> None:
    m, _ = gpt
    if m.name not in ("linen", "scanned"):
        pytest.skip("a compile per framework: Linen's variables and the scanned stack suffice")
    c = components(m)

    @jax.jit
    def dla(state: Any, tokens: jax.Array) -> tuple[hx.Stack, Any]:
        traces()  # the model (Linen: its variables) is an argument: its arrays are traced
        fn, pre = (m.fn, (state,)) if m.name == "linen" else (state, ())
        _, acts = c.capture(fn)(*pre, tokens)
        rs = hx.ResidualStream(acts, c, state)
        full = rs.full_resid_decomposition(pos=-1)
        return full, rs.logit_attrs(full, ANSWER, pos=-1)

    full, attrs = dla(m.weights, g.TOKENS)
    dla(m.weights, g.CORRUPT)
    assert traces.n == 1
    assert isinstance(full, hx.Stack) and full.labels[-1] == "bias"
    logits = HAND["logits"][:, -1][jnp.arange(g.B), ANSWER]
    beta = g.WEIGHTS["ln_f"][1]
    close(attrs.sum(0) + (beta @ g.WEIGHTS["W_U"] + g.WEIGHTS["b_U"])[ANSWER], logits)


def test_missing_parts_say_which(gpt: Any) -> None:
    m, rs = gpt
    if m.name != "nnx":
        pytest.skip("the messages do not depend on the framework")
    c = hx.Components(attn="blocks/*/attn", mlp="blocks/*/mlp", blocks="blocks/*")
    bare = hx.ResidualStream(rs.acts, c, m.weights)
    with pytest.raises(hx.HookaxError, match=r"Components\(heads="):
        bare.head_results()
    with pytest.raises(hx.HookaxError, match="final_norm"):
        bare.norm_scale()
    with pytest.raises(hx.HookaxError, match="unembed"):
        bare.unembed_directions(ANSWER)
    with pytest.raises(hx.HookaxError, match="mode= takes"):
        bare.decompose_resid(mode="heads")
    with pytest.raises(hx.HookaxError, match=r"layer=5 is outside 0\.\.2"):
        bare.accumulated_resid(5)
    with pytest.raises(hx.HookaxError, match="no module at 'blocks/0/attn/out'"):
        hx.ResidualStream(rs.acts, components(m), m.weights.blocks).head_results()
    with pytest.raises(hx.HookaxError, match="not a linear layer"):
        hx.ResidualStream(
            rs.acts, hx.Components(attn="blocks/*/attn", embed="embed", unembed="ln_f"), m.weights
        ).unembed_directions(ANSWER)
    with pytest.raises(hx.HookaxError, match="'unembed:in' was not captured"):
        hx.ResidualStream(
            rs.acts, hx.Components(attn="blocks/*/attn", blocks="blocks/*", final_norm="unembed"), m
        )
    odd = hx.Components(attn="blocks/*/attn", embed="embed", final_norm="blocks/0")
    with pytest.raises(hx.HookaxError, match="not a norm"):
        hx.ResidualStream(rs.acts, odd, m.weights).norm_scale()
    with pytest.raises(hx.HookaxError, match="needs its start"):
        hx.ResidualStream(rs.acts, hx.Components(attn="blocks/*/attn"), m.weights)


def test_without_blocks_the_stream_is_the_embeddings_plus_the_outputs(gpt: Any) -> None:
    m, rs = gpt
    c = hx.Components(attn=f"{m.blocks}/attn", mlp=f"{m.blocks}/mlp", embed=("embed", "pos_embed"))
    acc = hx.ResidualStream(rs.acts, c, m.weights).accumulated_resid()
    close(acc.values, jnp.concatenate([HAND["resid_pre"], HAND["resid_final"][None]]))


# --- names --------------------------------------------------------------------------------------


def test_names_are_addresses_with_axes() -> None:
    nm = hx.names(
        {"attn_out": "blocks/*/attn", "z": ("blocks/*/attn/out:in", "batch pos head d_head")},
        pattern=hx.Name("blocks/*/attn:softmax", axes=("g", "batch", "head", "query", "key")),
    )
    assert nm.attn_out == "blocks/*/attn" and nm["z"].kind == "input"
    assert (nm.pattern.kind, nm.pattern.name, nm.axis("pattern", "query")) == ("op", "pattern", 3)
    assert nm.act("z", 1) == "blocks/1/attn/out:in" and nm.act("z", 1).axes == nm.z.axes
    assert hx.Name("blocks_*/attn").layer(0) == "blocks_0/attn"
    assert hx.Name("blocks/attn:softmax").layer(2) == "blocks/attn[2]:softmax"
    assert pickle.loads(pickle.dumps(nm.z)).axes == ("batch", "pos", "head", "d_head")
    assert "pattern" in repr(nm) and len(nm | {"x": "y"}) == 4
    with pytest.raises(hx.HookaxError, match="has axes"):
        nm.axis("attn_out", "head")
    with pytest.raises(hx.HookaxError, match="an entry is an address"):
        hx.names(bad=3)
    with pytest.raises(AttributeError, match="no name 'nope'"):
        _ = nm.nope


@pytest.mark.parametrize("name", ["mha", "scanned"])
def test_transformer_names_key_a_capture_like_run_with_cache(name: str) -> None:
    m = g.make(name)
    nm = hx.transformer_names(m.blocks, attention="nnx")

    @jax.jit
    def run(model: Any, tokens: jax.Array) -> Any:
        _, cache = nm.capture(model, "resid_pre", "pattern", "z", "q", "attn_out")(tokens)
        # the names go to any where=/ops= as they are
        _, acts = hx.capture(model, where=nm.attn_out, ops=nm.act("pattern", 1))(tokens)
        return cache, acts

    cache, acts = run(m.fn, g.TOKENS)
    close(cache["resid_pre"], HAND["resid_pre"])
    close(cache["attn_out"], HAND["attn_out"])
    close(cache["z"], HAND["z"])
    close(cache["q"], HAND["q"])
    close(cache["pattern"][:, 0], HAND["pattern"])  # (layer, group, batch, head, query, key)
    layer1 = "blocks/1/attn:softmax" if name == "mha" else "blocks/attn[1]:softmax"
    close(acts[layer1][0][0], HAND["pattern"][1])
    assert len([k for k in acts if k.endswith("attn")]) == (2 if name == "mha" else 1)


def test_transformer_names_layouts() -> None:
    linen = hx.transformer_names("blocks_*", attention="linen", pos_embed="pos_embed")
    assert linen.axis("pattern", "head") == 1 and linen.pos_embed.axes == ("pos", "d_model")
    own = hx.transformer_names(attention=None, mlp="") | {"pattern": "blocks/*/attn:softmax"}
    assert "q" not in own and "mlp_out" not in own and own.pattern.kind == "op"
    with pytest.raises(hx.HookaxError, match="attention= takes"):
        hx.transformer_names(attention="torch")


# --- sweeps -------------------------------------------------------------------------------------


def metric(logits: jax.Array) -> jax.Array:
    return logits[:, -1][jnp.arange(g.B), ANSWER].sum()


CLEAN = g.hand(g.TOKENS)


@functools.partial(jax.jit, static_argnums=(0, 1))
def patched_metric(name: str, layer: int, pos: jax.Array, head: jax.Array | None = None) -> Any:
    """The metric of the corrupted forward by hand with one value patched from the clean run
    at each of ``pos`` (and ``head``)."""

    def one(pos: jax.Array, head: jax.Array | None) -> jax.Array:
        def edit(n: str, i: int, v: jax.Array) -> jax.Array:
            if n != name or i != layer:
                return v
            c = CLEAN[name][layer]
            if head is None:
                return v.at[:, pos].set(c[:, pos])
            if name == "pattern":
                return v.at[:, head, pos].set(c[:, head, pos])
            return v.at[:, pos, head].set(c[:, pos, head])

        return metric(g.hand(g.CORRUPT, edit=edit)["logits"])

    return jax.vmap(one)(pos, head)


POS = jnp.arange(g.T)


def block_every_by_hand() -> np.ndarray:
    kinds = ["resid_pre", "attn_out", "mlp_out"]
    return np.array([[patched_metric(k, i, POS) for i in range(g.L)] for k in kinds])


@pytest.mark.slow
@pytest.mark.parametrize("name", g.FRAMEWORKS)
def test_patch_block_every_equals_the_hand_patched_model(name: str) -> None:
    m = g.make(name)
    c = components(m)
    got = hx.patch_block_every(m.fn, m.args(g.TOKENS), m.args(g.CORRUPT), metric, c)
    assert got.shape == (3, g.L, g.T)
    close(got, block_every_by_hand())


def test_patch_block_every_whole_values_restore_the_clean_run() -> None:
    """Patching a whole ``resid_pre`` is the clean run (block 0's input, through a pre-hook,
    and the others); an attention or MLP output alone is not."""
    m = g.make("nnx")
    got = hx.patch_block_every(
        m.fn, m.args(g.TOKENS), m.args(g.CORRUPT), metric, components(m), positions=None
    )
    assert got.shape == (3, g.L)
    close(got[0], jnp.full(g.L, metric(HAND["logits"])))
    assert bool((jnp.abs(got[1:] - metric(HAND["logits"])) > 1e-3).all())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mha", "scanned"])
def test_patch_head_every_equals_the_hand_patched_model(name: str) -> None:
    m = g.make(name)
    nm = hx.transformer_names(m.blocks, attention="nnx")
    kinds = ("z", "q", "k", "v", "pattern")
    got = hx.patch_head_every(m.fn, m.args(g.TOKENS), m.args(g.CORRUPT), metric, nm)
    pos, head = jnp.repeat(POS, g.H), jnp.tile(jnp.arange(g.H), g.T)
    want = [[patched_metric(k, i, pos, head).reshape(g.T, g.H) for i in range(g.L)] for k in kinds]
    assert got.shape == (5, g.L, g.T, g.H)  # TransformerLens' [kind, layer, pos, head]
    close(got, np.array(want))
    whole = hx.patch_head_every(
        m.fn, m.args(g.TOKENS), m.args(g.CORRUPT), metric, nm, which=("pattern",), positions=None
    )
    assert whole.shape == (1, g.L, g.H)


@pytest.mark.slow
def test_patch_head_every_pattern_on_attention_of_your_own() -> None:
    """The pattern of the Linen model's own attention (an operation), whole heads."""
    m = g.make("linen")
    nm = hx.names(pattern=("blocks_*/attn:softmax", "batch head query key"))
    got = hx.patch_head_every(
        m.fn, m.args(g.TOKENS), m.args(g.CORRUPT), metric, nm, which=("pattern",), positions=None
    )

    def whole(layer: int, head: int) -> float:
        def edit(n: str, i: int, v: jax.Array) -> jax.Array:
            if n == "pattern" and i == layer:
                return v.at[:, head].set(CLEAN["pattern"][layer][:, head])
            return v

        return float(metric(g.hand(g.CORRUPT, edit=edit)["logits"]))

    close(got[0], np.array([[whole(i, h) for h in range(g.H)] for i in range(g.L)]))
