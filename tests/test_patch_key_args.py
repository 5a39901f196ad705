"""Patching grids over a model whose state holds PRNG keys (an NNX model with ``nnx.Rngs``)."""

import jax
import jax.numpy as jnp
from flax import nnx

import hookax as hx


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, deterministic=True, rngs=rngs)  # keeps a key in its state

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.drop(jnp.tanh(self.lin(x)))


def test_a_model_holding_keys_is_patched_and_attributed() -> None:
    model = Block(nnx.Rngs(0))
    clean, corrupt = jnp.ones((1, 3, 4)), jnp.zeros((1, 3, 4))
    metric = lambda y: y[0, -1].sum()  # noqa: E731
    grid = hx.patch_grid(lambda m, x: m(x), (model, clean), (model, corrupt), metric, where="lin")
    assert grid.shape == (1, 3)
    assert jnp.allclose(grid[0, 2], metric(model(clean)))
    assert jnp.allclose(grid[0, 0], metric(model(corrupt)))
    est = hx.attribution_patch(
        lambda m, x: m(x), (model, clean), (model, corrupt), metric, where="lin"
    )
    assert est.shape == (1, 3)
