"""``hx.capture(..., inputs=True)``: a call site's inputs as its caller passed them (the residual
stream before a block) on NNX, Linen and Equinox, eagerly and under jit, one layer of a scan."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from tests.test_scan_layers import Scanned, X, _kernels


class Res(nnx.Module):
    def __init__(self) -> None:
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(3)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for b in self.blocks:
            x = x + jnp.tanh(b(x))
        return x


@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
def test_nnx_inputs_are_the_residual_stream_before_each_block(mode):
    model = Res()
    forward = hx.capture(lambda m, x: m(x), where="blocks/*", inputs=True)
    forward = {"eager": forward, "jax.jit": jax.jit(forward), "nnx.jit": nnx.jit(forward)}[mode]
    y, acts = forward(model, X)
    keys = [k for i in range(3) for k in (f"blocks/{i}:in", f"blocks/{i}")]
    # In call order eagerly; a jitted function returns a dict with its keys sorted (JAX's way).
    assert list(acts) == (keys if mode == "eager" else sorted(keys))
    h = X
    for i, b in enumerate(model.blocks):
        np.testing.assert_allclose(acts[f"blocks/{i}:in"][0], h, rtol=1e-6)
        np.testing.assert_allclose(acts[f"blocks/{i}"][0], b(h), rtol=1e-6)
        h = h + jnp.tanh(b(h))
    np.testing.assert_allclose(y, h, rtol=1e-6)


class Two(nnx.Module):
    def __call__(self, a, b):
        return a * b


class Outer(nnx.Module):
    """Calls ``two`` with two positional arguments: ``two(x, x + 1)``."""

    def __init__(self):
        self.two = Two()

    def __call__(self, x):
        return self.two(x, x + 1.0)


def test_several_positional_inputs_are_a_tuple_and_gradients_flow():
    m = Outer()
    _, acts = hx.capture(m, where="two", inputs=True)(X)
    a, b = acts["two:in"][0]
    np.testing.assert_allclose(a, X)
    np.testing.assert_allclose(b, X + 1.0)
    # d sum(x * (x + 1)) / d (input of two) by value_and_grad's own plant: the marks are identity.
    g = jax.grad(lambda x: hx.capture(m, where="two", inputs=True)(x)[0].sum())(X)
    np.testing.assert_allclose(g, 2 * X + 1.0, rtol=1e-6)


def test_linen_and_equinox_inputs():
    class LRes(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(4, name="lin")(x * 2.0)

    lm = LRes()
    params = lm.init(jax.random.key(0), X)
    for apply in (lm.apply, jax.jit(lm.apply)):
        _, acts = hx.capture(apply, where="lin", inputs=True)(params, X)
        np.testing.assert_allclose(acts["lin:in"][0], X * 2.0)

    class ERes(eqx.Module):
        lin: eqx.nn.Linear

        def __init__(self):
            self.lin = eqx.nn.Linear(4, 4, key=jax.random.key(1))

        def __call__(self, x):
            return x + self.lin(x * 3.0)

    em = ERes()
    x = jnp.linspace(-1.0, 1.0, 4)
    for run in (
        hx.capture(em, where="lin", inputs=True),
        eqx.filter_jit(hx.capture(em, where="lin", inputs=True)),
    ):
        _, acts = run(x)
        np.testing.assert_allclose(acts["lin:in"][0], x * 3.0, rtol=1e-6)


def test_inputs_of_one_layer_of_a_scanned_stack():
    model = Scanned()
    w, b = _kernels(model)
    _, acts = jax.jit(hx.capture(lambda m, x: m(x), where="blocks/mlp[2]", inputs=True))(model, X)
    assert sorted(acts) == ["blocks/mlp[2]", "blocks/mlp[2]:in"]
    h = X
    for i in range(2):
        h = h + jnp.tanh(h @ w[i] + b[i])
    np.testing.assert_allclose(acts["blocks/mlp[2]:in"][0], h, rtol=1e-5, atol=1e-6)


def test_harvest_stores_inputs_as_capture_records_them(tmp_path):
    model = Res()
    batches = [X, X * 2.0]
    h = hx.harvest(model, batches, where="blocks/1", inputs=True, store=tmp_path / "s.zarr")
    assert sorted(h.names) == ["blocks/1", "blocks/1:in"]
    store = hx.open_store(tmp_path / "s.zarr")
    for i, x in enumerate(batches):
        _, acts = hx.capture(model, where="blocks/1", inputs=True)(x)
        rows = slice(2 * i, 2 * i + 2)
        np.testing.assert_allclose(store.read("blocks/1:in")[rows], acts["blocks/1:in"][0])
        np.testing.assert_allclose(store.read("blocks/1")[rows], acts["blocks/1"][0])
