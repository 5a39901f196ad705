"""Operations inside methods other than ``__call__`` (EasyDeL's attention computes in
``forward``, its linears in ``native_forward``): listed by ``hx.ops``, matched by ``ops=`` globs
that name no method, captured and edited, against the same attention computed by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

D = 4
X = jnp.linspace(-1.0, 1.0, 2 * 3 * D).reshape(2, 3, D)


class Lin(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) / 2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.native_forward(x)

    def native_forward(self, x: jax.Array) -> jax.Array:
        return x @ self.w[...]


class Attn(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.q = Lin(rngs)
        self.k = Lin(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.forward(x)

    def forward(self, x: jax.Array) -> jax.Array:
        probs = jax.nn.softmax(jnp.einsum("btd,bsd->bts", self.q(x), self.k(x)), axis=-1)
        return x + jnp.einsum("bts,bsd->btd", probs, x)


class Net(nnx.Module):
    def __init__(self) -> None:
        self.layers = nnx.List([Attn(nnx.Rngs(i)) for i in range(2)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


def by_hand(model: Net, x: jax.Array, edit=None):
    """Each layer's attention probabilities and the output; ``edit(i, probs)``."""
    probs = []
    for i, layer in enumerate(model.layers):
        s = jnp.einsum("btd,bsd->bts", x @ layer.q.w[...], x @ layer.k.w[...])
        p = jax.nn.softmax(s, axis=-1)
        if edit is not None:
            p = edit(i, p)
        probs.append(p)
        x = x + jnp.einsum("bts,bsd->btd", p, x)
    return probs, x


def _run(mode, fn, model, x):
    if mode == "eager":
        return fn(model, x)
    return (jax.jit if mode == "jax.jit" else nnx.jit)(fn)(model, x)


def test_ops_lists_the_operations_of_every_method():
    addresses = hx.ops(Net(), X).addresses
    for i in range(2):
        assert f"layers/{i}:forward:softmax" in addresses
        assert f"layers/{i}/q:native_forward:dot_general" in addresses
    # where= without methods lists every method of the call sites it names
    assert hx.ops(Net(), X, where="layers/0/q").addresses == [
        "layers/0/q:native_forward:dot_general"
    ]
    # a key with its method, as hx.ops writes it, is a where= of its own
    assert "layers/1:forward:softmax" in hx.ops(Net(), X, where="layers/1:forward").addresses


@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
def test_globs_without_a_method_capture_and_edit_operations_in_other_methods(mode):
    model = Net()
    want, _ = by_hand(model, X)

    def f(m, x):
        return hx.capture(m, ops="**:softmax")(x)

    _, acts = _run(mode, f, model, X)
    assert sorted(acts) == ["layers/0:forward:softmax", "layers/1:forward:softmax"]
    for i in range(2):
        np.testing.assert_allclose(acts[f"layers/{i}:forward:softmax"][0], want[i], rtol=1e-6)

    def g(m, x):
        with hx.intercept_op(lambda p, op: p.at[..., 0].set(1.0), ops="layers/1:softmax"):
            return m(x)

    _, edited = by_hand(model, X, lambda i, p: p.at[..., 0].set(1.0) if i == 1 else p)
    np.testing.assert_allclose(_run(mode, g, model, X), edited, rtol=1e-6)


def test_capture_where_a_method_key():
    model = Net()
    _, acts = hx.capture(model, where="layers/0:forward")(X)
    layer0 = model.layers[0]
    probs, _ = by_hand(model, X)
    want = X + jnp.einsum("bts,bsd->btd", probs[0], X)
    assert list(acts) == ["layers/0:forward"]
    np.testing.assert_allclose(acts["layers/0:forward"][0], want, rtol=1e-6)
    np.testing.assert_allclose(acts["layers/0:forward"][0], layer0(X), rtol=1e-6)
