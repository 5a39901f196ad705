"""hx.find_nonfinite: the first NaN/Inf, forward then backward, in one compiled pass."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from tests import models

W = 4


@jax.custom_vjp
def poisoned_grad(h: jax.Array, poison: jax.Array) -> jax.Array:
    """The identity; its gradient is NaN where ``poison`` is 1 (a backward-only NaN)."""
    return h


def _fwd(h: jax.Array, poison: jax.Array) -> Any:
    return h, poison


def _bwd(poison: jax.Array, ct: jax.Array) -> Any:
    return jnp.where(poison > 0, jnp.nan, ct), jnp.zeros_like(poison)


poisoned_grad.defvjp(_fwd, _bwd)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(W, W, rngs=rngs)
        self.poison = nnx.Variable(jnp.zeros(()))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(poisoned_grad(self.lin(x), self.poison[...]))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([Block(rngs) for _ in range(3)])
        self.norm = nnx.BatchNorm(W, rngs=rngs)
        self.head = nnx.Linear(W, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Stack(models.Stack):
    """4 blocks stacked and run with ``nnx.scan``, then a head."""

    def __init__(self, n: int = 4) -> None:
        super().__init__(Block, n, W, 2)


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


@pytest.fixture
def data() -> tuple[jax.Array, jax.Array]:
    return (
        jax.random.normal(jax.random.key(1), (6, W)),
        jax.random.normal(jax.random.key(2), (6, 2)),
    )


def snapshot(model: Any) -> list[np.ndarray]:
    return [np.array(v) for v in jax.tree.leaves(nnx.state(model))]


def test_all_finite_is_none_and_the_inputs_stay_as_they_were(data: Any) -> None:
    x, y = data
    model = MLP(nnx.Rngs(0))
    before = snapshot(model)
    assert hx.find_nonfinite(mse, model, x, y) is None
    # BatchNorm in training mode updates its statistics: only inside the compiled copy
    for a, b in zip(snapshot(model), before):
        np.testing.assert_array_equal(a, b)


def test_nan_injected_forward(data: Any) -> None:
    x, y = data
    model = MLP(nnx.Rngs(0))
    model.layers[1].lin.kernel[0, 0] = jnp.nan
    found = hx.find_nonfinite(mse, model, x, y)
    assert found is not None
    assert (found.phase, found.key, found.layer) == ("forward", "layers/1/lin", None)
    # column 0 of every row is NaN (x's first column is never exactly 0)
    assert found.count == x.shape[0] and found.before == "layers/0"
    assert np.isnan(found.loss)
    assert str(found) == (
        "forward: the output of 'layers/1/lin' holds 6 non-finite values ('layers/0' just before "
        "it was finite: it arose between the two)"
    )


def test_nan_injected_backward_only(data: Any) -> None:
    """A NaN made by the backward of layers/1 (after its lin): the forward is finite, and the
    first non-finite gradient in backward order is d loss / d (output of layers/1/lin)."""
    x, y = data
    model = MLP(nnx.Rngs(0))
    model.layers[1].poison[...] = jnp.ones(())
    found = hx.find_nonfinite(mse, model, x, y)
    assert found is not None
    assert (found.phase, found.key, found.before) == ("backward", "layers/1/lin", "layers/1")
    assert found.count == x.size and np.isfinite(found.loss)
    assert str(found).startswith("backward (the forward pass is finite): d loss / d (output of")
    # the same answer from hx.value_and_grad's gradients, read in backward order
    _, _, act_grads = hx.value_and_grad(mse)(model, x, y)
    assert np.isfinite(act_grads["layers/1"][0]).all()
    assert not np.isfinite(act_grads["layers/1/lin"][0]).any()


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_inside_a_scan_names_the_layer(phase: str, data: Any) -> None:
    x, y = data
    model = Stack(n=4)
    if phase == "forward":
        model.blocks.lin.kernel[2, 0, 0] = jnp.inf
    else:
        model.blocks.poison[...] = jnp.array([0.0, 1.0, 0.0, 1.0])
    found = hx.find_nonfinite(mse, model, x, y)
    assert found is not None
    if phase == "forward":  # layer 2 of the stack; layer 1 (the whole block) ran before it
        assert (found.key, found.layer, found.before) == ("blocks/lin", 2, "blocks[1]")
        assert found.label == "blocks/lin[2]"
    else:  # the backward visits layer 3 first: its poison is the first NaN
        assert (found.phase, found.key, found.layer) == ("backward", "blocks/lin", 3)
        assert found.before == "blocks[3]"


def test_one_compiled_pass_under_jit(data: Any) -> None:
    """The loss is traced twice (abstractly to find the call sites, then compiled), never once
    per layer, and a jitted function inside the model is carried through."""
    x, y = data
    model = Stack(n=4)
    model.blocks.lin.kernel[3, 0, 0] = jnp.nan
    traces = []

    def loss(model: Stack, x: jax.Array, y: jax.Array) -> jax.Array:
        traces.append(1)
        return jax.jit(mse)(model, x, y)

    found = hx.find_nonfinite(loss, model, x, y)
    assert found is not None and found.label == "blocks/lin[3]"
    assert len(traces) == 2


def test_loss_and_parameter_nonfinite(data: Any) -> None:
    x, y = data
    model = MLP(nnx.Rngs(0))

    def log_loss(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.log(mse(model, x, y) - 1e9)  # NaN outside every call site

    found = hx.find_nonfinite(log_loss, model, x, y)
    assert found is not None and (found.phase, found.key) == ("loss", None)
    assert found.before == ""  # the model's output, the last call site to finish

    def sqrt_loss(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
        # d sqrt(w) / dw is inf at w = 0: a parameter's gradient, no activation's
        return mse(model, x, y) + jnp.sqrt(model.head.bias[...] * 0).sum()

    found = hx.find_nonfinite(sqrt_loss, model, x, y)
    assert found is not None
    assert (found.phase, found.key, found.count) == ("parameters", "head/bias", 2)


def test_errors(data: Any) -> None:
    x, y = data
    with pytest.raises(hx.HookaxError, match=r"expects the step's loss function"):
        hx.find_nonfinite(None, x)  # type: ignore[arg-type]
    with pytest.raises(hx.SelectorError, match="nothing/here"):
        hx.find_nonfinite(mse, MLP(nnx.Rngs(0)), x, y, where="nothing/here")


def test_equinox_and_linen() -> None:
    import equinox as eqx

    from .test_conformance import X, _make

    fw = _make("equinox")
    poisoned = eqx.tree_at(
        lambda m: m.layers[1].weight, fw.state, fw.state.layers[1].weight * jnp.inf
    )
    found = hx.find_nonfinite(fw.loss, poisoned, X)
    assert found is not None and (found.phase, found.key) == ("forward", "layers/1")
    fw = _make("linen")
    params = jax.tree.map(lambda a: a, fw.state)
    params["params"]["layers_0"]["bias"] = params["params"]["layers_0"]["bias"].at[0].set(jnp.nan)
    found = hx.find_nonfinite(fw.loss, params, X)
    assert found is not None and (found.key, found.before) == ("layers_0", None)


def test_one_layer_selection(data: Any) -> None:
    x, y = data
    model = Stack(n=4)
    model.blocks.lin.kernel[1, 0, 0] = jnp.nan
    # layer 0 is finite: the NaN is outside what is selected
    found = hx.find_nonfinite(mse, model, x, y, where="blocks/lin[0]")
    assert found is not None and (found.phase, found.before) == ("loss", "blocks/lin[0]")
    found = hx.find_nonfinite(mse, model, x, y, where="blocks/lin[2]")
    assert found is not None and (found.key, found.layer) == ("blocks/lin", 2)


@pytest.mark.parametrize("how", ["interpret", "compile"])
def test_a_first_call_run_with_numpy_names_the_same_call_sites(how: str, data: Any) -> None:
    """``hx.first_call("interpret")`` runs a new step's first call with NumPy (compiled in the
    background): the same answers as the compiled step, NaN made forward, backward, in a
    scanned layer, and none."""
    from hookax._diagnostics import nonfinite

    x, y = 2 * data[0], data[1] + 1  # shapes of the other tests, values of this one
    forward, backward, clean = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
    forward.layers[1].lin.kernel[0, 0] = jnp.nan
    backward.layers[1].poison[...] = jnp.ones(())
    scanned = Stack(n=4)
    scanned.blocks.lin.kernel[2, 0, 0] = jnp.inf

    def loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:  # a step no test compiled
        return jnp.mean(jnp.abs(model(x) - y))

    step = nonfinite._step(False)
    before = step.interpreted
    with hx.first_call(how):
        got = [hx.find_nonfinite(loss, m, x, y) for m in (forward, backward, scanned, clean)]
    assert [(f.phase, f.label) for f in got[:3] if f is not None] == [
        ("forward", "layers/1/lin"),
        ("backward", "layers/1/lin"),
        ("forward", "blocks/lin[2]"),
    ]
    assert got[0] is not None and got[0].count == x.shape[0]
    assert got[3] is None
    # The MLP's and the stack's first calls (a call of the MLP's step before its compile ends
    # runs with NumPy too)
    ran = step.interpreted - before
    assert ran >= 2 if how == "interpret" else ran == 0
