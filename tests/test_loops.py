"""Loops of real LLMs: checks around a jit cache hit, and capture of edited values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx


def _two_layers() -> nnx.Sequential:
    return nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 4, rngs=nnx.Rngs(1)))


def _double(next_fun, args, kwargs, ctx):
    return next_fun(*args, **kwargs) * 2


def test_no_false_selector_error_on_a_jit_cache_hit(traces):
    """The issue's repro: layer 1 runs only inside an already-compiled jitted function, while
    layer 0 runs eagerly in the block; the edit applies and nothing is raised."""
    m = _two_layers()
    x = jnp.arange(8.0).reshape(2, 4)

    @jax.jit
    def g(m, x):
        traces()
        return m(x) + 0

    want = m.layers[1](m.layers[0](x)) * 2
    for _ in range(3):
        with hx.intercept(lambda nf, a, k, c: nf(*a, **k) * 2, where="layers/1"):
            m.layers[0](x)
            y = g(m, x)
        np.testing.assert_allclose(y, want, rtol=1e-6)
    assert traces.n == 1
    np.testing.assert_allclose(g(m, x), m.layers[1](m.layers[0](x)), rtol=1e-6)  # new key


def test_a_wrong_where_still_raises_next_to_a_cache_hit():
    m = _two_layers()
    x = jnp.ones((2, 4))
    g = jax.jit(lambda m, x: m(x))
    with hx.intercept(_double, where="layers/1"):
        g(m, x)
    with pytest.raises(hx.SelectorError, match="layers/7"), hx.intercept(_double, where="layers/7"):
        m.layers[0](x)
        g(m, x)


class _Decoder(nnx.Module):
    """A sampler's shape: ``init_cache`` runs eagerly, then a jitted step calls the model."""

    def __init__(self) -> None:
        self.embed = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.out = nnx.Linear(4, 4, rngs=nnx.Rngs(1))

    def init_cache(self, batch: int) -> jax.Array:
        return jnp.zeros((batch, 4))

    def __call__(self, x: jax.Array, cache: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.embed(x) + cache))


def test_a_sampler_that_inits_its_cache_eagerly_then_runs_a_jitted_loop(traces):
    model = _Decoder()
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)

    @nnx.jit
    def sample(model, x, cache):
        traces()

        def body(i, c):
            return model(x, c)

        return jax.lax.fori_loop(0, 3, body, cache)

    def by_hand(cache):
        for _ in range(3):
            cache = model.out(jnp.tanh(model.embed(x) + cache)) * 2
        return cache

    for _ in range(2):
        with hx.intercept(_double, where="out"):
            cache = model.init_cache(2)
            y = sample(model, x, cache)
        np.testing.assert_allclose(y, by_hand(jnp.zeros((2, 4))), rtol=1e-5)
    assert traces.n == 1


def _steer(next_fun, args, kwargs, ctx):
    return next_fun(*args, **kwargs) + 10.0


@pytest.mark.parametrize("way", ["eager", "jax.jit", "nnx.jit"])
def test_capture_inside_an_intercept_records_the_edited_value(way):
    m = _two_layers()
    x = jnp.arange(8.0).reshape(2, 4)
    edited = m.layers[0](x) @ m.layers[1].kernel[...] + m.layers[1].bias[...] + 10.0

    def f(m, x):
        return m(x)

    forward = hx.capture(f, where="layers/1")
    if way == "jax.jit":
        forward = jax.jit(forward)
    elif way == "nnx.jit":
        forward = nnx.jit(forward)
    # The intercept around the capture, and inside the captured function: the same record.
    with hx.intercept(_steer, where="layers/1"):
        y, acts = forward(m, x)
    np.testing.assert_allclose(acts["layers/1"][0], edited, rtol=1e-6)
    np.testing.assert_allclose(y, edited, rtol=1e-6)

    def g(m, x):
        with hx.intercept(_steer, where="layers/1"):
            return m(x)

    inner = hx.capture(g, where="layers/1")
    inner = {"eager": inner, "jax.jit": jax.jit(inner), "nnx.jit": nnx.jit(inner)}[way]
    _, acts2 = inner(m, x)
    np.testing.assert_allclose(acts2["layers/1"][0], edited, rtol=1e-6)


def test_activation_gradients_inside_an_intercept_are_of_the_edited_value():
    """d loss / d (what the caller received): with the edit ``out * 3``, the gradient of
    ``sum(out)`` with respect to the recorded (edited) output is 1, not 3."""
    m = _two_layers()
    x = jnp.ones((2, 4))

    def loss(m, x):
        return m(x).sum()

    with hx.intercept(lambda nf, a, k, c: nf(*a, **k) * 3, where="layers/1"):
        _, _, act_grads = hx.value_and_grad(loss, where="layers/1")(m, x)
    np.testing.assert_allclose(act_grads["layers/1"][0], jnp.ones((2, 4)))
