"""A first call compiles one program: a grid (its clean values in the same program) and an
attribution (no discovery trace, no small programs for positions or results), counted with
JAX's compile log; targets called inside no transform are kept by a plain interceptor, with
the same values as ``hx.capture`` gives, and those inside a transform are not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._patching import compiled, targets
from hookax._patching import grid as grid_module

from .test_new_data import compiles


class Split(nnx.Module):
    def __call__(self, x):
        return x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)


class Join(nnx.Module):
    def __call__(self, x):
        return x.reshape(*x.shape[:-2], -1)


class Net(nnx.Module):
    """Two linear layers around a split into 2 heads (batch, position, head, feature)."""

    def __init__(self, vmapped: bool = False) -> None:
        self.a = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.split, self.join = Split(), Join()
        self.b = nnx.Linear(8, 6, rngs=nnx.Rngs(1))
        self.vmapped = vmapped

    def __call__(self, x):
        h = jnp.tanh(self.a(x))
        if self.vmapped:  # the call sites below run inside a vmap over examples
            return jax.vmap(lambda e: self.b(self.join(self.split(e))))(h)
        return self.b(self.join(self.split(h)))


CLEAN = jax.random.normal(jax.random.key(0), (1, 5, 4))
CORRUPT = jax.random.normal(jax.random.key(1), (1, 5, 4))


def metric(y):
    return y[0, -1, 0] - y[0, -1, 1]


def _by_hand(model, heads=False):
    """Patching ``split`` at each position (and each head), without hookax."""
    clean = model.split(jnp.tanh(model.a(CLEAN)))
    corrupt = model.split(jnp.tanh(model.a(CORRUPT)))
    rows = []
    for h in range(2) if heads else [None]:
        row = []
        for p in range(5):
            mask = (jnp.arange(5) == p)[None, :, None, None]
            if h is not None:
                mask = mask & (jnp.arange(2) == h)[None, None, :, None]
            row.append(metric(model.b(model.join(jnp.where(mask, clean, corrupt)))))
        rows.append(row)
    return jnp.array(rows if heads else rows[0])[None]


@pytest.mark.parametrize("heads", [None, 2])
def test_a_first_grid_compiles_one_program(heads):
    model = Net()
    jax.clear_caches()
    with compiles() as names:
        got = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="split", heads=heads)
    assert names == ["jit(_grid)"]
    np.testing.assert_allclose(got, _by_hand(model, heads is not None), atol=1e-6)


def test_a_first_attribution_compiles_one_program():
    model = Net()
    jax.clear_caches()
    with compiles() as names:
        got = hx.attribution_patch(model, (CLEAN,), (CORRUPT,), metric, where=["a", "split"])
    assert names == ["jit(_attribute)"]
    # Against the gradient at the corrupted run, by hand.
    h_clean, h_corrupt = model.a(CLEAN), model.a(CORRUPT)

    def from_a(h):
        return metric(model.b(model.join(model.split(jnp.tanh(h)))))

    def from_split(s):
        return metric(model.b(model.join(s)))

    s_clean, s_corrupt = model.split(jnp.tanh(h_clean)), model.split(jnp.tanh(h_corrupt))
    want_a = ((h_clean - h_corrupt) * jax.grad(from_a)(h_corrupt)).sum(-1)[0]
    want_s = ((s_clean - s_corrupt) * jax.grad(from_split)(s_corrupt)).sum((-1, -2))[0]
    np.testing.assert_allclose(got, jnp.stack([want_a, want_s]), atol=1e-6)


def test_chunks_and_host_positions_give_the_same_grid():
    model = Net()
    whole = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="split", heads=2)
    for chunk in (1, 3):  # 1: the clean values in their own program; 3: a padded last chunk
        got = hx.patch_grid(
            model, (CLEAN,), (CORRUPT,), metric, where="split", heads=2, chunk_size=chunk
        )
        np.testing.assert_allclose(got, whole, atol=1e-6)
    picked = [whole[:, :, [0, 3]]]
    for positions in ([0, 3], np.array([0, 3]), jnp.array([0, 3])):
        got = hx.patch_grid(
            model, (CLEAN,), (CORRUPT,), metric, where="split", heads=2, positions=positions
        )
        assert isinstance(got, jax.Array)
        np.testing.assert_allclose(got, picked[0], atol=1e-6)


@pytest.mark.parametrize("jit", [jax.jit, nnx.jit])
def test_under_jit_the_same_grid_and_attribution(jit):
    """Inside a jit with the model as an argument: the rows joined in the program (chunks and
    heads), the targets kept by the interceptor at that trace level."""
    model = Net()

    def grid(model, clean, corrupt, chunk_size):
        return hx.patch_grid(
            model, (clean,), (corrupt,), metric, where="split", heads=2, chunk_size=chunk_size
        )

    def attribution(model, clean, corrupt):
        return hx.attribution_patch(model, (clean,), (corrupt,), metric, where=["a", "split"])

    jitted = jit(grid, static_argnames="chunk_size")
    for chunk in (None, 3):
        got = jitted(model, CLEAN, CORRUPT, chunk_size=chunk)
        np.testing.assert_allclose(got, _by_hand(model, heads=True), atol=1e-6)
    eager = attribution(model, CLEAN, CORRUPT)
    np.testing.assert_allclose(jit(attribution)(model, CLEAN, CORRUPT), eager, atol=1e-6)


def test_plain_targets_give_what_capture_gives(monkeypatch):
    model = Net()
    plan = grid_module.Plan("t", model, (CLEAN,), (CORRUPT,), metric, "*", "each", 1)
    assert plan.plain
    args = ((CLEAN,), (CORRUPT,), metric)
    where = ["a", "split", "join:in", "b"]
    plain = hx.patch_grid(model, *args, where=where)
    plain_attr = hx.attribution_patch(model, *args, where=where)
    monkeypatch.setattr(targets, "plain", lambda keys, found: False)
    jax.clear_caches()
    captured = hx.patch_grid(model, *args, where=where)
    captured_attr = hx.attribution_patch(model, *args, where=where)
    np.testing.assert_allclose(plain, captured, atol=1e-6)
    np.testing.assert_allclose(plain_attr, captured_attr, atol=1e-6)


def test_targets_inside_a_transform_are_captured():
    model = Net(vmapped=True)
    found = targets.discover(*compiled.split((model, (CORRUPT,))))
    assert found.nested == {"split", "join", "b"}
    plan = grid_module.Plan("t", model, (CLEAN,), (CORRUPT,), metric, "split", "each", 1)
    assert not plan.plain
    # axis=0: inside the vmap over examples, the position axis of a value is its first
    got = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="split", axis=0)
    np.testing.assert_allclose(got, _by_hand(model), atol=1e-6)
    plan = grid_module.Plan("t", model, (CLEAN,), (CORRUPT,), metric, "a", "each", 1)
    assert plan.plain  # called before the vmap
