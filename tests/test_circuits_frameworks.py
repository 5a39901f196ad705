"""Circuits on every kind of model hookax reads: the same two-layer attention-only transformer (two
heads, biases everywhere) written for Equinox, Linen, Haiku and as a plain program over a weight
pytree, each from one set of weights, against one forward unrolled by hand; written the usual
ways of each (Equinox's ``jax.vmap`` over the positions inside the model and over the batch
around it; a stack of layers scanned by ``nnx.scan``, ``nn.scan``, ``lax.scan`` (over Equinox's
stacked blocks too) and Haiku's ``layer_stack``); under ``jax.jit`` with the model as an
argument; and models whose parts run inside a checkpoint, a cond or a while loop of their own,
which raise."""

import dataclasses
import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._util.jaxcompat import JAX_VERSION

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


def hand(tokens, extra=None, embedding=None):
    """The model unrolled by hand, head by head; ``extra[receiver]`` is added to that
    receiver's own copy of the stream; ``embedding``: the embedding's output in place of the
    table's rows. Returns the logits and every sender's value."""
    extra = extra or {}
    senders = {"embed": W["E"][tokens] if embedding is None else embedding}
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


class EqxBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return x + self.attn(x, x, x, mask=jnp.tril(jnp.ones((x.shape[0],) * 2, bool)))


class EqxGPT(eqx.Module):
    """Equinox's own way: one sequence, its positions mapped by ``jax.vmap`` (the embedding,
    ``eqx.nn.MultiheadAttention``'s projections, the unembedding)."""

    embed: eqx.nn.Embedding
    blocks: list
    unembed: eqx.nn.Linear

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembed)(x)


def eqx_gpt():
    """``EqxGPT`` with the weights ``W``."""
    ks = iter(jax.random.split(jax.random.key(1), 4))
    names = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "o": "output_proj"}

    def attention(w):
        biases = dict.fromkeys(("query", "key", "value", "output"), True)
        m = eqx.nn.MultiheadAttention(
            H, D, **{f"use_{n}_bias": b for n, b in biases.items()}, key=next(ks)
        )
        for n, name in names.items():
            where = lambda m: (getattr(m, name).weight, getattr(m, name).bias)  # noqa: B023, E731
            m = eqx.tree_at(where, m, (w[n].T, w[f"b{n}"]))
        return m

    embed = eqx.tree_at(lambda e: e.weight, eqx.nn.Embedding(V, D, key=next(ks)), W["E"])
    blocks = [EqxBlock(attention(w)) for w in W["layers"]]
    unembed = eqx.nn.Linear(D, V, key=next(ks))
    unembed = eqx.tree_at(lambda u: (u.weight, u.bias), unembed, (W["U"].T, W["bU"]))
    return EqxGPT(embed, blocks, unembed)


EQX_GPT_PARTS = hx.Components(
    attn="blocks/*/attn",
    embed="embed",
    unembed="unembed",
    heads="blocks/*/attn/output_proj",
    qkv=tuple(f"blocks/*/attn/{n}_proj" for n in ("query", "key", "value")),
    n_heads=H,
)


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


def _stacked(f):
    return jnp.stack([f(w) for w in W["layers"]])


def scanned():
    """``Scanned`` with the weights ``W`` (heads on their own axis)."""
    model = Scanned(nnx.Rngs(0))
    attention = model.blocks.attn
    for n, name in (("q", "query"), ("k", "key"), ("v", "value")):
        getattr(attention, name).kernel[...] = _stacked(lambda w: w[n].reshape(D, H, DH))  # noqa: B023
        getattr(attention, name).bias[...] = _stacked(lambda w: w[f"b{n}"].reshape(H, DH))  # noqa: B023
    attention.out.kernel[...] = _stacked(lambda w: w["o"].reshape(H, DH, D))
    attention.out.bias[...] = _stacked(lambda w: w["bo"])
    model.embed.embedding[...] = W["E"]
    model.unembed.kernel[...], model.unembed.bias[...] = W["U"], W["bU"]
    return model


SCANNED_PARTS = hx.Components(
    attn="blocks/attn",
    embed="embed",
    unembed="unembed",
    heads="blocks/attn/out",
    qkv=("blocks/attn/query", "blocks/attn/key", "blocks/attn/value"),
)


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + LinenAttention(name="attn")(x), None


class LinenScanned(nn.Module):
    """The layers stacked and run by ``nn.scan`` (call sites ``blocks/attn/...``)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        layers = nn.scan(
            LinenLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
        )
        x, _ = layers(name="blocks")(x, None)
        return nn.Dense(V, name="unembed")(x)


def linen_scanned_params():
    p = linen_params()["params"]
    attention = jax.tree.map(lambda *a: jnp.stack(a), p["blocks_0"], p["blocks_1"])
    return {"params": {"embed": p["embed"], "unembed": p["unembed"], "blocks": {"attn": attention}}}


W_STACKED = {k: v for k, v in W.items() if k != "layers"} | {
    "layers": jax.tree.map(lambda *a: jnp.stack(a), *W["layers"])
}


def scan_program(weights, tokens):
    """The plain program with its layers' weights stacked, run by ``lax.scan`` (call sites
    ``attn/query``, ...: the layers by the scan's iterations)."""
    x = embed(tokens, weights["E"])
    x, _ = jax.lax.scan(lambda x, w: (x + attn(x, w), None), x, weights["layers"])
    return unembed(x, weights)


def one_metric(logits):
    """``metric`` for one sequence."""
    return logits[-1, 1] + 0.5 * logits[3, 5]


@dataclasses.dataclass
class Case:
    """A model and its arguments; ``build(model, clean, corrupt)`` gives ``(fn, clean_args,
    corrupt_args)`` from the model (or weights) ``model``, for a call under ``jax.jit``;
    ``one``: the model reads one sequence (the hand forward's first)."""

    model: object
    build: object
    parts: hx.Components
    one: bool = False

    def args(self, model=None):
        model = self.model if model is None else model
        if self.one:
            return self.build(model, CLEAN[0], CORRUPT[0])
        return self.build(model, CLEAN, CORRUPT)

    @property
    def metric(self):
        return one_metric if self.one else metric

    def tokens(self):
        return (CLEAN[:1], CORRUPT[:1]) if self.one else (CLEAN, CORRUPT)

    def hand_metric(self, logits):
        return one_metric(logits[0]) if self.one else metric(logits)

    def out(self, logits):
        """The hand forward's logits as the model returns them."""
        return logits[0] if self.one else logits


def _model_call(m, clean, corrupt):
    return m, (clean,), (corrupt,)


def _case(kind):
    linen = lambda module: lambda p, a, b: (functools.partial(module.apply, p), (a,), (b,))  # noqa: E731
    program_call = lambda f: lambda w, a, b: (f, (w, a), (w, b))  # noqa: E731
    return {
        "equinox": lambda: Case(eqx_model(), _model_call, _parts("blocks/*")),
        "linen": lambda: Case(linen_params(), linen(LinenModel()), _parts("blocks_*")),
        "program": lambda: Case(W, program_call(program), _parts("attn/*")),
        "haiku": lambda: Case(
            None, lambda _, a, b: (haiku_model(), (a,), (b,)), _parts("attn_*", out="linear")
        ),
        "equinox-vmap": lambda: Case(eqx_gpt(), _model_call, EQX_GPT_PARTS, one=True),
        "haiku-scan": _haiku_scan,
        "equinox-scan": lambda: Case(
            eqx_scan_gpt(), lambda m, a, b: (jax.vmap(m), (a,), (b,)), EQX_SCAN_PARTS
        ),
        "equinox-vmap-batch": lambda: Case(
            eqx_gpt(), lambda m, a, b: (jax.vmap(m), (a,), (b,)), EQX_GPT_PARTS
        ),
        "nnx-scan": lambda: Case(scanned(), _model_call, SCANNED_PARTS),
        "linen-scan": lambda: Case(
            linen_scanned_params(), linen(LinenScanned()), _parts("blocks/attn")
        ),
        "lax-scan": lambda: Case(W_STACKED, program_call(scan_program), _parts("attn")),
    }[kind]()


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


def haiku_stacked():
    """``(apply, params)``: the Haiku model with its layers stacked by
    ``hk.experimental.layer_stack`` (a scan; call sites
    ``__layer_stack_no_per_layer/attn/query``, ...), the weights ``W``."""
    hk = pytest.importorskip("haiku")

    def forward(tokens):
        x = hk.Embed(V, D, name="embed")(tokens)
        mask = jnp.tril(jnp.ones((1, 1, T, T), bool))

        @hk.experimental.layer_stack(2)
        def layer(x):
            attention = hk.MultiHeadAttention(H, DH, w_init=jnp.zeros, name="attn")
            return x + attention(x, x, x, mask=mask)

        return hk.Linear(V, name="unembed")(layer(x))

    names = {"q": "query", "k": "key", "v": "value", "o": "linear"}
    params = {"embed": {"embeddings": W["E"]}, "unembed": {"w": W["U"], "b": W["bU"]}}
    for n, name in names.items():
        stacked = {"w": _stacked(lambda w: w[n]), "b": _stacked(lambda w: w[f"b{n}"])}  # noqa: B023
        params[f"__layer_stack_no_per_layer/attn/{name}"] = stacked
    return hk.transform(forward).apply, params


class EqxScanGPT(eqx.Module):
    """``EqxGPT`` with its blocks stacked and run by ``lax.scan``, as Equinox scans layers (call
    sites ``blocks/attn/query_proj``, ...)."""

    embed: eqx.nn.Embedding
    blocks: EqxBlock
    unembed: eqx.nn.Linear

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        step = lambda x, layer: (eqx.combine(layer, static)(x), None)  # noqa: E731
        x, _ = jax.lax.scan(step, x, arrays)
        return jax.vmap(self.unembed)(x)


def eqx_scan_gpt():
    gpt = eqx_gpt()
    stack = lambda *a: jnp.stack(a) if eqx.is_array(a[0]) else a[0]  # noqa: E731
    return EqxScanGPT(gpt.embed, jax.tree.map(stack, *gpt.blocks), gpt.unembed)


EQX_SCAN_PARTS = hx.Components(
    attn="blocks/attn",
    embed="embed",
    unembed="unembed",
    heads="blocks/attn/output_proj",
    qkv=tuple(f"blocks/attn/{n}_proj" for n in ("query", "key", "value")),
    n_heads=H,
)


def _haiku_scan():
    apply, params = haiku_stacked()
    build = lambda p, a, b: (functools.partial(apply, p, None), (a,), (b,))  # noqa: E731
    return Case(params, build, _parts("__layer_stack_no_per_layer/attn", out="linear"))


KINDS = [
    "equinox",
    "linen",
    "program",
    "equinox-vmap",
    "equinox-vmap-batch",
    "nnx-scan",
    "linen-scan",
    "lax-scan",
    "equinox-scan",
    "haiku-scan",
]


def eap_by_hand(case, edges, steps=1):
    """EAP: the gradient of the metric with respect to the receiver's input at the clean run,
    dotted with the sender's corrupted minus clean value; EAP-IG (``steps > 1``): the gradient's
    mean over the runs whose embedding is ``corrupt + alpha * (clean - corrupt)``."""
    clean_tokens, corrupt_tokens = case.tokens()
    _, clean = hand(clean_tokens)
    _, corrupt = hand(corrupt_tokens)
    zeros = {r: jnp.zeros((*clean_tokens.shape, D)) for r in RECEIVERS}

    def at(alpha):
        mixed = corrupt["embed"] + alpha * (clean["embed"] - corrupt["embed"])
        return jax.grad(lambda e: case.hand_metric(hand(clean_tokens, e, mixed)[0]))(zeros)

    grads = [at(a / steps) for a in range(1, steps + 1)]
    g = jax.tree.map(lambda *gs: sum(gs) / steps, *grads)
    return {(s, r): float(jnp.sum((corrupt[s] - clean[s]) * g[r])) for s, r in edges}


def _linen_scan_raises(kind):
    """On JAX 0.12, ``nn.scan``'s layers are not followed (its scan stays a transform under
    ``jax.disable_jit``): the circuits functions raise, naming the call site and the fix."""
    if kind != "linen-scan" or JAX_VERSION < (0, 12):
        return False
    case = _case(kind)
    fn, clean, corrupt = case.args()
    for call in (
        lambda: hx.edge_attribution(fn, clean, corrupt, case.metric, case.parts),
        lambda: hx.run_circuit(fn, clean, corrupt, [], case.parts),
    ):
        with pytest.raises(
            hx.HookaxError,
            match=r"the call site 'blocks/attn/query' runs inside a transform the model applies "
            r"itself.*Fix: call the parts outside the transform",
        ):
            call()
    return True


@pytest.mark.parametrize("kind", [*KINDS, "haiku"])
def test_eap_scores_are_the_hand_gradients_and_circuits_the_two_runs(kind):
    case = _case(kind)
    fn, clean, corrupt = case.args()
    if _linen_scan_raises(kind):
        return
    clean_tokens, corrupt_tokens = case.tokens()
    np.testing.assert_allclose(fn(*clean), case.out(hand(clean_tokens)[0]), rtol=1e-5, atol=1e-5)
    edges = hx.edge_attribution(fn, clean, corrupt, case.metric, case.parts)
    assert set(edges) == {(s, r) for r in RECEIVERS for s in UPSTREAM[r]} and len(edges) == 29
    for edge, want in eap_by_hand(case, CHECKED).items():
        assert edges[edge] == pytest.approx(want, rel=1e-4, abs=1e-5), edge
    # every edge kept: the clean output (an eager vmap of an Equinox module rounds apart from
    # one compiled program by about 1e-7 on JAX 0.12)
    full = hx.run_circuit(fn, clean, corrupt, edges)
    np.testing.assert_allclose(full, fn(*clean), rtol=1e-6, atol=1e-6)
    none = hx.run_circuit(fn, clean, corrupt, edges.top(0))
    np.testing.assert_allclose(none, fn(*corrupt), atol=1e-5)
    # one edge cut: the receiver reads the sender's corrupted value (the hand forward)
    _, c = hand(clean_tokens)
    _, k = hand(corrupt_tokens)
    y = hx.run_circuit(
        fn, clean, corrupt, [e for e in edges if e != ("L0H0", "L1H1.k")], case.parts
    )
    want, _ = hand(clean_tokens, {"L1H1.k": k["L0H0"] - c["L0H0"]})
    np.testing.assert_allclose(y, case.out(want), atol=1e-5)


@pytest.mark.parametrize("kind", ["program", "equinox-vmap", "equinox-vmap-batch", "nnx-scan"])
def test_eap_ig_scores_are_the_hand_integrated_gradients(kind):
    case = _case(kind)
    fn, clean, corrupt = case.args()
    edges = hx.edge_attribution(fn, clean, corrupt, case.metric, case.parts, steps=3)
    for edge, want in eap_by_hand(case, CHECKED, steps=3).items():
        assert edges[edge] == pytest.approx(want, rel=1e-4, abs=1e-5), edge


@pytest.mark.parametrize("kind", KINDS)
def test_under_jit_with_the_model_as_an_argument(kind):
    case = _case(kind)
    if _linen_scan_raises(kind):
        return
    every = [(s, r) for r in RECEIVERS for s in UPSTREAM[r]]

    def call(model):
        f, a, b = case.args(model)
        y = hx.run_circuit(f, a, b, [e for e in every if e != ("L0H1", "L1H0.v")], case.parts)
        grid = hx.path_patch(
            f,
            a,
            b,
            case.metric,
            case.parts,
            senders=["L0H0", "L0H1"],
            receivers=["L1H1.k", "logits"],
        )
        return y, grid

    # eqx.nn.MultiheadAttention holds a bool (its dropout's): Equinox's jit keeps it static
    jit = (
        eqx.filter_jit
        if kind in ("equinox-vmap", "equinox-vmap-batch", "equinox-scan")
        else jax.jit
    )
    y, grid = jit(call)(case.model)
    clean_tokens, corrupt_tokens = case.tokens()
    _, c = hand(clean_tokens)
    _, k = hand(corrupt_tokens)
    want, _ = hand(clean_tokens, {"L1H0.v": k["L0H1"] - c["L0H1"]})
    np.testing.assert_allclose(y, case.out(want), atol=1e-5)
    assert isinstance(grid, hx.LabelledArray) and grid.rows == ("L0H0", "L0H1")
    assert grid.columns == ("L1H1.k", "logits")
    for i, s in enumerate(grid.rows):
        for j, r in enumerate(grid.columns):
            want, _ = hand(clean_tokens, {r: k[s] - c[s]})
            assert float(grid[i, j]) == pytest.approx(
                float(case.hand_metric(want)), rel=1e-5, abs=1e-5
            )
    fn, clean, corrupt = case.args()
    with pytest.raises(hx.HookaxError, match=r"hx.edge_attribution: called inside jax.jit"):
        jax.jit(
            lambda t: hx.edge_attribution(fn, (*clean[:-1], t), corrupt, case.metric, case.parts)
        )(clean[-1])


# --- parts inside a transform of the model's own: a clear error -------------------------------


def remat_program(weights, tokens):
    x = embed(tokens, weights["E"])
    for w in weights["layers"]:
        x = x + jax.checkpoint(attn)(x, w)
    return unembed(x, weights)


def cond_program(weights, tokens):
    """The second layer under a ``lax.cond`` on the tokens (traced)."""
    x = embed(tokens, weights["E"])
    x = x + attn(x, weights["layers"][0])
    w = weights["layers"][1]
    x = jax.lax.cond(tokens.sum() > 0, lambda x: x + attn(x, w), lambda x: x, x)
    return unembed(x, weights)


def while_program(weights, tokens):
    """The layers in a ``lax.while_loop`` whose bound the tokens give (traced)."""
    x = embed(tokens, weights["E"])
    n = jnp.minimum(tokens.max(), 2)

    def body(carry):
        i, x = carry
        w = jax.tree.map(lambda a: a[i], weights["layers"])
        return i + 1, x + attn(x, w)

    _, x = jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))
    return unembed(x, weights)


@pytest.mark.parametrize(
    ("program_", "weights", "site"),
    [
        (remat_program, W, "attn/0/query"),
        (cond_program, W, "attn/1/query"),
        (while_program, W_STACKED, "body/attn/query"),
    ],
)
def test_parts_under_a_transform_of_the_models_own_raise(program_, weights, site):
    parts = _parts("body/attn" if program_ is while_program else "attn/*")
    with pytest.raises(
        hx.HookaxError,
        match=rf"hx.path_patch: the call site '{site}' runs inside a transform the model "
        r"applies itself \(jax.checkpoint / remat, a cond or a while_loop on traced values\)"
        r".*Fix: call the parts outside the transform",
    ):
        hx.path_patch(
            program_,
            (weights, CLEAN),
            (weights, CORRUPT),
            metric,
            parts,
            senders=["embed"],
            receivers=["logits"],
        )
    # nothing is left behind: the scans the run unrolled (jax.disable_jit) are staged again
    assert not jax.config.jax_disable_jit
    y, _ = jax.make_jaxpr(scan_program, return_shape=True)(W_STACKED, CLEAN)
    assert "scan" in str(y)


def test_components_that_match_no_call_site_raise_naming_them():
    # a scanned stack's call sites are named once for every layer: "attn/out", not "attn/*/out"
    with pytest.raises(
        hx.HookaxError,
        match=r"hx.run_circuit: components.heads names 'attn/\*/out', which matched no call "
        r"site that ran. Fix: name the call sites as hx.capture\(fn\)\(\*args\)\[1\] lists",
    ):
        hx.run_circuit(scan_program, (W_STACKED, CLEAN), (W_STACKED, CORRUPT), [], _parts("attn/*"))
