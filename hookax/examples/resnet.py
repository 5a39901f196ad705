"""A small ResNet for 32x32 RGB images: a stem and three stages of residual blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _conv(c_in: int, c_out: int, k: int, stride: int, rngs: nnx.Rngs) -> nnx.Conv:
    return nnx.Conv(c_in, c_out, (k, k), strides=stride, use_bias=False, rngs=rngs)


class ResidualBlock(nnx.Module):
    """conv-bn-relu-conv-bn plus a shortcut (a 1x1 conv + bn where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int, *, rngs: nnx.Rngs) -> None:
        self.conv1 = _conv(c_in, c_out, 3, stride, rngs)
        self.bn1 = nnx.BatchNorm(c_out, use_running_average=True, rngs=rngs)
        self.conv2 = _conv(c_out, c_out, 3, 1, rngs)
        self.bn2 = nnx.BatchNorm(c_out, use_running_average=True, rngs=rngs)
        self.proj = (
            nnx.Sequential(
                _conv(c_in, c_out, 1, stride, rngs),
                nnx.BatchNorm(c_out, use_running_average=True, rngs=rngs),
            )
            if stride != 1 or c_in != c_out
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return jax.nn.relu(y + (x if self.proj is None else self.proj(x)))


class ResNet(nnx.Module):
    def __init__(self, widths: tuple[int, ...], classes: int, *, rngs: nnx.Rngs) -> None:
        self.stem = _conv(3, widths[0], 3, 1, rngs)
        self.stem_bn = nnx.BatchNorm(widths[0], use_running_average=True, rngs=rngs)
        blocks, c = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(ResidualBlock(c, w, 1 if i == 0 else 2, rngs=rngs))
            c = w
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(c, classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def _block_params(c_in: int, c_out: int) -> int:
    n = 9 * c_in * c_out + 2 * c_out + 9 * c_out * c_out + 2 * c_out  # convs, bn scale+bias
    if c_in != c_out:
        n += c_in * c_out + 2 * c_out
    return n


# stem 3*3*3*16 + bn 2*16, blocks 16->16, 16->32, 32->64, head 64*10 + 10.
PARAMS = 432 + 32 + _block_params(16, 16) + _block_params(16, 32) + _block_params(32, 64) + 650


def make_model(rngs: nnx.Rngs) -> ResNet:
    return ResNet((16, 32, 64), 10, rngs=rngs)


def example_inputs() -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((4, 32, 32, 3), jnp.float32),)
