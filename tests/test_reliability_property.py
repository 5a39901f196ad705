"""Property tests: no-op hooks, interceptors and captures change no bit of outputs or gradients.

Over generated MLPs and CNNs (depths, widths, batch sizes, float32 and bfloat16), eagerly and
under ``jax.jit``: a no-op forward pre-hook, forward hook, backward pre-hook, backward hook,
interceptor and capture leave the output and every gradient bit-for-bit equal to the unhooked
model's; and ``capture`` returns exactly the per-layer values of a hand-unrolled forward. Shapes
are drawn from small sets so the number of distinct compilations stays bounded.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import hookax as hx
from tests.reliability_helpers import assert_clean

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Stack(nnx.Module):
    """Layers with relu between them; a CNN ends with a mean over its spatial axes."""

    def __init__(self, kind: str, width: int, depth: int, dtype: Any) -> None:
        rngs = nnx.Rngs(depth * 10 + width)
        opts = {"dtype": dtype, "param_dtype": dtype, "rngs": rngs}
        if kind == "mlp":
            dims = [3] + [width] * depth
            self.layers = nnx.List([nnx.Linear(a, b, **opts) for a, b in itertools.pairwise(dims)])
        else:
            chans = [2] + [width] * depth
            self.layers = nnx.List(
                [nnx.Conv(a, b, (3, 3), **opts) for a, b in itertools.pairwise(chans)]
            )
        self.kind = kind

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x if self.kind == "mlp" else x.mean(axis=(1, 2))


models = st.builds(
    lambda kind, width, depth, batch, dtype: (Stack(kind, width, depth, DTYPES[dtype]), batch),
    kind=st.sampled_from(["mlp", "cnn"]),
    width=st.sampled_from([2, 5]),
    depth=st.integers(1, 3),
    batch=st.sampled_from([1, 4]),
    dtype=st.sampled_from(list(DTYPES)),
)
SETTINGS = settings(max_examples=4, deadline=None, derandomize=True)


def example_input(model: Stack, batch: int) -> jax.Array:
    dtype = model.layers[0].param_dtype
    shape = (batch, 3) if model.kind == "mlp" else (batch, 5, 5, 2)
    return jax.random.normal(jax.random.key(batch), shape, jnp.float32).astype(dtype)


def loss(m: Stack, x: jax.Array) -> jax.Array:
    return jnp.sum(m(x).astype(jnp.float32) ** 2)


def outputs_and_grads(model: Stack, x: jax.Array, jit: bool) -> Any:
    f = nnx.value_and_grad(loss, argnums=(0, 1))
    if jit:
        f = nnx.jit(f)
    value, grads = f(model, x)
    return model(x) if not jit else nnx.jit(lambda m, x: m(x))(model, x), value, grads


def assert_bitwise_equal(a: Any, b: Any) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb, strict=True):
        assert u.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


def passthrough(next_fun, args, kwargs, ctx):
    return next_fun(*args, **kwargs)


def captured(model: Stack, x: jax.Array) -> Any:
    return hx.capture(model)(x)


def none_hooks(model: Stack) -> list[hx.HookHandle]:
    return [
        hx.register_forward_pre_hook(model, lambda m, a: None, where=nnx.Module),
        hx.register_forward_hook(model, lambda m, a, o: None, where=nnx.Module),
        hx.register_full_backward_pre_hook(model, lambda m, g: None, where="layers/*"),
        hx.register_full_backward_hook(model, lambda m, gi, go: None, where="layers/*"),
    ]


@SETTINGS
@given(case=models, jit=st.booleans())
def test_no_op_hooks_interceptors_and_capture_change_no_bit(case, jit):
    model, batch = case
    x = example_input(model, batch)
    want = outputs_and_grads(model, x, jit)

    handles = none_hooks(model)
    with hx.intercept(passthrough), hx.hooks(forward=lambda m, a, o: o):
        assert_bitwise_equal(outputs_and_grads(model, x, jit), want)
    for h in handles:
        h.remove()

    # Under jit the model is an argument, as in the reference: a model closed over is baked in as
    # constants, and XLA may then compute a bfloat16 result differently, hooks or not.
    y, _ = nnx.jit(captured)(model, x) if jit else captured(model, x)
    assert_bitwise_equal(y, want[0])
    assert_clean(model)


def unrolled(model: Stack, x: jax.Array) -> dict[str, jax.Array]:
    """The per-layer outputs, written out by hand (MLP: the matmuls; CNN: each layer's call)."""
    acts = {}
    h = x
    n = len(model.layers)
    for i, layer in enumerate(model.layers):
        if model.kind == "mlp":
            h = jax.lax.dot_general(h, layer.kernel[...], (((1,), (0,)), ((), ())))
            h = h + layer.bias[...].reshape(1, -1)
        else:
            h = layer(h)
        acts[f"layers/{i}"] = h
        if i < n - 1:
            h = jax.nn.relu(h)
    acts[""] = h if model.kind == "mlp" else h.mean(axis=(1, 2))
    return acts


@SETTINGS
@given(case=models, jit=st.booleans())
def test_capture_equals_a_hand_unrolled_forward(case, jit):
    model, batch = case
    x = example_input(model, batch)
    if jit:
        _, acts = nnx.jit(captured)(model, x)
        want = nnx.jit(unrolled)(model, x)
    else:
        _, acts = captured(model, x)
        want = unrolled(model, x)
    assert list(acts) == ["", *(f"layers/{i}" for i in range(len(model.layers)))]
    for key, value in want.items():
        (got,) = acts[key]
        assert_bitwise_equal(got, value)
    assert_clean(model)
