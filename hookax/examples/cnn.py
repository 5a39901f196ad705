"""A small CNN for 32x32 RGB images: two conv + pool stages, then a linear classifier."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Parameters: conv1 3*3*3*16 + 16, conv2 3*3*16*32 + 32, head 8*8*32*10 + 10.
PARAMS = 448 + 4_640 + 20_490


def _pool(x: jax.Array) -> jax.Array:
    """2x2 average pooling (by reshaping: exact under strict dtype promotion)."""
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


class CNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(3, 16, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.head = nnx.Linear(8 * 8 * 32, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = _pool(jax.nn.relu(self.conv1(x)))
        x = _pool(jax.nn.relu(self.conv2(x)))
        return self.head(x.reshape(x.shape[0], -1))


def make_model(rngs: nnx.Rngs) -> CNN:
    return CNN(rngs=rngs)


def example_inputs() -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((8, 32, 32, 3), jnp.float32),)
