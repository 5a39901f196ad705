"""Circuits on every kind of model hookax reads: the same two-layer attention-only transformer
(two heads concatenated, biases everywhere) written for Equinox, Linen, Haiku and as a plain
program over a weight pytree, each from one set of weights, against one forward unrolled by
hand; under ``jax.jit`` with the model as an argument; and the models whose parts run inside a
transform of their own (a scanned stack of layers, Equinox's ``jax.vmap``, a checkpoint), which
raise."""

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

V, D, H, T = 8, 8, 2, 6
DH = D // H
CLEAN = jnp.array([[1, 2, 3, 1, 2, 3], [4, 5, 6, 4, 5, 6]])
CORRUPT = jnp.array([[1, 2, 3, 7, 0, 1], [4, 5, 6, 2, 2, 0]])


def metric(logits):
    return logits[0, -1, 1] - logits[1, -1, 2] + 0.5 * logits[:, 3, 5].sum()


def _weights():
    keys = iter(jax.random.split(jax.random.key(0), 32))
    normal = lambda *shape: jax.random.normal(next(keys), shape)  # noqa: E731
    layers = [
        {n: normal(D, D) / np.sqrt(D) for n in "qkvo"} | {f"b{n}": 0.3 * normal(D) for n in "qkvo"}
        for _ in range(2)
    ]
    return {"E": normal(V, D), "layers": layers, "U": normal(D, V) / np.sqrt(D), "bU": normal(V)}


W = _weights()


def _attend(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(jnp.float32(DH))
    causal = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1), v)


def hand(tokens, extra=None):
    """The model unrolled by hand, head by head; ``extra[receiver]`` is added to that
    receiver's own copy of the stream. Returns the logits and every sender's value."""
    extra = extra or {}
    senders = {"embed": W["E"][tokens]}
    x = senders["embed"]
    for layer, w in enumerate(W["layers"]):
        out = w["bo"]
        for h in range(H):
            cols = slice(h * DH, (h + 1) * DH)
            qkv = [
                (x + extra.get(f"L{layer}H{h}.{n}", 0.0)) @ w[n][:, cols] + w[f"b{n}"][cols]
                for n in "qkv"
            ]
            senders[f"L{layer}H{h}"] = _attend(*qkv) @ w["o"][cols]
            out = out + senders[f"L{layer}H{h}"]
        x = x + out
    x = x + extra.get("logits", 0.0)
    return x @ W["U"] + W["bU"], senders


RECEIVERS = [f"L{i}H{h}.{n}" for i in range(2) for h in range(H) for n in "qkv"] + ["logits"]
UPSTREAM = {
    r: ["embed"] + ([f"L0H{h}" for h in range(H)] if r[:2] != "L0" else [])
    + ([f"L1H{h}" for h in range(H)] if r == "logits" else [])
    for r in RECEIVERS
}  # fmt: skip
CHECKED = [
    ("embed", "L0H1.k"),
    ("embed", "L1H0.q"),
    ("L0H0", "L1H1.k"),
    ("L0H1", "L1H0.v"),
    ("L1H0", "logits"),
    ("L1H1", "logits"),
]


def eap_by_hand(edges):
    """EAP: the gradient of the metric with respect to the receiver's input at the clean run,
    dotted with the sender's corrupted minus clean value."""
    _, clean = hand(CLEAN)
    _, corrupt = hand(CORRUPT)
    zeros = {r: jnp.zeros((2, T, D)) for r in RECEIVERS}
    g = jax.grad(lambda e: metric(hand(CLEAN, e)[0]))(zeros)
    return {(s, r): float(jnp.sum((corrupt[s] - clean[s]) * g[r])) for s, r in edges}


# --- the model, three ways -----------------------------------------------------------------


class Linear(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return x @ self.weight + self.bias


class Embed(eqx.Module):
    table: jax.Array

    def __call__(self, tokens):
        return self.table[tokens]


class Attention(eqx.Module):
    query: Linear
    key: Linear
    value: Linear
    out: Linear

    def __call__(self, x):
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, H, DH).transpose(0, 2, 1, 3).reshape(b * H, t, DH)  # noqa: E731
        z = _attend(split(self.query(x)), split(self.key(x)), split(self.value(x)))
        return self.out(z.reshape(b, H, t, DH).transpose(0, 2, 1, 3).reshape(b, t, D))


class EqxModel(eqx.Module):
    """Equinox, its parts on whole arrays (batch and positions): no ``jax.vmap``."""

    embed: Embed
    blocks: list
    unembed: Linear

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.unembed(x)


def eqx_model():
    blocks = [
        Attention(*(Linear(w[n], w[f"b{n}"]) for n in "qkvo")) for w in W["layers"]
    ]  # fmt: skip
    return EqxModel(Embed(W["E"]), blocks, Linear(W["U"], W["bU"]))


class LinenAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, H, DH).transpose(0, 2, 1, 3).reshape(b * H, t, DH)  # noqa: E731
        q, k, v = (split(nn.Dense(D, name=n)(x)) for n in ("query", "key", "value"))
        z = _attend(q, k, v).reshape(b, H, t, DH).transpose(0, 2, 1, 3).reshape(b, t, D)
        return nn.Dense(D, name="out")(z)


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        for i in range(2):
            x = x + LinenAttention(name=f"blocks_{i}")(x)
        return nn.Dense(V, name="unembed")(x)


def linen_params():
    dense = lambda w, b: {"kernel": w, "bias": b}  # noqa: E731
    names = {"q": "query", "k": "key", "v": "value", "o": "out"}
    blocks = {
        f"blocks_{i}": {names[n]: dense(w[n], w[f"b{n}"]) for n in "qkvo"}
        for i, w in enumerate(W["layers"])
    }
    return {"params": {"embed": {"embedding": W["E"]}, "unembed": dense(W["U"], W["bU"])} | blocks}


def embed(tokens, table):
    return table[tokens]


def query(x, w):
    return x @ w["q"] + w["bq"]


def key(x, w):
    return x @ w["k"] + w["bk"]


def value(x, w):
    return x @ w["v"] + w["bv"]


def out(z, w):
    return z @ w["o"] + w["bo"]


def unembed(x, weights):
    return x @ weights["U"] + weights["bU"]


def attn(x, w):
    b, t, _ = x.shape
    split = lambda y: y.reshape(b, t, H, DH).transpose(0, 2, 1, 3).reshape(b * H, t, DH)  # noqa: E731
    z = _attend(split(query(x, w)), split(key(x, w)), split(value(x, w)))
    return out(z.reshape(b, H, t, DH).transpose(0, 2, 1, 3).reshape(b, t, D), w)


def program(weights, tokens):
    """A plain program over a weight pytree: its call sites are its functions' calls."""
    x = embed(tokens, weights["E"])
    for w in weights["layers"]:
        x = x + attn(x, w)
    return unembed(x, weights)


def _parts(blocks, out="out"):
    return hx.Components(
        attn=blocks,
        embed="embed",
        unembed="unembed",
        heads=f"{blocks}/{out}",
        qkv=tuple(f"{blocks}/{n}" for n in ("query", "key", "value")),
        n_heads=H,
    )


def _case(kind):
    """``(fn, clean_args, corrupt_args, components, as_args)``: ``as_args(model_or_weights,
    tokens)`` the arguments of a call with the model (or weights) passed to a jitted function."""
    if kind == "equinox":
        model = eqx_model()
        return model, (CLEAN,), (CORRUPT,), _parts("blocks/*"), model
    if kind == "linen":
        params = linen_params()
        return (
            functools.partial(LinenModel().apply, params),
            (CLEAN,),
            (CORRUPT,),
            (_parts("blocks_*")),
            params,
        )
    if kind == "haiku":
        return haiku_model(), (CLEAN,), (CORRUPT,), _parts("attn_*", out="linear"), None
    return program, (W, CLEAN), (W, CORRUPT), _parts("attn/*"), W


def haiku_model():
    """Haiku's ``hk.MultiHeadAttention`` (its projections ``query``, ``key``, ``value``, its
    output ``linear``, heads concatenated), the weights ``W``."""
    hk = pytest.importorskip("haiku")

    def forward(tokens):
        x = hk.Embed(V, D, name="embed")(tokens)
        mask = jnp.tril(jnp.ones((1, 1, T, T), bool))
        for i in range(2):
            attention = hk.MultiHeadAttention(H, DH, w_init=jnp.zeros, name=f"attn_{i}")
            x = x + attention(x, x, x, mask=mask)
        return hk.Linear(V, name="unembed")(x)

    names = {"q": "query", "k": "key", "v": "value", "o": "linear"}
    params = {"embed": {"embeddings": W["E"]}, "unembed": {"w": W["U"], "b": W["bU"]}}
    for i, w in enumerate(W["layers"]):
        params |= {f"attn_{i}/{names[n]}": {"w": w[n], "b": w[f"b{n}"]} for n in "qkvo"}
    apply = hk.transform(forward).apply
    return lambda tokens: apply(params, None, tokens)


KINDS = ["equinox", "linen", "program"]


@pytest.mark.parametrize("kind", [*KINDS, "haiku"])
def test_eap_scores_are_the_hand_gradients_and_circuits_the_two_runs(kind):
    fn, clean, corrupt, parts, _ = _case(kind)
    np.testing.assert_allclose(fn(*clean), hand(CLEAN)[0], rtol=1e-5, atol=1e-5)
    edges = hx.edge_attribution(fn, clean, corrupt, metric, parts)
    assert set(edges) == {(s, r) for r in RECEIVERS for s in UPSTREAM[r]} and len(edges) == 29
    for edge, want in eap_by_hand(CHECKED).items():
        assert edges[edge] == pytest.approx(want, rel=1e-4, abs=1e-5), edge
    np.testing.assert_array_equal(hx.run_circuit(fn, clean, corrupt, edges), fn(*clean))
    none = hx.run_circuit(fn, clean, corrupt, edges.top(0))
    np.testing.assert_allclose(none, fn(*corrupt), atol=1e-5)
    # one edge cut: the receiver reads the sender's corrupted value (the hand forward)
    _, c = hand(CLEAN)
    _, k = hand(CORRUPT)
    y = hx.run_circuit(fn, clean, corrupt, [e for e in edges if e != ("L0H0", "L1H1.k")], parts)
    want, _ = hand(CLEAN, {"L1H1.k": k["L0H0"] - c["L0H0"]})
    np.testing.assert_allclose(y, want, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_under_jit_with_the_model_as_an_argument(kind):
    fn, clean, corrupt, parts, weights = _case(kind)
    every = [(s, r) for r in RECEIVERS for s in UPSTREAM[r]]

    def call(weights, tokens, corrupted):
        if kind == "equinox":
            f, a, b = weights, (tokens,), (corrupted,)
        elif kind == "linen":
            f, a, b = functools.partial(LinenModel().apply, weights), (tokens,), (corrupted,)
        else:
            f, a, b = program, (weights, tokens), (weights, corrupted)
        y = hx.run_circuit(f, a, b, [e for e in every if e != ("L0H1", "L1H0.v")], parts)
        grid = hx.path_patch(
            f, a, b, metric, parts, senders=["L0H0", "L0H1"], receivers=["L1H1.k", "logits"]
        )
        return y, grid

    y, grid = jax.jit(call)(weights, CLEAN, CORRUPT)
    _, c = hand(CLEAN)
    _, k = hand(CORRUPT)
    want, _ = hand(CLEAN, {"L1H0.v": k["L0H1"] - c["L0H1"]})
    np.testing.assert_allclose(y, want, atol=1e-5)
    assert isinstance(grid, hx.LabelledArray) and grid.rows == ("L0H0", "L0H1")
    assert grid.columns == ("L1H1.k", "logits")
    for i, s in enumerate(grid.rows):
        for j, r in enumerate(grid.columns):
            want, _ = hand(CLEAN, {r: k[s] - c[s]})
            assert float(grid[i, j]) == pytest.approx(float(metric(want)), rel=1e-5, abs=1e-5)
    with pytest.raises(hx.HookaxError, match=r"hx.edge_attribution: called inside jax.jit"):
        jax.jit(lambda t: hx.edge_attribution(fn, (*clean[:-1], t), corrupt, metric, parts))(CLEAN)


# --- parts inside a transform of the model's own: a clear error -------------------------------


class Block(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs)

    def __call__(self, x):
        return x + self.attn(x, mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))


class Scanned(nnx.Module):
    """The layers stacked and run by ``nnx.scan`` (call sites ``blocks/attn/...``)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)
        self.unembed = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        step = lambda x, block: block(x)  # noqa: E731
        x = nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
            self.embed(tokens), self.blocks
        )
        return self.unembed(x)


SCANNED_PARTS = hx.Components(
    attn="blocks/attn",
    embed="embed",
    unembed="unembed",
    heads="blocks/attn/out",
    qkv=("blocks/attn/query", "blocks/attn/key", "blocks/attn/value"),
)


class EqxBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return x + self.attn(x, x, x, mask=jnp.tril(jnp.ones((T, T), bool)))


class EqxGPT(eqx.Module):
    """Equinox's own way: one sequence, its positions mapped by ``jax.vmap``."""

    embed: eqx.nn.Embedding
    blocks: list
    unembed: eqx.nn.Linear

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembed)(x)


def test_parts_inside_a_scan_or_a_vmap_raise_naming_the_call_site_and_the_fix():
    scanned = Scanned(nnx.Rngs(0))
    for call in (
        lambda: hx.edge_attribution(scanned, (CLEAN,), (CORRUPT,), metric, SCANNED_PARTS),
        lambda: hx.run_circuit(scanned, (CLEAN,), (CORRUPT,), [], SCANNED_PARTS),
    ):
        with pytest.raises(
            hx.HookaxError,
            match=r"the call site 'blocks/attn/query' runs inside a scan over stacked layers "
            r"\(nnx.scan, nn.scan, lax.scan\).*Fix: run the layers in a Python loop",
        ):
            call()
    ks = jax.random.split(jax.random.key(1), 4)
    gpt = EqxGPT(
        eqx.nn.Embedding(V, D, key=ks[0]),
        [EqxBlock(eqx.nn.MultiheadAttention(H, D, key=k)) for k in ks[1:3]],
        eqx.nn.Linear(D, V, key=ks[3]),
    )
    parts = hx.Components(
        attn="blocks/*/attn",
        embed="embed",
        unembed="unembed",
        heads="blocks/*/attn/output_proj",
        qkv=tuple(f"blocks/*/attn/{n}_proj" for n in ("query", "key", "value")),
        n_heads=H,
    )
    with pytest.raises(
        hx.HookaxError,
        match=r"hx.run_circuit: the call site 'embed' runs inside a jax.vmap.*Fix: write the "
        r"parts that the components name on whole arrays",
    ):
        hx.run_circuit(jax.vmap(gpt), (CLEAN,), (CORRUPT,), [], parts)


def remat_program(weights, tokens):
    x = embed(tokens, weights["E"])
    for w in weights["layers"]:
        x = x + jax.checkpoint(attn)(x, w)
    return unembed(x, weights)


def test_parts_under_a_checkpoint_of_the_models_own_raise():
    with pytest.raises(
        hx.HookaxError,
        match=r"hx.path_patch: the call site 'attn/0/query' runs inside a transform the model "
        r"applies itself \(jax.checkpoint / remat, a cond, a loop\).*Fix: call the parts outside",
    ):
        hx.path_patch(
            remat_program,
            (W, CLEAN),
            (W, CORRUPT),
            metric,
            _parts("attn/*"),
            senders=["embed"],
            receivers=["logits"],
        )
