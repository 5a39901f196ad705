"""hx.value_and_grad: gradients of call-site outputs, against perturb and analytic values."""

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

W = 4

JIT = {"eager": lambda f: f, "jax.jit": jax.jit, "nnx.jit": nnx.jit}


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(W, W, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.lin(x))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([Block(rngs) for _ in range(2)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


class PerturbMLP(MLP):
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = self.perturb(f"layer{i}", layer(x))
        return x


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def mse_arrays(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((out - y) ** 2)


@pytest.fixture
def data() -> tuple[jax.Array, jax.Array]:
    return (
        jax.random.normal(jax.random.key(1), (5, W)),
        jax.random.normal(jax.random.key(2), (5, W)),
    )


def assert_clean() -> None:
    assert _context.active_entries() == ()
    assert _tags.depth() == 0


@pytest.mark.parametrize("mode", JIT)
def test_analytic_mse(mode: str, data: Any) -> None:
    """A linear model: d mean((out - y)**2) / d out is exactly 2 (out - y) / out.size."""
    x, y = data
    lin = nnx.Linear(W, W, rngs=nnx.Rngs(0))
    loss, grads, act_grads = JIT[mode](hx.value_and_grad(mse))(lin, x, y)
    out = x @ lin.kernel[...] + lin.bias[...]
    np.testing.assert_allclose(loss, jnp.mean((out - y) ** 2), rtol=1e-6)
    assert list(act_grads) == [""] and len(act_grads[""]) == 1
    np.testing.assert_allclose(act_grads[""][0], 2 * (out - y) / out.size, rtol=1e-5)
    # grads: exactly what nnx.value_and_grad returns.
    _, ref = nnx.value_and_grad(mse)(lin, x, y)
    assert jax.tree.structure(grads) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert_clean()


@pytest.mark.parametrize("mode", JIT)
def test_equals_perturb(mode: str, data: Any) -> None:
    x, y = data
    model, pmodel = MLP(nnx.Rngs(0)), PerturbMLP(nnx.Rngs(0))
    loss, grads, act_grads = JIT[mode](hx.value_and_grad(mse, where=Block))(model, x, y)

    _, perturbations = nnx.capture(pmodel, nnx.Perturbation)(x)

    def ploss(m: Any, p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        out, _ = nnx.capture(m, nnx.Intermediate, init=p)(x)
        return jnp.mean((out - y) ** 2)

    ploss_value, (pgrads, pact) = nnx.value_and_grad(ploss, argnums=(0, 1))(
        pmodel, perturbations, x, y
    )
    np.testing.assert_allclose(loss, ploss_value, rtol=1e-6)
    assert sorted(act_grads) == ["layers/0", "layers/1"]
    for i in range(2):
        np.testing.assert_allclose(
            act_grads[f"layers/{i}"][0], pact[f"layer{i}"][...], rtol=1e-5, atol=1e-7
        )
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(pgrads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


class Twice(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(W, W, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = self.lin(self.lin(x))
        return h, jnp.argmax(h, axis=-1)


@pytest.mark.parametrize("mode", JIT)
def test_calls_aux_argnums_and_int_outputs(mode: str, data: Any) -> None:
    """Two calls of one call site, has_aux, argnums tuple, an integer output (None gradient)."""
    x, _ = data
    m = Twice(nnx.Rngs(0))

    def loss(m: Twice, x: jax.Array) -> Any:
        h, idx = m(x)
        return jnp.sum(h**2), idx

    (value, idx), (gm, gx), act_grads = JIT[mode](
        hx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    )(m, x)
    k, b = m.lin.kernel[...], m.lin.bias[...]
    h1 = x @ k + b
    h2 = h1 @ k + b
    np.testing.assert_allclose(value, jnp.sum(h2**2), rtol=1e-5)
    np.testing.assert_array_equal(idx, jnp.argmax(h2, axis=-1))
    g2 = 2 * h2
    assert len(act_grads["lin"]) == 2  # one per call, in call order
    np.testing.assert_allclose(act_grads["lin"][1], g2, rtol=1e-5)
    np.testing.assert_allclose(act_grads["lin"][0], g2 @ k.T, rtol=1e-5)
    root_h, root_idx = act_grads[""][0]
    np.testing.assert_allclose(root_h, g2, rtol=1e-5)
    assert root_idx is None
    np.testing.assert_allclose(gx, g2 @ k.T @ k.T, rtol=1e-5)
    np.testing.assert_allclose(gm["lin"]["bias"][...], jnp.sum(g2 + g2 @ k.T, axis=0), rtol=1e-5)


def test_plain_function(data: Any) -> None:
    """No module among the arguments: grads are jax.value_and_grad's."""
    x, y = data
    model = MLP(nnx.Rngs(0))

    def loss(x: jax.Array) -> jax.Array:
        return mse(model, x, y)

    value, gx, act_grads = jax.jit(hx.value_and_grad(loss, where="layers/1"))(x)
    ref_value, ref_gx = jax.value_and_grad(loss)(x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(act_grads["layers/1"][0], 2 * (model(x) - y) / y.size, rtol=1e-5)


def test_trace_counts(data: Any, traces: Any) -> None:
    x, y = data
    model = MLP(nnx.Rngs(0))

    @nnx.jit(static_argnums=3)
    def step(m: MLP, x: jax.Array, y: jax.Array, where: Any) -> Any:
        traces()
        return hx.value_and_grad(mse, where=where)(m, x, y)

    step(model, x, y, Block)
    step(model, x, y, Block)
    assert traces.n == 1
    _, _, act_grads = step(model, x, y, "layers/0")
    assert traces.n == 2 and list(act_grads) == ["layers/0"]


def test_compiled_program_has_no_activation_sized_inputs(data: Any) -> None:
    x, y = data
    model = MLP(nnx.Rngs(0))
    plain = nnx.jit(nnx.value_and_grad(mse))
    ours = nnx.jit(hx.value_and_grad(mse))
    a = plain.lower(model, x, y).compile().memory_analysis()
    b = ours.lower(model, x, y).compile().memory_analysis()
    assert b.argument_size_in_bytes == a.argument_size_in_bytes


class Stack(nnx.Module):
    def __init__(self) -> None:
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key: jax.Array) -> Block:
            return Block(nnx.Rngs(key))

        self.blocks = make(jax.random.split(jax.random.key(0), 2))

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return body(x, self.blocks)


@pytest.mark.parametrize("mode", JIT)
def test_scan_inside_equals_hand_threaded_perturbation(mode: str, data: Any) -> None:
    x, y = data
    stack = Stack()
    _, _, act_grads = JIT[mode](lambda m, x, y: hx.value_and_grad(mse)(m, x, y))(stack, x, y)
    assert_clean()
    kernels, biases = stack.blocks.lin.kernel[...], stack.blocks.lin.bias[...]

    def threaded(p_lin: jax.Array, p_block: jax.Array) -> jax.Array:
        def body(h: jax.Array, xs: Any) -> tuple[jax.Array, None]:
            k, b, pl, pb = xs
            return jnp.tanh(h @ k + b + pl) + pb, None

        out, _ = jax.lax.scan(body, x, (kernels, biases, p_lin, p_block))
        return mse_arrays(out, y)

    zeros = jnp.zeros((2, *x.shape))
    g_lin, g_block = jax.grad(threaded, argnums=(0, 1))(zeros, zeros)
    np.testing.assert_allclose(act_grads["blocks/lin"][0], g_lin, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(act_grads["blocks"][0], g_block, rtol=1e-5, atol=1e-7)
    out = stack(x)
    np.testing.assert_allclose(act_grads[""][0], 2 * (out - y) / y.size, rtol=1e-5)


def test_bad_argnums(data: Any) -> None:
    x, y = data
    with pytest.raises(hx.HookaxError, match=r"argnums=3 names no positional argument"):
        hx.value_and_grad(mse, argnums=3)(MLP(nnx.Rngs(0)), x, y)
    with pytest.raises(hx.HookaxError, match="expects a loss function"):
        hx.value_and_grad(None)  # type: ignore[arg-type]
