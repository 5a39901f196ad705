"""A heads grid checks its head axis against the model's number of heads, where hookax is told
it (``n_heads=``): an operation whose value holds the heads on another axis raises."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from tests import gpt_models as g


class EinsumAttention(nnx.Module):
    """Full multi-head attention written with einsums (as gemma writes it): the second
    product's ``dot_general`` puts the heads, a batch axis of the einsum, before the positions;
    the transpose after it gives ``[batch, seq, heads, head_dim]``."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3 * self.heads, d // self.heads)
        q, k, v = jnp.split(qkv, 3, axis=2)
        probs = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BTNS", q, k), axis=-1)
        z = jnp.einsum("BTNS,BSNH->BTNH", probs, v)
        return self.out(z.reshape(b, t, d))


HEADS, T = 2, 5
MODEL = EinsumAttention(8, HEADS, nnx.Rngs(0))
CLEAN = jax.random.normal(jax.random.key(0), (1, T, 8))
CORRUPT = jnp.zeros((1, T, 8))


def metric(y: jax.Array) -> jax.Array:
    return y[0, -1, 0]


def test_the_ops_of_the_einsum_attention_have_heads_on_another_axis():
    shapes = {r.address: r.outputs for r in hx.ops(MODEL, CLEAN).rows}
    assert shapes[":dot_general#1"] == ("f32[1,2,4,5]",)  # axis 2 is not the heads
    assert shapes[":transpose#1"] == (f"f32[1,{T},{HEADS},4]",)


def test_a_heads_grid_whose_head_axis_has_another_size_raises():
    with pytest.raises(hx.PatchError) as info:
        hx.patch_grid(
            MODEL, (CLEAN,), (CORRUPT,), metric, ops=":dot_general#1", heads=2, n_heads=HEADS
        )
    msg = str(info.value)
    assert "target ':dot_general#1' has shape (1, 2, 4, 5)" in msg
    assert "its axis heads=2 has size 4, but the model has 2 heads (axis 1 has size 2)" in msg
    assert "Fix: target the value that holds the heads on that axis" in msg
    assert "or pass heads= the axis of size 2" in msg


def test_the_right_operation_passes_the_check_and_gives_the_same_grid():
    kw = {"ops": ":transpose#1", "heads": 2}
    checked = hx.patch_grid(MODEL, (CLEAN,), (CORRUPT,), metric, n_heads=HEADS, **kw)
    plain = hx.patch_grid(MODEL, (CLEAN,), (CORRUPT,), metric, **kw)
    assert checked.shape == (1, HEADS, T)
    np.testing.assert_array_equal(np.asarray(checked), np.asarray(plain))


@pytest.mark.parametrize("kind", ["z", "q"])  # a call site's input, a call site's output
def test_patch_head_every_checks_the_names_n_heads(kind):
    m = g.make("mha")
    nm = hx.transformer_names(m.blocks, attention="nnx", n_heads=g.H + 1)
    assert nm.n_heads == g.H + 1
    with pytest.raises(hx.PatchError, match=rf"has size {g.H}, but the model has {g.H + 1} heads"):
        hx.patch_head_every(
            m.fn, m.args(g.TOKENS), m.args(g.CORRUPT), lambda y: y[0, -1, 0], nm, which=(kind,)
        )


def test_names_keep_n_heads_when_joined():
    nm = hx.transformer_names("blocks/*", n_heads=4) | hx.names(extra="blocks/*/mlp")
    assert nm.n_heads == 4
    with pytest.raises(hx.HookaxError, match="n_heads= takes a positive int"):
        hx.transformer_names("blocks/*", n_heads=0)
