"""NNX models that create a variable on first use (EasyDeL's RoPE cache) and modules that are
not pytrees (``pytree=False``, NNX's graph mode) run under hookax's compiled features: patch
grids, attribution, ``find_nonfinite``, harvest and splice take the model as ``nnx.split`` state
through ``jax.jit``, merged inside, as a user's ``jax.jit`` over split state does. Every value is
checked against the layers computed by hand."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

D, T = 4, 3
CLEAN = jnp.linspace(-1.0, 1.0, T * D).reshape(1, T, D)
CORRUPT = CLEAN[:, ::-1] * 0.5 + 0.25


def _table(n: int) -> jax.Array:
    return jnp.cos(jnp.arange(n * D, dtype=jnp.float32).reshape(n, D) * 0.3)


def _make(pytree: bool, variable: bool = True, cached_property: bool = False):
    class Rope(nnx.Module, pytree=pytree):
        """Its table is created on the first call, sized by the input: a variable, or a plain
        attribute."""

        def __call__(self, x: jax.Array) -> jax.Array:
            if not hasattr(self, "table"):
                table = _table(x.shape[-2])
                self.table = nnx.Cache(table) if variable else table
            t = self.table
            return x * (t[...] if isinstance(t, nnx.Variable) else t)

    class CachedRope(nnx.Module):
        """EasyDeL's form: a ``functools.cached_property`` returning a variable, which it
        stores past NNX's ``__setattr__`` (so a pytree module carries it as static data)."""

        @functools.cached_property
        def table(self) -> nnx.Cache:
            return nnx.Cache(_table(T))

        def __call__(self, x: jax.Array) -> jax.Array:
            return x * self.table[...]

    class Net(nnx.Module, pytree=pytree):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.a = nnx.Linear(D, D, rngs=rngs)
            self.rope = CachedRope() if cached_property else Rope()
            self.b = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.b(jnp.tanh(self.rope(self.a(x))))

    return Net(nnx.Rngs(0))


def _weights(model):
    return [(m.kernel[...], m.bias[...]) for m in (model.a, model.b)]


def _after_a(weights, h):
    (_, _), (wb, bb) = weights
    return jnp.tanh(h * _table(h.shape[-2])) @ wb + bb


def _a(weights, x):
    (wa, ba), _ = weights
    return x @ wa + ba


def metric(y):
    return y[0, -1, 0] - y[0, -1, 1]


@pytest.fixture(params=["pytree", "graph", "graph-attribute", "cached-property"])
def model(request):
    if request.param == "cached-property":
        model = _make(True, cached_property=True)
        model(CLEAN)  # its first use, outside any trace, sets the table
        return model
    return _make(request.param == "pytree", variable=request.param != "graph-attribute")


def _forwards(model):
    """``(fn, args of a prompt)``: the model itself, and under the user's jit with the model as
    an argument (``jax.jit`` for a pytree module, ``nnx.jit`` for one that is not a pytree)."""
    user_jit = nnx.jit if not _is_pytree(model) else jax.jit
    return [
        (model, lambda x: (x,)),
        (user_jit(lambda m, x: m(x)), lambda x: (model, x)),
    ]


def _is_pytree(model):
    return jax.tree.leaves(model) != [model]


def _grid_by_hand(weights):
    ha, hc = _a(weights, CORRUPT), _a(weights, CLEAN)
    return np.array([metric(_after_a(weights, ha.at[:, p].set(hc[:, p]))) for p in range(T)])


def test_patch_grid_and_attribution(model):
    weights = _weights(model)
    want = _grid_by_hand(weights)
    ha, hc = _a(weights, CORRUPT), _a(weights, CLEAN)
    g = jax.grad(lambda h: metric(_after_a(weights, h)))(ha)
    want_attr = ((hc - ha) * g).sum(axis=(0, 2))
    for fn, args in _forwards(model):
        grid = hx.patch_grid(fn, args(CLEAN), args(CORRUPT), metric, where="a")
        np.testing.assert_allclose(grid[0], want, rtol=1e-6, atol=1e-6)
        est = hx.attribution_patch(fn, args(CLEAN), args(CORRUPT), metric, where="a")
        np.testing.assert_allclose(est[0], want_attr, rtol=1e-6, atol=1e-6)
    if not isinstance(type(model.rope).__dict__.get("table"), functools.cached_property):
        assert not hasattr(model.rope, "table")  # created inside the programs, left there


def test_find_nonfinite(model):
    def loss(m, x):
        return m(x).sum()

    assert hx.find_nonfinite(loss, model, CLEAN) is None
    model.b.kernel[...] = model.b.kernel[...].at[0, 0].set(jnp.inf)
    # by hand: the output of ``a`` and of the rope are finite, b's is not
    weights = _weights(model)
    assert np.isfinite(_a(weights, CLEAN)).all()
    assert not np.isfinite(_after_a(weights, _a(weights, CLEAN))).all()
    nf = hx.find_nonfinite(loss, model, CLEAN)
    assert (nf.phase, nf.key, nf.before) == ("forward", "b", "rope")


def test_harvest_and_splice(model, tmp_path):
    weights = _weights(model)
    data = [(CLEAN,), (CORRUPT,)]
    h = hx.harvest(model, data, where="a", store=tmp_path / "s", progress=False)
    want = np.concatenate([_a(weights, x) for (x,) in data])
    np.testing.assert_array_equal(h.read("a"), want)

    def loss(m, batch):
        return metric(m(batch))

    got = hx.splice_eval(loss, model, [CLEAN], where="a", replace=lambda y: y * 0 + 1)
    ones = jnp.ones_like(_a(weights, CLEAN))
    np.testing.assert_allclose(got.loss, metric(_after_a(weights, _a(weights, CLEAN))), rtol=1e-6)
    np.testing.assert_allclose(got.spliced_loss, metric(_after_a(weights, ones)), rtol=1e-6)
    np.testing.assert_allclose(got.zero_loss, metric(_after_a(weights, ones * 0)), rtol=1e-6)


def test_the_split_state_form_is_what_a_user_writes(model):
    """The reference form the features follow: ``jax.jit`` over ``nnx.split`` state works on
    these models (and the lazily created variable stays in the program)."""
    graphdef, state = nnx.split(model)
    y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, CLEAN)
    np.testing.assert_allclose(y, _after_a(_weights(model), _a(_weights(model), CLEAN)), rtol=1e-6)
