"""One ``where=`` grammar in every API: a call site's input (``"blocks/1:in"``, TransformerLens'
``resid_pre``) and a part of an output or input (``"layers/*.1"``: the array inside a tuple) in
hooks, capture, value_and_grad, statistics and find_nonfinite, on NNX, Linen and Equinox, eagerly
and under jit, each value against the model unrolled by hand."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from tests.test_capture_inputs import Outer, Res
from tests.test_scan_layers import Scanned, X, _kernels, unrolled


def _run(mode, fn, *args):
    return {"eager": fn, "jax.jit": jax.jit(fn), "nnx.jit": nnx.jit(fn)}[mode](*args)


def _res_by_hand(model, x, at=None, edit=None, upto=None):
    """``Res`` unrolled (``x + tanh(block(x))`` per block); ``edit(h)`` replaces the input of
    block ``at`` (the Linear's, not the residual's); ``upto``: the stream before that block."""
    h = x
    for i, b in enumerate(model.blocks):
        if i == upto:
            return h
        h = h + jnp.tanh(b(edit(h) if i == at else h))
    return h


def _halve(module, args, value):
    return value * 0.5


# ----------------------------------------------------------------------------- inputs, hooks


@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
def test_a_forward_hook_at_an_input_sees_and_replaces_it(mode):
    model = Res()
    seen = []

    def hook(module, args, value):
        seen.append(value.shape)
        return value * 0.5

    with hx.hooks(forward=hook, where="blocks/1:in"):
        y = _run(mode, lambda m, x: m(x), model, X)
    assert seen == [X.shape]  # once: the input of block 1, not its output
    want = _res_by_hand(model, X, at=1, edit=lambda h: h * 0.5)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    np.testing.assert_allclose(model(X), _res_by_hand(model, X), rtol=1e-6)  # gone after


def test_a_registered_hook_at_inputs_and_outputs_is_one_handle():
    model = Res()
    h = X + jnp.tanh(model.blocks[0](X) * 0.5)
    h = h + jnp.tanh(model.blocks[1](h))
    want = h + jnp.tanh(model.blocks[2](h * 0.5))
    handle = hx.register_forward_hook(model, _halve, where=["blocks/2:in", "blocks/0"])
    np.testing.assert_allclose(model(X), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(model, X), want, rtol=1e-6)
    handle.remove()
    np.testing.assert_allclose(model(X), _res_by_hand(model, X), rtol=1e-6)
    assert all(not vars(b).get("_hookax_hooks") for b in model.blocks)


def test_hooks_at_inputs_on_linen_and_equinox():
    class LRes(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(4, name="lin")(x * 2.0)

    lm = LRes()
    params = lm.init(jax.random.key(0), X)

    def dense(x):
        return x @ params["params"]["lin"]["kernel"] + params["params"]["lin"]["bias"]

    for apply in (lm.apply, jax.jit(lm.apply)):
        with hx.hooks(forward=_halve, where="lin:in"):
            y = apply(params, X)
        np.testing.assert_allclose(y, X + dense(X), rtol=1e-6)  # (2x) * 0.5

    class ERes(eqx.Module):
        lin: eqx.nn.Linear

        def __init__(self):
            self.lin = eqx.nn.Linear(4, 4, key=jax.random.key(1))

        def __call__(self, x):
            return x + self.lin(x * 3.0)

    em = ERes()
    x = jnp.linspace(-1.0, 1.0, 4)
    for run in (lambda m, x: m(x), eqx.filter_jit(lambda m, x: m(x))):
        with hx.hooks(forward=_halve, where="lin:in"):
            y = run(em, x)
        np.testing.assert_allclose(y, x + em.lin(x * 1.5), rtol=1e-6)


def test_a_hook_at_one_layer_of_a_scanned_stack_input():
    model = Scanned()
    w, b = _kernels(model)
    with hx.hooks(forward=_halve, where="blocks/mlp[2]:in"):
        y = jax.jit(lambda m, x: m(x))(model, X)
    want = unrolled(w, b, X, pre=lambda i, a: a * 0.5 if i == 2 else a)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_a_hook_at_several_inputs_gets_and_returns_the_tuple():
    m = Outer()
    with hx.hooks(forward=lambda mod, args, v: (v[1], v[0] * 2.0), where="two:in"):
        np.testing.assert_allclose(m(X), (X + 1.0) * X * 2.0, rtol=1e-6)
    first_only = hx.hooks(forward=lambda mod, args, v: v[0], where="two:in")
    with pytest.raises(hx.HookError, match="2 positional arguments"), first_only:
        m(X)
    np.testing.assert_allclose(m(X), X * (X + 1.0), rtol=1e-6)


def test_input_names_that_cannot_work_say_what_does():
    model = Res()
    with pytest.raises(hx.SelectorError, match=r"grad_input.*where='blocks/1'"):
        hx.register_full_backward_hook(model, lambda m, gi, go: None, where="blocks/1:in")
    assert all(not vars(b).get("_hookax_hooks") for b in model.blocks)
    typo = hx.hooks(forward=_halve, where="blocks/7:in")
    with pytest.raises(hx.SelectorError, match="'blocks/7:in'"), typo:
        model(X)
    with pytest.raises(
        hx.SelectorError, match=r"input of call site 'blocks/1'.*where='blocks/1:in'"
    ):
        hx.capture(model, ops="blocks/1:in")


# ------------------------------------------------------- inputs, statistics and find_nonfinite


def _loss(m, x):
    return jnp.sum(m(x) ** 2)


def test_statistics_of_an_input_are_those_of_the_input_and_its_gradient():
    model = Res()
    _, _, stats = hx.value_grad_and_stats(_loss, where="blocks/1:in", stats=("norm", "max_abs"))(
        model, X
    )
    _, acts = hx.capture(model, where="blocks/1:in")(X)
    _, _, grads = hx.value_and_grad(_loss, where="blocks/1:in")(model, X)
    value, grad = np.asarray(acts["blocks/1:in"][0]), np.asarray(grads["blocks/1:in"][0])
    np.testing.assert_allclose(value, _res_by_hand(model, X, upto=1), rtol=1e-6)
    s = stats["blocks/1:in"]
    np.testing.assert_allclose(float(s["act"]["norm"]), np.linalg.norm(value), rtol=1e-5)
    np.testing.assert_allclose(float(s["act"]["max_abs"]), np.abs(value).max(), rtol=1e-6)
    np.testing.assert_allclose(float(s["grad"]["norm"]), np.linalg.norm(grad), rtol=1e-5)


def test_find_nonfinite_names_an_input():
    model = Res()
    bad = X.at[0, 0].set(jnp.nan)
    assert hx.find_nonfinite(_loss, model, X, where="blocks/1:in") is None
    found = hx.find_nonfinite(_loss, model, bad, where=["blocks/0:in", "blocks/1"])
    assert found.key == "blocks/0:in" and found.count == 1
    assert str(found) == "forward: the input of 'blocks/0' holds 1 non-finite value"


# ------------------------------------------------------------------------------------ parts


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, cache, x):
        return cache + 1.0, x + jnp.tanh(self.lin(x))


class Pairs(nnx.Module):
    def __init__(self):
        self.layers = nnx.List([Layer(nnx.Rngs(i)) for i in range(2)])

    def __call__(self, x):
        cache = jnp.zeros(())
        for layer in self.layers:
            cache, x = layer(cache, x)
        return x * cache


def _metric(m, x):
    return m(x)[0, -1]


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_a_part_is_the_same_value_in_capture_gradients_and_statistics(mode):
    m = Pairs()
    _, whole = hx.capture(m, where="layers/*")(X)
    _, parts = _run(mode, hx.capture(lambda m, x: m(x), where="layers/*.1"), m, X)
    assert sorted(parts) == ["layers/0.1", "layers/1.1"]
    _, _, g_whole = hx.value_and_grad(_metric, where="layers/*")(m, X)
    _, _, g_parts = _run(mode, hx.value_and_grad(_metric, where="layers/*.1"), m, X)
    _, _, stats = _run(mode, hx.value_grad_and_stats(_metric, where="layers/*.1"), m, X)
    for i in range(2):
        np.testing.assert_array_equal(parts[f"layers/{i}.1"][0], whole[f"layers/{i}"][0][1])
        np.testing.assert_allclose(g_parts[f"layers/{i}.1"][0], g_whole[f"layers/{i}"][0][1])
        value = np.asarray(whole[f"layers/{i}"][0][1])
        s = stats[f"layers/{i}.1"]
        np.testing.assert_allclose(float(s["act"]["norm"]), np.linalg.norm(value), rtol=1e-5)
        grad = np.asarray(g_whole[f"layers/{i}"][0][1])
        np.testing.assert_allclose(float(s["grad"]["max_abs"]), np.abs(grad).max(), rtol=1e-5)
    # the cache (part .0) is not measured: its values would change the statistics
    assert float(stats["layers/1.1"]["act"]["max_abs"]) < 1.0 + np.abs(X).max()


def test_whole_and_part_entries_together_and_a_part_of_an_input():
    m = Pairs()
    _, acts = hx.capture(m, where=["layers/0", "layers/1.0", "layers/1.1:in"])(X)
    assert sorted(acts) == ["layers/0", "layers/1.0", "layers/1.1:in"]
    np.testing.assert_allclose(acts["layers/1.0"][0], 2.0)
    np.testing.assert_array_equal(acts["layers/1.1:in"][0], acts["layers/0"][0][1])


def test_parts_on_linen_and_equinox():
    class LLayer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return {"h": nn.Dense(4)(x), "aux": x.sum()}

    class LModel(nn.Module):
        @nn.compact
        def __call__(self, x):
            return LLayer(name="layer")(x)["h"]

    lm = LModel()
    params = lm.init(jax.random.key(0), X)
    _, acts = hx.capture(jax.jit(lm.apply), where="layer.h")(params, X)
    np.testing.assert_allclose(acts["layer.h"][0], lm.apply(params, X), rtol=1e-6)

    class ELayer(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return x, self.lin(x)

    class EModel(eqx.Module):
        layer: ELayer

        def __call__(self, x):
            return self.layer(x)[1] * 2.0

    em = EModel(ELayer(eqx.nn.Linear(4, 4, key=jax.random.key(2))))
    x = jnp.linspace(-1.0, 1.0, 4)

    def loss(m, x):
        return jnp.sum(m(x))

    _, _, g = eqx.filter_jit(hx.value_and_grad(loss, where="layer.1"))(em, x)
    np.testing.assert_allclose(g["layer.1"][0], jnp.full(4, 2.0))


def test_a_part_of_one_layer_of_a_scanned_program():
    def block(x, w):
        return w.sum(), jnp.tanh(x @ w)

    def forward(ws, x):
        def body(h, w):
            _, h = block(h, w)
            return h, None

        return jax.lax.scan(body, x, ws)[0]

    ws = jnp.stack([jnp.eye(4) * (i + 1) for i in range(3)])
    _, acts = hx.capture(forward, where="block[1].1")(ws, X)
    want = jnp.tanh(jnp.tanh(X @ ws[0]) @ ws[1])
    np.testing.assert_allclose(acts["block[1].1"][0], want, rtol=1e-6)


def test_a_part_that_is_not_there_names_the_parts():
    with pytest.raises(hx.SelectorError, match=r"part '\.5'.*'\.0', '\.1'"):
        hx.capture(Pairs(), where="layers/*.5")(X)


def test_harvest_and_find_nonfinite_take_parts(tmp_path):
    m = Pairs()
    h = hx.harvest(m, [X, X * 2.0], where="layers/*.1", store=tmp_path / "s.zarr")
    assert sorted(h.names) == ["layers/0.1", "layers/1.1"]
    store = hx.open_store(tmp_path / "s.zarr")
    for i, x in enumerate([X, X * 2.0]):
        _, acts = hx.capture(m, where="layers/1")(x)
        np.testing.assert_array_equal(
            store.read("layers/1.1")[2 * i : 2 * i + 2], acts["layers/1"][0][1]
        )
    found = hx.find_nonfinite(_metric, m, X.at[0, 0].set(jnp.inf), where="layers/*.1")
    assert (found.phase, found.key, found.count) == ("forward", "layers/0.1", 1)


# ------------------------------------------------- an output that holds one array twice (tied)


class Tied(eqx.Module):
    shared: eqx.nn.Shared

    def __init__(self, key):
        emb = eqx.nn.Embedding(16, 8, key=key)
        head = eqx.nn.Linear(8, 16, use_bias=False, key=key)
        self.shared = eqx.nn.Shared((emb, head), lambda p: p[1].weight, lambda p: p[0].weight)

    def __call__(self, t):
        emb, head = self.shared()
        assert emb.weight is head.weight, "Error with weight tying"  # the model's own check
        return jax.vmap(head)(jax.vmap(emb)(t))


def _tied_loss(m, t):
    return jnp.mean(m(t) ** 2)


def test_tied_weights_stay_one_array_in_every_api():
    m, t = Tied(jax.random.key(0)), jnp.arange(5)
    want_loss, want_grads = eqx.filter_value_and_grad(_tied_loss)(m, t)
    assert hx.find_nonfinite(_tied_loss, m, t) is None
    for run in (hx.value_and_grad(_tied_loss), eqx.filter_jit(hx.value_and_grad(_tied_loss))):
        loss, grads, act_grads = run(m, t)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        # d loss / d (the tied array) once, at both places: the total over both uses
        emb, head = act_grads["shared"][0]
        np.testing.assert_array_equal(emb.weight, head.weight)
    _, _, stats = hx.value_grad_and_stats(_tied_loss, where="shared")(m, t)
    weight = np.asarray(m.shared()[0].weight)
    np.testing.assert_allclose(
        float(stats["shared"]["act"]["norm"]), np.linalg.norm(weight), rtol=1e-5
    )
    bad = eqx.tree_at(
        lambda m: m.shared.pytree[0].weight, m, m.shared.pytree[0].weight.at[3, 0].set(jnp.inf)
    )
    found = hx.find_nonfinite(_tied_loss, bad, t, where="shared")
    assert (found.phase, found.key, found.count) == ("forward", "shared", 1)


def test_a_call_returning_one_array_twice_keeps_it_one_object():
    class Dup(nnx.Module):
        def __call__(self, x):
            h = jnp.tanh(x)
            return h, h

    class Outer(nnx.Module):
        def __init__(self):
            self.dup = Dup()

        def __call__(self, x):
            a, b = self.dup(x)
            assert a is b
            return a * 2.0

    m = Outer()
    _, acts = hx.capture(m, where="dup")(X)
    np.testing.assert_array_equal(acts["dup"][0][0], jnp.tanh(X))
    _, _, g = jax.jit(hx.value_and_grad(lambda m, x: m(x).sum(), where="dup"))(m, X)
    np.testing.assert_allclose(g["dup"][0][0], jnp.full(X.shape, 2.0))
