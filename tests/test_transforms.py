"""Capture and activation gradients through the structures real models are written with.

Each case is checked against a hand-unrolled or hand-instrumented forward, eagerly and jitted:
``jax.jit(forward)(model, cache, tokens)``, a decoder scanned with ``nnx.scan`` +
``nnx.split_rngs`` (dropout on) against the same decoder as a Python loop, Equinox's
``jax.vmap(self.linear)``, Linen's ``nn.scan``/``nn.vmap``, ``lax.map``, ``jax.checkpoint``,
``cond``, ``while_loop``, ``custom_jvp``, ``shard_map``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context
from hookax._transforms import tags as _tags

D, L = 8, 6


def close(a: Any, b: Any) -> None:
    b = np.asarray(b)
    scale = float(np.abs(b).max()) if b.size else 1.0  # float32 sums of terms of this size
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=2e-6 + 1e-5 * scale)


def assert_clean() -> None:
    assert _context.active_entries() == ()
    assert _tags.depth() == 0


# ---- a decoder: scanned with nnx.scan + split_rngs, and the same layers in a Python loop ----


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn = nnx.Linear(D, D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + self.drop(jnp.tanh(self.attn(x)))
        return h + self.mlp(h)


class Scanned(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Layer:
            return Layer(rngs)

        self.layers = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, layer: Layer) -> jax.Array:
            return layer(x)

        return body(x, self.layers)


class Looped(nnx.Module):
    """The scanned decoder's layers, unstacked: the same weights and dropout streams."""

    def __init__(self, scanned: Scanned) -> None:
        graphdef, state = nnx.split(scanned.layers)
        self.layers = nnx.List(
            [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(L)]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


JITS = {
    "eager": lambda f: f,
    "jax.jit": jax.jit,
    "nnx.jit": nnx.jit,
}


@pytest.mark.parametrize("mode", JITS)
def test_scanned_decoder_equals_python_loop(mode: str) -> None:
    scanned = Scanned(nnx.Rngs(0, dropout=1))
    looped = Looped(scanned)
    x = jax.random.normal(jax.random.key(2), (3, D))
    _, got = JITS[mode](lambda m, x: hx.capture(m)(x))(scanned, x)
    _, want = hx.capture(looped)(x)
    assert set(got) == {"", "layers", "layers/attn", "layers/mlp", "layers/drop"}
    for name in ("attn", "mlp", "drop"):
        (stacked,) = got[f"layers/{name}"]
        assert stacked.shape == (L, 3, D)
        for i in range(L):
            close(stacked[i], want[f"layers/{i}/{name}"][0])
    dropped = np.asarray(got["layers/drop"][0]) == 0
    assert dropped.any() and not dropped.all()  # dropout was on, in training mode
    close(got[""][0], want[""][0])
    assert_clean()


def sq_loss(m: Any, x: jax.Array) -> jax.Array:
    return jnp.sum(m(x) ** 2)


@pytest.mark.parametrize("mode", JITS)
def test_scanned_decoder_activation_gradients_equal_python_loop(mode: str) -> None:
    scanned = Scanned(nnx.Rngs(0, dropout=1))
    looped = Looped(scanned)
    x = jax.random.normal(jax.random.key(2), (3, D))
    loss, _, got = JITS[mode](lambda m, x: hx.value_and_grad(sq_loss)(m, x))(scanned, x)
    loss2, _, want = hx.value_and_grad(sq_loss)(looped, x)
    close(loss, loss2)
    for name in ("attn", "mlp"):
        for i in range(L):
            close(got[f"layers/{name}"][0][i], want[f"layers/{i}/{name}"][0])
    assert_clean()


# ---- the jax.jit(forward)(model, cache, tokens) pattern of public NNX model code ----------


class Decoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(16, D, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(2)])
        self.out = nnx.Linear(D, 16, rngs=rngs)

    def __call__(self, tokens: jax.Array, cache: dict[str, jax.Array]) -> tuple[Any, Any]:
        h = self.embed(tokens)
        new_cache = {}
        for i, b in enumerate(self.blocks):
            h = b(h) + cache[f"k{i}"]
            new_cache[f"k{i}"] = h
        return self.out(h), new_cache


@jax.jit
def forward(model: Decoder, cache: dict, tokens: jax.Array) -> tuple[Any, Any]:
    return model(tokens, cache)


def hand_forward(model: Decoder, cache: dict, tokens: jax.Array) -> dict[str, Any]:
    h = model.embed.embedding[...][tokens]
    acts: dict[str, Any] = {"embed": h}
    for i, b in enumerate(model.blocks):
        acts[f"blocks/{i}"] = h @ b.kernel[...] + b.bias[...]
        h = acts[f"blocks/{i}"] + cache[f"k{i}"]
    acts["out"] = h @ model.out.kernel[...] + model.out.bias[...]
    return acts


def test_jax_jit_forward_with_model_and_cache_arguments() -> None:
    model = Decoder(nnx.Rngs(0))
    cache = {f"k{i}": jnp.full((2, 5, D), 0.1 * i) for i in range(2)}
    tokens = jnp.arange(10).reshape(2, 5) % 16
    traces = []
    fwd = jax.jit(lambda m, c, t: (traces.append(1), forward(m, c, t))[1])
    for _ in range(3):
        (logits, _), acts = hx.capture(fwd)(model, cache, tokens)
    assert len(traces) == 1  # capture again hits the cache
    want = hand_forward(model, cache, tokens)
    for key in ("embed", "blocks/0", "blocks/1", "out"):
        (got,) = acts[key]
        close(got, want[key])
    logits2, cache2 = acts[""][0]
    close(logits2, logits)
    assert set(cache2) == {"k0", "k1"}
    # The activation gradients through the same jitted forward.
    _, _, ag = hx.value_and_grad(lambda m, c, t: forward(m, c, t)[0].sum(), where="out")(
        model, cache, tokens
    )
    close(ag["out"][0], jnp.ones((2, 5, 16)))
    # Outside the capture the jitted forward runs without marks, and retraces once.
    logits3, _ = fwd(model, cache, tokens)
    close(logits3, logits)
    assert len(traces) == 2
    assert_clean()


# ---- transforms inside the model --------------------------------------------------------


class Inside(nnx.Module):
    def __init__(self, how: str, rngs: nnx.Rngs) -> None:
        self.how = how
        self.a = nnx.Linear(D, D, rngs=rngs)
        self.b = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.how == "vmap":
            return jax.vmap(self.a)(x)
        if self.how == "map":
            return jax.lax.map(self.a, x)
        if self.how == "checkpoint":
            return jax.checkpoint(lambda x: self.b(jnp.sin(self.a(x))))(x)
        if self.how == "cond":
            return jax.lax.cond(x.sum() > 0, self.a, lambda x: -x, x)
        if self.how == "fori":
            return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(self.a(h)), x)
        if self.how == "while":
            body = lambda c: (jnp.tanh(self.a(c[0])), c[1] + 1)  # noqa: E731
            return jax.lax.while_loop(lambda c: c[1] < 3, body, (x, 0))[0]
        if self.how == "custom_jvp":
            f = jax.custom_jvp(lambda x: self.a(x))
            f.defjvp(lambda p, t: (f(p[0]), 2.0 * t[0]))
            return f(x)
        raise AssertionError(self.how)


def expected_inside(m: Inside, x: jax.Array) -> dict[str, list[Any]]:
    lin = lambda mod, x: x @ mod.kernel[...] + mod.bias[...]  # noqa: E731
    if m.how in ("vmap", "map", "custom_jvp"):
        return {"a": [lin(m.a, x)], "": [lin(m.a, x)]}
    if m.how == "checkpoint":
        y = lin(m.b, jnp.sin(lin(m.a, x)))
        return {"a": [lin(m.a, x)], "b": [y], "": [y]}
    if m.how == "cond":  # x.sum() > 0: the branch with self.a ran
        return {"a": [lin(m.a, x)], "": [lin(m.a, x)]}
    hs, h = [], x
    for _ in range(3):
        hs.append(lin(m.a, h))
        h = jnp.tanh(hs[-1])
    if m.how == "fori":  # a static trip count: a scan, values stacked
        return {"a": [jnp.stack(hs)], "": [h]}
    return {"a": [hs[-1]], "": [h]}  # while: the last iteration's value


@pytest.mark.parametrize(
    "how", ["vmap", "map", "checkpoint", "cond", "fori", "while", "custom_jvp"]
)
@pytest.mark.parametrize("jit", [False, True])
def test_transforms_inside_the_model(how: str, jit: bool) -> None:
    m = Inside(how, nnx.Rngs(0))
    x = jnp.abs(jax.random.normal(jax.random.key(1), (4, D)))
    f = jax.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    _, acts = hx.capture(f)(m, x)
    want = expected_inside(m, x)
    assert set(acts) == set(want)
    for k, vs in want.items():
        assert len(acts[k]) == len(vs)
        for got, w in zip(acts[k], vs):
            close(got, w)
    assert_clean()


@pytest.mark.parametrize("how", ["vmap", "map", "checkpoint", "cond", "fori"])
def test_activation_gradients_inside_the_model(how: str) -> None:
    m = Inside(how, nnx.Rngs(0))
    x = jnp.abs(jax.random.normal(jax.random.key(1), (4, D)))

    def loss(m: Inside, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sin(m(x)))

    _, _, ag = hx.value_and_grad(loss, where="a")(m, x)
    # By hand: add a probe to the output of `a` where it runs and differentiate.
    (a_out,) = expected_inside(m, x)["a"]
    probe = jnp.zeros_like(a_out)
    if how in ("vmap", "map", "checkpoint", "cond"):
        lin_a = lambda x: x @ m.a.kernel[...] + m.a.bias[...]  # noqa: E731
        fns = {
            "vmap": lambda p: jnp.sum(jnp.sin(lin_a(x) + p)),
            "map": lambda p: jnp.sum(jnp.sin(lin_a(x) + p)),
            "checkpoint": lambda p: jnp.sum(
                jnp.sin(jnp.sin(lin_a(x) + p) @ m.b.kernel[...] + m.b.bias[...])
            ),
            "cond": lambda p: jnp.sum(jnp.sin(lin_a(x) + p)),
        }
        close(ag["a"][0], jax.grad(fns[how])(probe))
    else:
        lin_a = lambda x: x @ m.a.kernel[...] + m.a.bias[...]  # noqa: E731

        def fori(p: jax.Array) -> jax.Array:
            h = x
            for i in range(3):
                h = jnp.tanh(lin_a(h) + p[i])
            return jnp.sum(jnp.sin(h))

        close(ag["a"][0], jax.grad(fori)(probe))
    assert_clean()


def test_cond_branch_not_taken_reads_nan() -> None:
    m = Inside("cond", nnx.Rngs(0))
    x = -jnp.ones((2, D))  # x.sum() < 0: the branch without self.a runs
    _, acts = jax.jit(hx.capture(m))(x)
    assert np.isnan(np.asarray(acts["a"][0])).all()
    close(acts[""][0], -x)


def test_errors_name_the_call_site_and_the_transform() -> None:
    m = Inside("while", nnx.Rngs(0))
    with pytest.raises(hx.HookaxError, match=r"call site 'a'.*while_loop.*where="):
        hx.value_and_grad(lambda m, x: m(x).sum())(m, jnp.ones((2, D)))
    m = Inside("custom_jvp", nnx.Rngs(0))
    with pytest.raises(hx.HookaxError, match=r"call site 'a'.*custom derivative"):
        hx.value_and_grad(lambda m, x: m(x).sum())(m, jnp.ones((2, D)))
    assert_clean()


# ---- Equinox and Linen ------------------------------------------------------------------


def test_equinox_vmap_of_self_linear() -> None:
    eqx = pytest.importorskip("equinox")

    class E(eqx.Module):
        lin: Any

        def __init__(self, key: jax.Array) -> None:
            self.lin = eqx.nn.Linear(D, D, key=key)

        def __call__(self, x: jax.Array) -> jax.Array:
            return jax.vmap(self.lin)(x)

    e = E(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, D))
    want = x @ e.lin.weight.T + e.lin.bias
    for f in (lambda e, x: e(x), eqx.filter_jit(lambda e, x: e(x))):
        _, acts = hx.capture(f)(e, x)
        close(acts["lin"][0], want)
        _, _, ag = hx.value_and_grad(lambda e, x: jnp.sum(e(x) ** 2), where="lin")(e, x)
        close(ag["lin"][0], 2 * want)
    assert_clean()


def test_linen_scan_and_vmap() -> None:
    nn = pytest.importorskip("flax.linen")

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return jnp.tanh(nn.Dense(D)(c)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            c, _ = scan(name="cells")(x, None)
            heads = nn.vmap(
                nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=0
            )
            return heads(2, name="heads")(jnp.stack([c, -c]))

    net = Net()
    x = jnp.ones((4, D))
    params = net.init(jax.random.key(0), x)
    p = params["params"]
    hs, h = [], x
    for i in range(3):
        hs.append(h @ p["cells"]["Dense_0"]["kernel"][i] + p["cells"]["Dense_0"]["bias"][i])
        h = jnp.tanh(hs[-1])
    stacked = jnp.stack([h, -h])
    heads = jnp.einsum("bnd,bde->bne", stacked, p["heads"]["kernel"]) + p["heads"]["bias"][:, None]
    for f in (lambda p, x: net.apply(p, x), jax.jit(lambda p, x: net.apply(p, x))):
        _, acts = hx.capture(f)(params, x)
        close(acts["cells/Dense_0"][0], jnp.stack(hs))
        close(acts["heads"][0], heads)
        close(acts[""][0], heads)
    assert_clean()


# ---- shard_map and sharded models ---------------------------------------------------------


def test_shard_map_inside_the_model_stacks_per_shard_values() -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("data",))
    lin = nnx.Linear(D, 4, rngs=nnx.Rngs(0))

    class M(nnx.Module):
        def __init__(self) -> None:
            self.lin = lin

        def __call__(self, x: jax.Array) -> jax.Array:
            g, st = nnx.split(self.lin)

            def body(st: Any, x: jax.Array) -> jax.Array:
                return nnx.merge(g, st)(x)

            sm = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
            return sm(st, x)

    x = jax.device_put(jnp.ones((32, D)), NamedSharding(mesh, P("data")))
    for f in (lambda m, x: m(x), jax.jit(lambda m, x: m(x))):
        _, acts = hx.capture(f, where=nnx.Linear)(M(), x)
        (per_shard,) = acts["lin"]  # merged inside the body: the path it was split from
        assert per_shard.shape == (4, 8, 4)
        assert per_shard.sharding.spec[0] == "data"
        close(per_shard.reshape(32, 4), lin(x))


# ---- selectors ----------------------------------------------------------------------------


def test_where_that_matches_nothing_raises_with_nearest_paths() -> None:
    m = Decoder(nnx.Rngs(0))
    cache = {f"k{i}": jnp.zeros((1, 3, D)) for i in range(2)}
    t = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(hx.SelectorError, match=r"matched no call site.*'blocks/0'"):
        hx.capture(m, where="blocks/9")(t, cache)
    with pytest.raises(hx.SelectorError, match=r"glob 'blockz/1' matched no call site"):
        hx.capture(m, where=hx.Select(paths=("blocks/0", "blockz/1")))(t, cache)
    with pytest.raises(hx.SelectorError, match="malformed path glob 'blocks/\\['"):
        hx.capture(m, where="blocks/[")
    with pytest.raises(hx.SelectorError, match="matched no call site"):
        hx.value_and_grad(lambda m, t, c: m(t, c)[0].sum(), where="nope")(m, t, cache)
    assert_clean()


def test_where_module_instance_and_list_of_classes() -> None:
    m = Decoder(nnx.Rngs(0))
    cache = {f"k{i}": jnp.zeros((1, 3, D)) for i in range(2)}
    t = jnp.zeros((1, 3), jnp.int32)
    for f in (lambda m, t, c: m(t, c), jax.jit(lambda m, t, c: m(t, c))):
        _, acts = hx.capture(f, where=m.blocks[1])(m, t, cache)
        assert list(acts) == ["blocks/1"]
        _, acts = hx.capture(f, where=[nnx.Embed, nnx.Linear])(m, t, cache)
        assert list(acts) == ["embed", "blocks/0", "blocks/1", "out"]


@pytest.mark.parametrize("jit", [False, True])
def test_intercept_and_hooks_where_matching_nothing_raise(jit: bool) -> None:
    m = Decoder(nnx.Rngs(0))
    cache = {f"k{i}": jnp.zeros((1, 3, D)) for i in range(2)}
    t = jnp.zeros((1, 3), jnp.int32)
    f = jax.jit(lambda m, t, c: m(t, c)) if jit else (lambda m, t, c: m(t, c))

    def ident(next_fun: Any, args: Any, kwargs: Any, ctx: Any) -> Any:
        return next_fun(*args, **kwargs)

    bad_intercept = hx.intercept(ident, where="blockz/*")
    match = r"hx.intercept\(where='blockz/\*'\).*'blocks/"
    with pytest.raises(hx.SelectorError, match=match), bad_intercept:  # raised as it ends
        f(m, t, cache)
    bad_hooks = hx.hooks(where=nnx.Conv, forward=lambda mod, a, out: None)
    with (
        pytest.raises(hx.SelectorError, match=r"hx.hooks\(where=.*matched no call site"),
        bad_hooks,
    ):
        f(m, t, cache)
    with hx.intercept(ident, where="blocks/*"):  # matches: no error
        f(m, t, cache)
    assert_clean()


def test_no_tracer_leaks() -> None:
    scanned = Scanned(nnx.Rngs(0, dropout=1))
    x = jnp.ones((3, D))
    with jax.checking_leaks():
        for f in (lambda m, x: m(x), jax.jit(lambda m, x: m(x)), nnx.jit(lambda m, x: m(x))):
            hx.capture(f)(scanned, x)
            hx.value_and_grad(lambda m, x, f=f: f(m, x).sum())(scanned, x)
        for how in ("vmap", "cond", "fori", "while"):
            hx.capture(jax.jit(lambda m, x: m(x)))(Inside(how, nnx.Rngs(0)), x)
    assert_clean()


def test_blocks_without_where_never_raise_when_only_other_methods_ran() -> None:
    class WithMethod(nnx.Module):
        def __init__(self) -> None:
            self.lin = nnx.Linear(D, D, rngs=nnx.Rngs(0))

        def encode(self, x: jax.Array) -> jax.Array:
            return 2 * x

    m = WithMethod()
    with hx.hooks(forward=lambda mod, a, out: None), hx.intercept(lambda f, a, k, c: f(*a, **k)):
        m.encode(jnp.ones(D))  # only a method that is not __call__ ran: where=None is no error
    assert_clean()
