"""Small NNX models shared by the tests."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    """``depth`` Linear layers in an ``nnx.List`` with relu between them."""

    def __init__(self, din: int = 3, width: int = 4, depth: int = 3, *, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        dims = [din] + [width] * depth
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(dims)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.lin(x))


class Scanned(nnx.Module):
    """Four stacked blocks run with ``nnx.scan``, then a head under ``nnx.remat``."""

    def __init__(self, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)

        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        x = body(x, self.blocks)
        return nnx.remat(lambda m, x: m(x))(self.head, x)

    def unrolled(self, x: jax.Array) -> jax.Array:
        """The same computation written out by hand, layer by layer."""
        _, state = nnx.split(self.blocks)
        kernel = state["lin"]["kernel"][...]
        bias = state["lin"]["bias"][...]
        for i in range(kernel.shape[0]):
            x = jnp.tanh(x @ kernel[i] + bias[i])
        return x @ self.head.kernel[...] + self.head.bias[...]


class Stack(nnx.Module):
    """``n`` blocks made by ``block(rngs)``, stacked on a leading axis and run with
    ``nnx.scan``, then a Linear head ``width -> out``."""

    def __init__(self, block: Callable[[nnx.Rngs], nnx.Module], n: int, width: int, out: int):
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key: jax.Array) -> nnx.Module:
            return block(nnx.Rngs(key))

        self.blocks = make(jax.random.split(jax.random.key(0), n))
        self.head = nnx.Linear(width, out, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, block: nnx.Module) -> jax.Array:
            return block(x)

        return self.head(body(x, self.blocks))
