"""Errors blame what is wrong: inputs of different shapes in a patching grid, a Linen module
without its variables; and the fix each message gives works."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context

X = jnp.array([[1.0, 2.0], [3.0, -1.0]])


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    yield
    assert _context.active_entries() == ()
    assert _context.call_stack() == []


def embed_model() -> nnx.Sequential:
    return nnx.Sequential(nnx.Embed(10, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 4, rngs=nnx.Rngs(1)))


def metric(y: Any) -> Any:
    return y[0, -1, 0]


@pytest.mark.parametrize("api", [hx.patch_grid, hx.attribution_patch])
def test_patching_inputs_of_different_shapes_are_named_first(api):
    model = embed_model()
    clean = jnp.array([[1, 2, 3, 4, 5, 6]], jnp.int32)
    corrupt = jnp.array([[1, 2, 3, 4, 5]], jnp.int32)
    who = api.__name__
    with pytest.raises(
        hx.PatchError,
        match=rf"^hx\.{who}: clean \(1, 6\) and corrupt \(1, 5\) differ \(the shapes of "
        r"clean_args\[0\] and corrupt_args\[0\]\)\. .* Fix: make the two prompts the same length",
    ):
        api(model, (clean,), (corrupt,), metric, where="layers/1")
    with pytest.raises(hx.PatchError, match=r"clean float32 and corrupt int32 differ"):
        api(model, (clean.astype(jnp.float32),), (clean,), metric, where="layers/1")
    with pytest.raises(hx.PatchError, match=r"clean_args and corrupt_args differ in structure"):
        api(lambda a, b: model(a), (clean, clean), (clean,), metric, where="layers/1")
    # NumPy's int64 tokens and JAX's int32 are alike: the grid runs, exactly as int32 both.
    same = api(model, (np.asarray(clean),), (clean,), metric, where="layers/1", positions=None)
    assert same.shape == (1,)
    if api is hx.patch_grid:
        assert same[0] == metric(model(clean))


def dense() -> tuple[nn.Dense, Any]:
    d = nn.Dense(3)
    return d, d.init(jax.random.key(0), X)


class Encoder(nn.Module):
    @nn.compact
    def encode(self, x: Any) -> Any:
        return nn.Dense(3)(x)


def loss_fn(m: Any, x: Any) -> Any:
    return m(x).sum()


CAPTURE_FIX = (
    r"^hx\.capture of a Linen Dense needs its variables\. Fix: bind them: "
    r"hx\.capture\(model\.bind\(variables\)\)\(x\), or pass them: "
    r"hx\.capture\(model\.apply\)\(variables, x\), with variables = model\.init\(key, x\)\."
)
OPS_FIX = r"^hx\.ops of a Linen Dense needs its variables\. Fix: bind them: hx\.ops\(model\.bind"
VAG_FIX = (
    r"^hx\.value_and_grad of a Linen Dense needs its variables\. Fix: pass them, and bind them "
    r"inside the loss: hx\.value_and_grad\(lambda variables, x: loss_fn\(model\.bind\(variables\)"
)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_an_unbound_linen_module_gets_hookax_fix(mode):
    d, variables = dense()

    def call(f: Any) -> Any:
        """``f(X)``, eagerly or through ``jax.jit``."""
        return f(X) if mode == "eager" else jax.jit(f)(X)

    with pytest.raises(hx.HookaxError, match=CAPTURE_FIX):
        hx.capture(d)
    with pytest.raises(hx.HookaxError, match=CAPTURE_FIX.replace("Dense", "Encoder")):
        call(lambda x: hx.capture(Encoder().encode)(x))
    with pytest.raises(hx.HookaxError, match=VAG_FIX):
        call(lambda x: hx.value_and_grad(loss_fn)(d, x))
    with pytest.raises(hx.HookaxError, match=VAG_FIX):  # bound: its variables are no pytree
        call(lambda x: hx.value_and_grad(loss_fn)(d.bind(variables), x))
    with pytest.raises(hx.HookaxError, match=OPS_FIX):
        hx.ops(d, X)

    # The fixes the messages give, with exact values.
    expected = d.apply(variables, X)
    y, acts = call(lambda x: hx.capture(d.bind(variables))(x))
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(acts[""][0], expected)
    _, acts = call(lambda x: hx.capture(d.apply)(variables, x))
    np.testing.assert_array_equal(acts[""][0], expected)
    loss, grads, act_grads = call(
        lambda x: hx.value_and_grad(lambda v, x: loss_fn(d.bind(v), x))(variables, x)
    )
    assert loss == expected.sum()
    np.testing.assert_array_equal(grads["params"]["bias"], [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(act_grads[""][0], jnp.ones((2, 3)))
    assert [r.address for r in hx.ops(d.bind(variables), X)] == [":dot_general", ":reshape", ":add"]


def test_grad_flow_says_the_same_words():
    d, _ = dense()
    with pytest.raises(
        hx.HookaxError,
        match=r"^gradient flow of a Linen Dense needs its variables\. Fix: bind them: "
        r"hx\.grad_flow\(model\.bind\(variables\), x\), with variables = model\.init\(key, x\)\.",
    ):
        hx.grad_flow(d, X)
