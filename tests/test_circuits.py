"""Circuits: edge attribution (EAP, EAP-IG), circuits and faithfulness, each against a hand-unrolled
forward of a two-layer attention-only transformer in which every head reads its own copy of the
stream for its query, key and value."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax.examples import induction

CFG = induction.Config(vocab=8, d_model=8, n_heads=2, half=3)
CLEAN = jnp.array([[1, 2, 3, 1, 2, 3], [4, 5, 6, 4, 5, 6]])
CORRUPT = jnp.array([[1, 2, 3, 7, 0, 1], [4, 5, 6, 2, 2, 0]])


def metric(logits):
    return logits[0, -1, 1] - logits[1, -1, 2] + 0.5 * logits[:, 3, 5].sum()


@pytest.fixture(scope="module")
def model():
    return induction.AttnOnly(CFG, rngs=nnx.Rngs(3))


def hand(model, tokens, extra=None, alpha=None, corrupt_embeds=None):
    """The model unrolled by hand; ``extra[receiver]`` is added to that receiver's own copy of
    the stream; returns the logits and every sender's value."""
    extra = extra or {}
    t = tokens.shape[1]
    senders = {
        "embed": model.embed.embedding[...][tokens],
        "pos_embed": model.pos_embed.embedding[...][:t],
    }
    if alpha is not None:
        senders = {
            k: corrupt_embeds[k] + alpha * (v - corrupt_embeds[k]) for k, v in senders.items()
        }
    x = senders["embed"] + senders["pos_embed"]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for layer, block in enumerate(model.blocks):
        a = block.attn
        out = a.out.bias[...]
        for h in range(CFG.n_heads):
            name = f"L{layer}H{h}"
            proj = {}
            for kind, lin in (("q", a.query), ("k", a.key), ("v", a.value)):
                xin = x + extra.get(f"{name}.{kind}", 0.0)
                proj[kind] = xin @ lin.kernel[...][:, h] + lin.bias[...][h]
            d_head = proj["q"].shape[-1]
            s = jnp.einsum("bqd,bkd->bqk", proj["q"] / jnp.sqrt(d_head), proj["k"])
            p = jax.nn.softmax(jnp.where(causal, s, jnp.finfo(s.dtype).min), axis=-1)
            result = jnp.einsum("bqk,bkd->bqd", p, proj["v"]) @ a.out.kernel[...][h]
            senders[name] = result
            out = out + result
        x = x + out
    x = x + extra.get("logits", 0.0)
    return x @ model.unembed.kernel[...] + model.unembed.bias[...], senders


RECEIVERS = [f"L{i}H{h}.{k}" for i in range(2) for k in "qkv" for h in range(2)] + ["logits"]


def upstream(receiver):
    embeds = ["embed", "pos_embed"]
    if receiver.startswith("L0"):
        return embeds
    layer0 = [f"L0H{h}" for h in range(2)]
    if receiver.startswith("L1"):
        return embeds + layer0
    return embeds + layer0 + [f"L1H{h}" for h in range(2)]


def hand_scores(model, alphas=(None,)):
    _, clean = hand(model, CLEAN)
    _, corrupt = hand(model, CORRUPT)
    zeros = {r: jnp.zeros((2, 6, 8)) for r in RECEIVERS}
    grads = []
    for a in alphas:
        f = lambda e: metric(hand(model, CLEAN, e, a, corrupt)[0])  # noqa: B023, E731
        grads.append(jax.grad(f)(zeros))
    g = {r: sum(gr[r] for gr in grads) / len(grads) for r in RECEIVERS}
    return {
        (s, r): float(jnp.sum((corrupt[s] - clean[s]) * g[r]))
        for r in RECEIVERS
        for s in upstream(r)
    }


def test_the_hand_forward_is_the_model(model):
    np.testing.assert_allclose(hand(model, CLEAN)[0], model(CLEAN), atol=1e-5)


def test_eap_scores_every_edge_as_the_hand_gradient(model):
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, induction.components())
    want = hand_scores(model)
    assert set(edges) == set(want) and len(edges) == len(want) == 42
    for edge, score in want.items():
        assert edges[edge] == pytest.approx(score, rel=1e-4, abs=1e-5), edge


def test_an_eap_score_is_the_directional_derivative(model):
    """The score of (s, r): d/de metric with e * (s_corrupt - s_clean) added to r's input,
    by central finite differences."""
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, induction.components())
    _, clean = hand(model, CLEAN)
    _, corrupt = hand(model, CORRUPT)
    for s, r in [
        ("L0H1", "L1H0.k"),
        ("embed", "L0H0.q"),
        ("L1H1", "logits"),
        ("pos_embed", "L1H1.v"),
    ]:
        d = corrupt[s] - clean[s]
        eps = 1e-2
        up = metric(hand(model, CLEAN, {r: eps * d})[0])
        down = metric(hand(model, CLEAN, {r: -eps * d})[0])
        assert edges[s, r] == pytest.approx(float(up - down) / (2 * eps), rel=2e-2, abs=1e-3)


def test_eap_into_the_logits_is_exact_for_a_metric_linear_in_them(model):
    """The logits are linear in the readout's input: the edge's score is the metric's change
    when that one edge is corrupted."""
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, induction.components())
    base = float(metric(model(CLEAN)))
    for s in ["embed", "L0H0", "L1H1"]:
        cut = [e for e in edges if e != (s, "logits")]
        y = hx.run_circuit(model, (CLEAN,), (CORRUPT,), cut, induction.components())
        assert edges[s, "logits"] == pytest.approx(float(metric(y)) - base, rel=1e-4, abs=1e-5)


def test_eap_ig_averages_the_gradient_along_the_embedding_path(model):
    edges = hx.edge_attribution(
        model, (CLEAN,), (CORRUPT,), metric, induction.components(), steps=3
    )
    want = hand_scores(model, alphas=(1 / 3, 2 / 3, 1.0))
    for edge, score in want.items():
        assert edges[edge] == pytest.approx(score, rel=1e-4, abs=1e-5), edge
    one = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, induction.components(), steps=1)
    assert not np.allclose(one.scores, edges.scores)


def test_every_edge_is_the_clean_run_and_none_the_corrupted(model):
    parts = induction.components()
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, parts)
    every = hx.run_circuit(model, (CLEAN,), (CORRUPT,), edges)
    np.testing.assert_array_equal(every, model(CLEAN))
    none = hx.run_circuit(model, (CLEAN,), (CORRUPT,), edges.top(0))
    np.testing.assert_allclose(none, model(CORRUPT), atol=1e-5)
    assert hx.faithfulness(model, (CLEAN,), (CORRUPT,), metric, edges) == 1.0
    assert hx.faithfulness(model, (CLEAN,), (CORRUPT,), metric, [], parts) == pytest.approx(
        0.0, abs=1e-5
    )


def hand_circuit(model, kept):
    """The circuit by hand: each receiver's copy of the stream, where the edge from a sender is
    cut, has the sender's corrupted value in place of its value in this run (two passes: the
    senders of a pass are those of the pass before, which converges in as many passes as
    layers)."""
    _, corrupt = hand(model, CORRUPT)
    _, here = hand(model, CLEAN)
    for _ in range(3):
        extra = {
            r: sum(corrupt[s] - here[s] for s in upstream(r) if (s, r) not in kept)
            for r in RECEIVERS
        }
        y, here = hand(model, CLEAN, extra)
    return y


def test_a_circuit_equals_the_hand_rewired_forward(model):
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, induction.components())
    rng = np.random.default_rng(0)
    for k in (5, 17):
        kept = [e for e in edges if rng.random() < k / len(edges)]
        y = hx.run_circuit(model, (CLEAN,), (CORRUPT,), kept, induction.components())
        np.testing.assert_allclose(y, hand_circuit(model, set(kept)), atol=1e-5)


def test_edges_top_above_and_the_table(model):
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, induction.components())
    top = edges.top(5)
    mags = np.abs(top.scores)
    assert len(top) == 5 and list(mags) == sorted(mags, reverse=True)
    assert mags[-1] >= np.sort(np.abs(edges.scores))[-5]
    cut = edges.above(float(mags[2]))
    assert list(cut) == list(top)[:3]
    text = str(top)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert f"{top.sources[0]}" in text and "5 edges" in text
    assert hx.show(top) is top and repr(top) == "<hx.Edges: 5 edges>"


def test_unknown_edges_and_missing_components_raise(model):
    with pytest.raises(hx.HookaxError, match=r"L1H0 -> L0H0.q is no edge"):
        hx.run_circuit(model, (CLEAN,), (CORRUPT,), [("L1H0", "L0H0.q")], induction.components())
    with pytest.raises(hx.HookaxError, match="give components="):
        hx.run_circuit(model, (CLEAN,), (CORRUPT,), [("embed", "logits")])
    with pytest.raises(hx.HookaxError, match="qkv="):
        hx.edge_attribution(
            model, (CLEAN,), (CORRUPT,), metric, hx.Components(attn="blocks/*/attn")
        )
    with pytest.raises(hx.HookaxError, match="steps= takes a positive int"):
        hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, induction.components(), steps=0)


def test_under_jit_the_scores_are_the_same(model):
    parts = induction.components()
    eager = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, parts)

    @jax.jit
    def run(model, clean, corrupt):
        return hx.run_circuit(model, (clean,), (corrupt,), list(eager.top(6)), parts)

    y = run(model, CLEAN, CORRUPT)
    np.testing.assert_allclose(
        y, hx.run_circuit(model, (CLEAN,), (CORRUPT,), eager.top(6)), atol=1e-6
    )


def test_path_patching_equals_the_hand_loop_over_pairs(model):
    parts = induction.components()
    senders = ["embed", "L0H0", "L0H1", "L1H1"]
    receivers = ["L1H0.k", "L1H1.q", ("L1H0.v", "L1H1.v"), "logits", "L0H1.k"]
    grid = hx.path_patch(
        model, (CLEAN,), (CORRUPT,), metric, parts, senders=senders, receivers=receivers
    )
    assert grid.shape == (4, 5) and grid.dtype == jnp.float32
    _, clean = hand(model, CLEAN)
    _, corrupt = hand(model, CORRUPT)
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, parts)
    for i, s in enumerate(senders):
        for j, group in enumerate(receivers):
            group = (group,) if isinstance(group, str) else group
            into = [r for r in group if s in upstream(r)]
            if not into:
                assert np.isnan(grid[i, j]), (s, group)
                continue
            # the receivers read the sender's corrupted value; the sender itself is clean here
            y, _ = hand(model, CLEAN, {r: corrupt[s] - clean[s] for r in into})
            assert grid[i, j] == pytest.approx(float(metric(y)), rel=1e-5, abs=1e-5), (s, group)
            cut = [e for e in edges if not (e[0] == s and e[1] in into)]
            y = hx.run_circuit(model, (CLEAN,), (CORRUPT,), cut, parts)
            assert grid[i, j] == pytest.approx(float(metric(y)), rel=1e-5, abs=1e-5)


def test_path_patching_from_the_corrupted_run_is_the_call_with_the_runs_swapped(model):
    """The other convention (noising the corrupted run's paths from the clean one): the
    corrupted run is the baseline, the receivers read the sender's clean value, every other
    path keeps its corrupted value."""
    parts = induction.components()
    senders, receivers = ["embed", "L0H1"], ["L1H0.k", ("L1H0.q", "L1H0.v"), "logits"]
    grid = hx.path_patch(
        model, (CORRUPT,), (CLEAN,), metric, parts, senders=senders, receivers=receivers
    )
    _, clean = hand(model, CLEAN)
    _, corrupt = hand(model, CORRUPT)
    for i, s in enumerate(senders):
        for j, group in enumerate(receivers):
            into = [r for r in ((group,) if isinstance(group, str) else group) if s in upstream(r)]
            y, _ = hand(model, CORRUPT, {r: clean[s] - corrupt[s] for r in into})
            assert grid[i, j] == pytest.approx(float(metric(y)), rel=1e-5, abs=1e-5), (s, group)
    assert grid.clean == pytest.approx(float(metric(hand(model, CORRUPT)[0])), rel=1e-6)
    assert np.abs(np.asarray(grid) - grid.clean).max() > 1e-3  # the paths carry an effect


def test_path_patch_names_what_it_does_not_know(model):
    with pytest.raises(hx.HookaxError, match=r"receivers= names \['L2H0.k'\]"):
        hx.path_patch(
            model,
            (CLEAN,),
            (CORRUPT,),
            metric,
            induction.components(),
            senders=["L0H0"],
            receivers=["L2H0.k"],
        )


class ConcatAttention(nnx.Module):
    """Attention of one's own: projections of concatenated heads (``nnx.Linear``)."""

    def __init__(self, d, heads, rngs):
        self.heads = heads
        self.query = nnx.Linear(d, d, rngs=rngs)
        self.key = nnx.Linear(d, d, rngs=rngs)
        self.value = nnx.Linear(d, d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // self.heads))
        causal = jnp.tril(jnp.ones((t, t), bool))
        p = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, d))


class MLPBlock(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.attn = ConcatAttention(d, heads, rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(d, 2 * d, rngs=rngs), jax.nn.gelu, nnx.Linear(2 * d, d, rngs=rngs)
        )

    def __call__(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class WithMLPs(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(8, 8, rngs=rngs)
        self.blocks = nnx.List([MLPBlock(8, 2, rngs) for _ in range(2)])
        self.unembed = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.unembed(x)


MLP_PARTS = hx.Components(
    attn="blocks/*/attn",
    mlp="blocks/*/mlp",
    embed="embed",
    unembed="unembed",
    heads="blocks/*/attn/out",
    qkv=("blocks/*/attn/query", "blocks/*/attn/key", "blocks/*/attn/value"),
    n_heads=2,
)


def hand_mlps(model, tokens, extra):
    """``WithMLPs`` unrolled by hand, each head's q/k/v and each MLP on its own input."""
    senders = {"embed": model.embed.embedding[...][tokens]}
    x = senders["embed"]
    t = tokens.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for layer, block in enumerate(model.blocks):
        a = block.attn
        out = a.out.bias[...]
        for h in range(2):
            cols = slice(4 * h, 4 * h + 4)
            proj = {}
            for kind, lin in (("q", a.query), ("k", a.key), ("v", a.value)):
                xin = x + extra.get(f"L{layer}H{h}.{kind}", 0.0)
                proj[kind] = xin @ lin.kernel[...][:, cols] + lin.bias[...][cols]
            s = jnp.einsum("bqd,bkd->bqk", proj["q"], proj["k"]) / jnp.sqrt(jnp.float32(4))
            p = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
            z = jnp.einsum("bqk,bkd->bqd", p, proj["v"])
            senders[f"L{layer}H{h}"] = z @ a.out.kernel[...][cols]
            out = out + senders[f"L{layer}H{h}"]
        x = x + out
        up, down = block.mlp.layers[0], block.mlp.layers[2]
        xin = x + extra.get(f"MLP{layer}", 0.0)
        y = jax.nn.gelu(xin @ up.kernel[...] + up.bias[...]) @ down.kernel[...] + down.bias[...]
        senders[f"MLP{layer}"] = y
        x = x + y
    x = x + extra.get("logits", 0.0)
    return x @ model.unembed.kernel[...] + model.unembed.bias[...], senders


def test_mlps_and_concatenated_heads_as_the_hand_forward():
    model = WithMLPs(nnx.Rngs(1))
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, MLP_PARTS)
    np.testing.assert_allclose(hand_mlps(model, CLEAN, {})[0], model(CLEAN), atol=1e-5)
    order = ["embed", "L0H0", "L0H1", "MLP0", "L1H0", "L1H1", "MLP1"]
    receivers = {
        f"L{i}H{h}.{k}": order[: 1 + 3 * i] for i in range(2) for h in range(2) for k in "qkv"
    }
    receivers |= {"MLP0": order[:3], "MLP1": order[:6], "logits": order}
    assert set(edges) == {(s, r) for r, ss in receivers.items() for s in ss}
    _, clean = hand_mlps(model, CLEAN, {})
    _, corrupt = hand_mlps(model, CORRUPT, {})
    zeros = {r: jnp.zeros((2, 6, 8)) for r in receivers}
    g = jax.grad(lambda e: metric(hand_mlps(model, CLEAN, e)[0]))(zeros)
    for r, ss in receivers.items():
        for s in ss:
            want = float(jnp.sum((corrupt[s] - clean[s]) * g[r]))
            assert edges[s, r] == pytest.approx(want, rel=1e-4, abs=1e-5), (s, r)
    # a circuit: the MLPs' inputs read the corrupted embedding, everything else clean
    kept = [e for e in edges if not (e[0] == "embed" and e[1].startswith("MLP"))]
    y = hx.run_circuit(model, (CLEAN,), (CORRUPT,), kept, MLP_PARTS)
    d = corrupt["embed"] - clean["embed"]
    want, _ = hand_mlps(model, CLEAN, {"MLP0": d, "MLP1": d})
    np.testing.assert_allclose(y, want, atol=1e-5)
    full = hx.run_circuit(model, (CLEAN,), (CORRUPT,), edges)
    np.testing.assert_allclose(full, model(CLEAN), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_on_linen_the_graph_circuits_and_exact_edges_into_the_logits(pre_norm):
    import functools

    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            h = nn.LayerNorm(name="ln1")(x) if pre_norm else x
            return x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(h, mask=mask)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(8, 8, name="embed")(tokens)
            for i in range(2):
                x = Block(name=f"blocks_{i}")(x)
            return nn.Dense(8, name="unembed")(x)

    module = Model()
    fn = functools.partial(module.apply, module.init(jax.random.key(0), CLEAN))
    parts = hx.Components(
        attn="blocks_*/attn",
        embed="embed",
        unembed="unembed",
        heads="blocks_*/attn/out",
        qkv=("blocks_*/attn/query", "blocks_*/attn/key", "blocks_*/attn/value"),
        norms=("blocks_*/ln1", None) if pre_norm else None,
        n_heads=2,
    )
    edges = hx.edge_attribution(fn, (CLEAN,), (CORRUPT,), metric, parts)
    assert len(edges) == 6 * 1 + 6 * 3 + 5  # layer 0, layer 1, the logits
    every = hx.run_circuit(fn, (CLEAN,), (CORRUPT,), edges)
    if pre_norm:  # the norm of the stream and of the copies in one vmap: up to rounding
        np.testing.assert_allclose(every, fn(CLEAN), atol=1e-5)
    else:
        np.testing.assert_array_equal(every, fn(CLEAN))
    none = hx.run_circuit(fn, (CLEAN,), (CORRUPT,), [], parts)
    np.testing.assert_allclose(none, fn(CORRUPT), atol=1e-5)
    for s in ("embed", "L0H1", "L1H0"):
        cut = [e for e in edges if e != (s, "logits")]
        y = hx.run_circuit(fn, (CLEAN,), (CORRUPT,), cut, parts)
        want = float(metric(y) - metric(fn(CLEAN)))
        assert edges[s, "logits"] == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_pruning_finds_the_fewest_top_edges_that_reach_the_target(model):
    parts = induction.components()
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, parts)
    ranked = edges.top(len(edges))
    every = [hx.faithfulness(model, (CLEAN,), (CORRUPT,), metric, ranked.top(k)) for k in range(43)]
    for target in (0.5, 0.9, 0.99):
        circuit, f = hx.prune_edges(model, (CLEAN,), (CORRUPT,), metric, edges, target=target)
        k = len(circuit)
        assert list(circuit) == list(ranked.top(k)) and f == pytest.approx(every[k], abs=1e-6)
        assert f >= target and (k == 0 or every[k - 1] < target)
        if all(x >= target for x in every[k:]):  # where it grows: the smallest k
            assert k == next(i for i, x in enumerate(every) if all(y >= target for y in every[i:]))
    circuit, f = hx.prune_edges(model, (CLEAN,), (CORRUPT,), metric, edges, target=2.0)
    assert len(circuit) == len(edges) and f == 1.0


class PreNormBlock(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(d, 2 * d, rngs=rngs), jax.nn.gelu, nnx.Linear(2 * d, d, rngs=rngs)
        )

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.mlp(self.ln2(x))


class PreNorm(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(8, 8, rngs=rngs)
        self.pos_embed = nnx.Embed(6, 8, rngs=rngs)
        self.blocks = nnx.List([PreNormBlock(8, 2, rngs) for _ in range(2)])
        self.ln_f = nnx.LayerNorm(8, rngs=rngs)
        self.unembed = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


PRENORM_PARTS = hx.Components(
    attn="blocks/*/attn",
    mlp="blocks/*/mlp",
    embed=("embed", "pos_embed"),
    final_norm="ln_f",
    unembed="unembed",
    heads="blocks/*/attn/out",
    qkv=("blocks/*/attn/query", "blocks/*/attn/key", "blocks/*/attn/value"),
    norms=("blocks/*/ln1", "blocks/*/ln2"),
    n_heads=2,
)


def _ln(norm, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + norm.epsilon) * norm.scale[...] + norm.bias[...]


def hand_prenorm(model, tokens, extra):
    """``PreNorm`` unrolled by hand: each head's q/k/v input its own copy of the stream through
    the norm, each MLP's and the readout's input through theirs."""
    t = tokens.shape[1]
    senders = {
        "embed": model.embed.embedding[...][tokens],
        "pos_embed": model.pos_embed.embedding[...][:t],
    }
    x = senders["embed"] + senders["pos_embed"]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for layer, block in enumerate(model.blocks):
        a = block.attn
        out = a.out.bias[...]
        for h in range(2):
            proj = {}
            for kind, lin in (("q", a.query), ("k", a.key), ("v", a.value)):
                xin = _ln(block.ln1, x + extra.get(f"L{layer}H{h}.{kind}", 0.0))
                proj[kind] = xin @ lin.kernel[...][:, h] + lin.bias[...][h]
            s = jnp.einsum("bqd,bkd->bqk", proj["q"] / jnp.sqrt(4.0), proj["k"])
            p = jax.nn.softmax(jnp.where(causal, s, jnp.finfo(s.dtype).min), axis=-1)
            result = jnp.einsum("bqk,bkd->bqd", p, proj["v"]) @ a.out.kernel[...][h]
            senders[f"L{layer}H{h}"] = result
            out = out + result
        x = x + out
        up, down = block.mlp.layers[0], block.mlp.layers[2]
        xin = _ln(block.ln2, x + extra.get(f"MLP{layer}", 0.0))
        y = jax.nn.gelu(xin @ up.kernel[...] + up.bias[...]) @ down.kernel[...] + down.bias[...]
        senders[f"MLP{layer}"] = y
        x = x + y
    x = _ln(model.ln_f, x + extra.get("logits", 0.0))
    return x @ model.unembed.kernel[...] + model.unembed.bias[...], senders


def test_pre_norm_blocks_as_the_hand_forward():
    model = PreNorm(nnx.Rngs(2))
    np.testing.assert_allclose(hand_prenorm(model, CLEAN, {})[0], model(CLEAN), atol=1e-5)
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, PRENORM_PARTS)
    order = ["embed", "pos_embed", "L0H0", "L0H1", "MLP0", "L1H0", "L1H1", "MLP1"]
    receivers = {
        f"L{i}H{h}.{k}": order[: 2 + 3 * i] for i in range(2) for h in range(2) for k in "qkv"
    }
    receivers |= {"MLP0": order[:4], "MLP1": order[:7], "logits": order}
    assert set(edges) == {(s, r) for r, ss in receivers.items() for s in ss}
    _, clean = hand_prenorm(model, CLEAN, {})
    _, corrupt = hand_prenorm(model, CORRUPT, {})
    zeros = {r: jnp.zeros((2, 6, 8)) for r in receivers}
    g = jax.grad(lambda e: metric(hand_prenorm(model, CLEAN, e)[0]))(zeros)
    for r, ss in receivers.items():
        for s in ss:
            want = float(jnp.sum((corrupt[s] - clean[s]) * g[r]))
            assert edges[s, r] == pytest.approx(want, rel=1e-4, abs=1e-5), (s, r)
    # circuits: every edge is the clean run, none the corrupted one, and one with the
    # layer-0 heads' edges into layer 1's keys cut is the hand-rewired forward
    every = hx.run_circuit(model, (CLEAN,), (CORRUPT,), edges)
    np.testing.assert_allclose(every, model(CLEAN), atol=1e-5)
    none = hx.run_circuit(model, (CLEAN,), (CORRUPT,), [], PRENORM_PARTS)
    np.testing.assert_allclose(none, model(CORRUPT), atol=1e-5)
    cut = {(f"L0H{a}", f"L1H{b}.k") for a in range(2) for b in range(2)}
    y = hx.run_circuit(
        model, (CLEAN,), (CORRUPT,), [e for e in edges if e not in cut], PRENORM_PARTS
    )
    extra = {
        f"L1H{b}.k": sum(corrupt[f"L0H{a}"] - clean[f"L0H{a}"] for a in range(2)) for b in range(2)
    }
    np.testing.assert_allclose(y, hand_prenorm(model, CLEAN, extra)[0], atol=1e-5)


class EqxPreNormBlock(eqx.Module):
    """``PreNormBlock`` as Equinox writes it: one sequence, the norms, the MLP and the
    attention's projections mapped over the positions by ``jax.vmap``."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __call__(self, x):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((len(x), len(x)), bool)))
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class EqxPreNorm(eqx.Module):
    embed: eqx.nn.Embedding
    pos_embed: eqx.nn.Embedding
    blocks: list
    ln_f: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos_embed)(jnp.arange(len(tokens)))
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembed)(jax.vmap(self.ln_f)(x))


def eqx_prenorm(model):
    """``EqxPreNorm`` with the weights of the NNX ``PreNorm`` ``model``."""
    key = jax.random.key(0)

    def linear(kernel, bias):
        lin = eqx.nn.Linear(kernel.shape[0], kernel.shape[1], key=key)
        return eqx.tree_at(lambda m: (m.weight, m.bias), lin, (kernel.T, bias))

    def norm(ln):
        out = eqx.nn.LayerNorm(8, eps=ln.epsilon)
        return eqx.tree_at(lambda m: (m.weight, m.bias), out, (ln.scale[...], ln.bias[...]))

    def embedding(table):
        return eqx.tree_at(lambda m: m.weight, eqx.nn.Embedding(*table.shape, key=key), table)

    def block(b):
        flat = lambda lin: linear(lin.kernel[...].reshape(8, 8), lin.bias[...].reshape(8))  # noqa: E731
        biases = {f"use_{n}_bias": True for n in ("query", "key", "value", "output")}
        attn = eqx.nn.MultiheadAttention(2, 8, **biases, key=key)
        projections = (flat(b.attn.query), flat(b.attn.key), flat(b.attn.value))
        out = linear(b.attn.out.kernel[...].reshape(8, 8), b.attn.out.bias[...])
        attn = eqx.tree_at(
            lambda m: (m.query_proj, m.key_proj, m.value_proj, m.output_proj),
            attn,
            (*projections, out),
        )
        mlp = eqx.nn.MLP(8, 8, 16, 1, activation=jax.nn.gelu, key=key)
        up, down = b.mlp.layers[0], b.mlp.layers[2]
        layers = (linear(up.kernel[...], up.bias[...]), linear(down.kernel[...], down.bias[...]))
        mlp = eqx.tree_at(lambda m: m.layers, mlp, layers)
        return EqxPreNormBlock(norm(b.ln1), attn, norm(b.ln2), mlp)

    return EqxPreNorm(
        embedding(model.embed.embedding[...]),
        embedding(model.pos_embed.embedding[...]),
        [block(b) for b in model.blocks],
        norm(model.ln_f),
        linear(model.unembed.kernel[...], model.unembed.bias[...]),
    )


EQX_PRENORM_PARTS = hx.Components(
    attn="blocks/*/attn",
    mlp="blocks/*/mlp",
    embed=("embed", "pos_embed"),
    final_norm="ln_f",
    unembed="unembed",
    heads="blocks/*/attn/output_proj",
    qkv=tuple(f"blocks/*/attn/{n}_proj" for n in ("query", "key", "value")),
    norms=("blocks/*/ln1", "blocks/*/ln2"),
    n_heads=2,
)


def test_pre_norm_blocks_written_for_equinox_under_vmap_as_the_hand_forward():
    """The norms' outputs, made in one ``jax.vmap``, read by the projections in others: each
    head's copies follow them; the MLP and the readout inside vmaps too."""
    nnx_model = PreNorm(nnx.Rngs(2))
    fn = jax.vmap(eqx_prenorm(nnx_model))
    np.testing.assert_allclose(fn(CLEAN), hand_prenorm(nnx_model, CLEAN, {})[0], atol=1e-5)
    edges = hx.edge_attribution(fn, (CLEAN,), (CORRUPT,), metric, EQX_PRENORM_PARTS)
    assert len(edges) == 2 * 6 + 5 * 6 + 4 + 7 + 8
    _, clean = hand_prenorm(nnx_model, CLEAN, {})
    _, corrupt = hand_prenorm(nnx_model, CORRUPT, {})
    receivers = ("L0H1.k", "L1H0.q", "L1H1.v", "MLP0", "MLP1", "logits")
    zeros = {r: jnp.zeros((2, 6, 8)) for r in receivers}
    g = jax.grad(lambda e: metric(hand_prenorm(nnx_model, CLEAN, e)[0]))(zeros)
    for s, r in [("embed", "L0H1.k"), ("L0H0", "L1H0.q"), ("MLP0", "L1H1.v"), ("L0H1", "MLP0")]:
        want = float(jnp.sum((corrupt[s] - clean[s]) * g[r]))
        assert edges[s, r] == pytest.approx(want, rel=1e-4, abs=1e-5), (s, r)
    for s, r in [("L1H1", "MLP1"), ("MLP1", "logits")]:
        want = float(jnp.sum((corrupt[s] - clean[s]) * g[r]))
        assert edges[s, r] == pytest.approx(want, rel=1e-4, abs=1e-5), (s, r)
    np.testing.assert_allclose(
        hx.run_circuit(fn, (CLEAN,), (CORRUPT,), edges), fn(CLEAN), atol=1e-5
    )
    none = hx.run_circuit(fn, (CLEAN,), (CORRUPT,), [], EQX_PRENORM_PARTS)
    np.testing.assert_allclose(none, fn(CORRUPT), atol=1e-5)
    cut = {("L0H0", "L1H1.k"), ("MLP0", "logits")}
    y = hx.run_circuit(
        fn, (CLEAN,), (CORRUPT,), [e for e in edges if e not in cut], EQX_PRENORM_PARTS
    )
    extra = {"L1H1.k": corrupt["L0H0"] - clean["L0H0"], "logits": corrupt["MLP0"] - clean["MLP0"]}
    np.testing.assert_allclose(y, hand_prenorm(nnx_model, CLEAN, extra)[0], atol=1e-5)


def test_path_patch_is_a_labelled_array_of_senders_by_receivers(model):
    parts = induction.components()
    receivers = ["L1H0.k", ("L1H0.q", "L1H1.q"), "logits"]
    grid = hx.path_patch(
        model, (CLEAN,), (CORRUPT,), metric, parts, senders=["embed", "L0H1"], receivers=receivers
    )
    assert isinstance(grid, hx.LabelledArray) and isinstance(grid, jax.Array)
    assert grid.axes == ("sender", "receiver") and grid.rows == ("embed", "L0H1")
    assert grid.columns == ("L1H0.k", "L1H0.q+L1H1.q", "logits")
    assert grid.clean == pytest.approx(float(metric(model(CLEAN))), rel=1e-6)
    assert grid.corrupted == pytest.approx(float(metric(model(CORRUPT))), rel=1e-6)
    _, clean = hand(model, CLEAN)
    _, corrupt = hand(model, CORRUPT)
    d = corrupt["L0H1"] - clean["L0H1"]
    want = metric(hand(model, CLEAN, {"L1H0.q": d, "L1H1.q": d})[0])
    assert float(grid[1, 1]) == pytest.approx(float(want), rel=1e-5, abs=1e-5)
    fig = grid.plot()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["embed", "L0H1"]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(grid.columns)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("receiver", "sender")


def test_edges_plot_draws_the_top_k_edges_by_layer(model):
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, induction.components())
    fig = edges.plot(5)
    assert fig._repr_png_().startswith(b"\x89PNG")  # a notebook shows it as an image
    ax = fig.axes[0]
    top = edges.top(5)
    arrows = ax.patches[::-1]  # drawn weakest first
    assert [a.get_gid() for a in arrows] == [f"{s}->{d}" for s, d in top]
    widths = [a.get_linewidth() for a in arrows]
    assert widths[0] == pytest.approx(5.0)  # the largest |score|
    want = [0.6 + 4.4 * abs(v) / abs(top.scores[0]) for v in top.scores]
    np.testing.assert_allclose(widths, want, rtol=1e-6)
    for a, v in zip(arrows, top.scores):
        blue = a.get_edgecolor()[2] > a.get_edgecolor()[0]
        assert blue == (v >= 0)
    nodes = {t.get_text(): t.get_position() for t in ax.texts}
    assert set(nodes) == {"embed", "pos_embed", "L0H0", "L0H1", "L1H0", "L1H1", "logits"}
    assert nodes["embed"][1] == nodes["pos_embed"][1] == 0 and nodes["L0H0"][1] == 1
    assert nodes["L1H1"][1] == 2 and nodes["logits"][1] == 3
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "embeddings", "layer 0 heads", "layer 1 heads", "logits"
    ]  # fmt: skip
    assert len(edges.plot().axes[0].patches) == len(edges) == 42


def test_edges_plot_of_a_few_edges_or_none(model):
    edges = hx.edge_attribution(model, (CLEAN,), (CORRUPT,), metric, induction.components())
    top = edges.top(4)
    ax = top.plot().axes[0]
    arrows = [a.get_gid() for a in ax.patches[::-1]]
    assert arrows == [f"{s}->{d}" for s, d in top]
    nodes = {t.get_text(): t.get_position() for t in ax.texts}
    assert set(nodes) == {s for s, _ in top} | {d.split(".")[0] for _, d in top}
    assert len(top.top(0).plot().axes[0].patches) == 0
    # a table in any order: each row's nodes by head, centred; widths by |score|
    table = hx.Edges(
        ("L0H1", "embed", "L0H0"),
        ("L1H1.k", "L0H1.q", "logits"),
        np.array([2.0, -1.0, 0.5], np.float32),
    )
    ax = table.plot().axes[0]
    nodes = {t.get_text(): t.get_position() for t in ax.texts}
    assert nodes == {
        "embed": (0.0, 0), "L0H0": (-0.5, 1), "L0H1": (0.5, 1), "L1H1": (0.0, 2),
        "logits": (0.0, 3),
    }  # fmt: skip
    widths = {a.get_gid(): a.get_linewidth() for a in ax.patches}
    assert widths == pytest.approx({"L0H1->L1H1.k": 5.0, "embed->L0H1.q": 2.8, "L0H0->logits": 1.7})
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "embeddings", "layer 0 heads", "layer 1 heads", "logits"
    ]  # fmt: skip


def test_edge_attribution_needs_a_scalar_metric(model):
    with pytest.raises(
        hx.HookaxError, match=r"hx\.edge_attribution: the metric must return a scalar"
    ):
        hx.edge_attribution(model, (CLEAN,), (CORRUPT,), lambda y: y[:, -1], induction.components())
