"""NNX modules inside a Linen model through Flax's ``nnx.bridge.ToLinen`` (MaxText's Linen
path), in a stack scanned by ``nn.scan``: they have the path of the bridge's Linen call site
(``"layers/self_attention"``, its submodules below it), the bridge itself is no call site of its
own, and a head grid over one of their operations follows the fix its error names. Every value
is checked against the stack computed by hand."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

import hookax as hx

H, D, T, N = 2, 4, 3, 3


class Attn(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.q = nnx.Linear(D, H * D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q = self.q(x).reshape(x.shape[0], x.shape[1], H, D)
        scores = jnp.einsum("bthd,bshd->bhts", q, q) / 2.0
        return x + _mix(jax.nn.softmax(scores, -1))


def _mix(probs):
    return probs.sum(-1).transpose(0, 2, 1).mean(-1, keepdims=True)


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return bridge.ToLinen(Attn, name="self_attention")(x), None


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            Layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=N,
        )
        return stack(name="layers")(x, None)[0]


X = jnp.linspace(-1.0, 1.0, T * D).reshape(1, T, D)
CORRUPT = X[:, ::-1] * 0.5


@pytest.fixture(scope="module")
def model():
    m = Model()
    return m, m.init(jax.random.key(0), X)


def by_hand(variables, x, edit=None):
    """Each layer's scores (``q.q / 2``) and the output; ``edit(i, scores)`` changes layer i's."""
    p = variables["params"]["layers"]["self_attention"]["q"]
    all_scores = []
    for i in range(N):
        q = (x @ p["kernel"][i] + p["bias"][i]).reshape(x.shape[0], x.shape[1], H, D)
        scores = jnp.einsum("bthd,bshd->bhts", q, q) / 2.0
        if edit is not None:
            scores = edit(i, scores)
        all_scores.append(scores)
        x = x + _mix(jax.nn.softmax(scores, -1))
    return all_scores, x


def metric(y):
    return y[0, -1].sum()


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_bridged_modules_have_the_bridge_call_site_path(model, jitted):
    m, v = model
    _, want = by_hand(v, X)

    def run(v, x):
        return hx.capture(lambda x: m.apply(v, x))(x)

    y, acts = (jax.jit(run) if jitted else run)(v, X)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    assert sorted(acts) == ["", "layers", "layers/self_attention", "layers/self_attention/q"]
    p = v["params"]["layers"]["self_attention"]["q"]
    np.testing.assert_allclose(
        acts["layers/self_attention/q"][0][0], X @ p["kernel"][0] + p["bias"][0], rtol=1e-6
    )


def test_head_grid_follows_its_fix(model):
    m, v = model

    def f(x):
        return m.apply(v, x)

    with pytest.raises(hx.HookaxError, match=r"ops='layers/self_attention\[0:3\]:div'") as err:
        hx.patch_grid(f, (X,), (CORRUPT,), metric, ops="layers/self_attention:div", heads=1, axis=2)
    fix = str(err.value).split("Fix: ops=")[1].split("'")[1]
    grid = hx.patch_grid(f, (X,), (CORRUPT,), metric, ops=fix, heads=1, axis=2)
    clean, _ = by_hand(v, X)
    want = np.zeros((N, H, T))
    for i in range(N):
        for h in range(H):
            for t in range(T):

                def edit(j, s, i=i, h=h, t=t):
                    return s.at[:, h, t].set(clean[i][:, h, t]) if j == i else s

                want[i, h, t] = metric(by_hand(v, CORRUPT, edit)[1])
    np.testing.assert_allclose(grid, want, rtol=1e-5, atol=1e-6)
