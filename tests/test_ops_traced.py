"""``hx.intercept_op`` edits that close over traced values, on operations inside jitted ``jnp``
functions (``jnp.sin``, ``jnp.einsum``) and a non-inline ``jax.jit``: a per-head patching grid
vmapped over patch values needs exactly this."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx


class Sin(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones((4, 4)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.sin(x) @ self.w[...]


def test_the_issue_repro_an_edit_closing_over_a_traced_scale():
    @nnx.jit
    def f(model, x, s):
        with hx.intercept_op(lambda v, op: v * s, ops=":sin"):
            return model(x).sum()

    x = jnp.ones((2, 4))
    want = (jnp.sin(x) * 2.0 @ jnp.ones((4, 4))).sum()
    np.testing.assert_allclose(f(Sin(), x, 2.0), want, rtol=1e-6)
    np.testing.assert_allclose(f(Sin(), x, 3.0), want * 1.5, rtol=1e-6)


class Helper(nnx.Module):
    """An operation inside a jitted helper of its own (not inlined)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return _helper(x) + 1.0


@jax.jit
def _helper(x: jax.Array) -> jax.Array:
    return jnp.cos(x) * 2.0


def test_a_non_inline_jit_and_a_cond_with_a_traced_edit():
    model = Helper()
    x = jnp.linspace(0.0, 1.0, 4)

    @jax.jit
    def f(x, s):
        with hx.intercept_op(lambda v, op: v + s, ops=":helper"):
            return model(x)

    np.testing.assert_allclose(f(x, 0.5), jnp.cos(x) * 2.0 + 1.5, rtol=1e-6)

    class Branchy(nnx.Module):
        def __call__(self, x, flag):
            return jax.lax.cond(flag, jnp.sin, jnp.cos, x)

    b = Branchy()

    @jax.jit
    def g(x, flag, s):
        with hx.intercept_op(lambda v, op: v * s, ops=":sin"):
            return b(x, flag)

    np.testing.assert_allclose(g(x, True, 3.0), jnp.sin(x) * 3.0, rtol=1e-6)
    np.testing.assert_allclose(g(x, False, 3.0), jnp.cos(x), rtol=1e-6)


class Heads(nnx.Module):
    """Self-attention written with einsums: the per-head outputs are ``:dot_general#1``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.q = nnx.Linear(8, 8, rngs=rngs)
        self.k = nnx.Linear(8, 8, rngs=rngs)
        self.v = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return heads_of(self, x).reshape(x.shape[0], 8)


def heads_of(m: Heads, x: jax.Array, patch=None) -> jax.Array:
    """The per-head outputs ``(positions, heads, features)``; ``patch(out) -> out`` by hand."""
    split = lambda t: t.reshape(*t.shape[:-1], 2, 4)  # noqa: E731
    q, k, v = split(m.q(x)), split(m.k(x)), split(m.v(x))
    p = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k) / 2.0, axis=-1)
    out = jnp.einsum("hqk,khd->qhd", p, v)
    return out if patch is None else patch(out)


@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
def test_a_per_head_grid_vmapped_over_patch_values(mode):
    """Every cell: head h's output replaced by the clean run's, inside a vmap over heads,
    equals the model with that head patched by hand."""
    model = Heads(nnx.Rngs(0))
    clean = jnp.linspace(-1.0, 1.0, 40).reshape(5, 8)
    corrupt = clean[::-1] * 0.5
    address = ":dot_general#1"  # the einsum over the probabilities (hx.ops lists it)
    rows = {r.address: r for r in hx.ops(model, corrupt).rows}
    assert rows[address].name == "dot_general"
    clean_heads = heads_of(model, clean)  # (5, 2, 4): positions, heads, features

    def patched(model, x, head, value):
        def edit(v, op):
            # The dot_general's own layout (einsum transposes after it): the sizes 5, 2, 4
            # are distinct, so they say where each axis of (positions, heads, features) went.
            perm = [value.shape.index(n) for n in v.shape]
            axis = perm.index(1)
            mask = (jnp.arange(2) == head).reshape([-1 if i == axis else 1 for i in range(3)])
            return jnp.where(mask, jnp.transpose(value, perm), v)

        with hx.intercept_op(edit, ops=address):
            return model(x).sum()

    grid = jax.vmap(patched, in_axes=(None, None, 0, None))
    if mode == "jax.jit":
        grid = jax.jit(grid)
    elif mode == "nnx.jit":
        grid = nnx.jit(grid)
    got = grid(model, corrupt, jnp.arange(2), clean_heads)

    for h in range(2):
        by_hand = heads_of(model, corrupt, lambda out, h=h: out.at[:, h].set(clean_heads[:, h]))
        np.testing.assert_allclose(got[h], by_hand.sum(), rtol=1e-5)
        assert abs(got[h] - model(corrupt).sum()) > 1e-3  # the patch changed something
