"""A module built inside a call (as Haliax's ``hnn.Linear`` builds its ``DefaultDotGeneralOp`` on
every call) is a call site under the module whose call built it, named by its class, never
under the root's key ``''``."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import hookax as hx


class DotOp(eqx.Module):
    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return x @ w


class Lin(eqx.Module):
    w: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return DotOp()(x, self.w)


class Net(eqx.Module):
    blocks: list[Lin]

    def __call__(self, x: jax.Array) -> jax.Array:
        for b in self.blocks:
            x = x + jnp.tanh(b(x))
        return x


NET = Net([Lin(jax.random.normal(k, (4, 4))) for k in jax.random.split(jax.random.key(0), 3)])
X = jnp.linspace(-1.0, 1.0, 4)


def test_keyed_under_the_call_that_built_it() -> None:
    y, acts = hx.capture(NET)(X)
    assert sorted(acts) == ["", *sorted(f"blocks/{i}{s}" for i in range(3) for s in ("", "/DotOp"))]
    assert len(acts[""]) == 1
    np.testing.assert_allclose(acts[""][0], y)
    x = X
    for i, b in enumerate(NET.blocks):
        np.testing.assert_allclose(acts[f"blocks/{i}/DotOp"][0], x @ b.w, rtol=1e-6)
        x = x + jnp.tanh(x @ b.w)


def test_hooks_and_find_nonfinite_name_it() -> None:
    def zero(next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
        return jnp.zeros_like(next_fun(*args, **kwargs))

    with hx.intercept(zero, where="blocks/1/DotOp"):
        got = eqx.filter_jit(NET)(X)
    x = X
    for i, b in enumerate(NET.blocks):
        x = x + (0 if i == 1 else jnp.tanh(x @ b.w))
    np.testing.assert_allclose(got, x, rtol=1e-6)
    bad = eqx.tree_at(lambda n: n.blocks[2].w, NET, NET.blocks[2].w.at[0, 0].set(jnp.nan))
    found = hx.find_nonfinite(lambda m, x: m(x).sum(), bad, X)
    assert found is not None and found.key == "blocks/2/DotOp"
