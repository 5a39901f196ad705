"""A three-layer MLP on flattened 28x28 images: 784 -> 256 -> 128 -> 10."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx

# Parameters: (784*256 + 256) + (256*128 + 128) + (128*10 + 10).
PARAMS = 235_146


class MLP(nnx.Module):
    def __init__(self, sizes: tuple[int, ...], *, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def make_model(rngs: nnx.Rngs) -> MLP:
    return MLP((784, 256, 128, 10), rngs=rngs)


def example_inputs() -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((8, 784), jnp.float32),)
