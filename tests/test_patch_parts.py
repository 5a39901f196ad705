"""Patching models as people write them: blocks that return ``(x, cache)`` (MaxText's and
gemma's decoder layers) are patched by naming the array inside the output (``"layers_1.0"``,
one layer of a scan ``"layers[1].0"``), harvest names such parts ``.0`` (never read as a layer),
and call sites whose outputs are third-party classes with a ``__repr__`` that reads ``.shape``
(ejkernel's ``MaskInfo``) do not stop a grid. Every grid is checked against the same patch
written by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

D = 8
T = 5
CLEAN = jax.random.normal(jax.random.key(1), (1, T, D))
CORRUPT = CLEAN.at[0, 2].add(1.0)


def metric(y):
    return y[0, -1].sum()


@jax.tree_util.register_pytree_node_class
class Mask:
    """A third-party mask class: its ``__repr__`` reads ``.shape`` of its leaf."""

    def __init__(self, m):
        self.m = m

    def __repr__(self):
        return f"Mask(shape={self.m.shape})"

    def tree_flatten(self):
        return (self.m,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def make_mask(self, x: jax.Array) -> Mask:  # a call site returning the third-party class
        return Mask(jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool)))

    def __call__(self, x: jax.Array, cache: jax.Array):
        mask = self.make_mask(x)
        s = jnp.where(mask.m, jnp.einsum("btd,bsd->bts", x, x), -1e9)
        h = x + jnp.tanh(self.lin(jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), x)))
        return h, cache + 1.0  # (x, cache), as MaxText's and gemma's layers return


class Decoder(nnx.Module):
    def __init__(self) -> None:
        for i in range(3):
            setattr(self, f"layers_{i}", Layer(nnx.Rngs(i)))

    def __call__(self, x: jax.Array) -> jax.Array:
        cache = jnp.zeros(())
        for i in range(3):
            x, cache = getattr(self, f"layers_{i}")(x, cache)
        return x


def by_hand(model: Decoder, x: jax.Array, at: int, value: jax.Array, position: int) -> jax.Array:
    """The metric with layer ``at``'s first output replaced by ``value`` at ``position``."""
    cache = jnp.zeros(())
    for i in range(3):
        x, cache = getattr(model, f"layers_{i}")(x, cache)
        if i == at:
            x = x.at[:, position].set(value[:, position])
    return metric(x)


def _clean_outputs(model):
    outs, x, cache = [], CLEAN, jnp.zeros(())
    for i in range(3):
        x, cache = getattr(model, f"layers_{i}")(x, cache)
        outs.append(x)
    return outs


def test_a_grid_runs_past_outputs_whose_repr_reads_shape():
    """The ``make_mask`` call sites are no targets: nothing calls their class's code."""
    model = Decoder()
    grid = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers_*.0")
    clean = _clean_outputs(model)
    want = [[by_hand(model, CORRUPT, i, clean[i], p) for p in range(T)] for i in range(3)]
    np.testing.assert_allclose(grid, np.array(want), rtol=1e-5, atol=1e-5)
    # As a target, the class is described without its own code, with the fix that works.
    with pytest.raises(hx.PatchError, match=r"returns Mask\(bool\[5,5\]\).*'layers_0:make_mask.0'"):
        hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers_0:make_mask")


@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
def test_patching_names_the_array_inside_a_tuple_output(mode):
    model = Decoder()
    clean = _clean_outputs(model)

    def run(m, value):
        with hx.patching({"layers_1.0": value}, positions=3):
            return metric(m(CORRUPT))

    f = run if mode == "eager" else (jax.jit if mode == "jax.jit" else nnx.jit)(run)
    np.testing.assert_allclose(
        f(model, clean[1]), by_hand(model, CORRUPT, 1, clean[1], 3), rtol=1e-6
    )


def test_a_tuple_output_is_refused_with_the_names_of_its_arrays():
    model = Decoder()
    with pytest.raises(hx.PatchError, match=r"returns \(f32\[1,5,8\], f32\[\]\).*'layers_1.0'"):
        hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers_1")
    with pytest.raises(hx.PatchError, match=r"'layers_1.2' names no array.*'layers_1.0'"):
        hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers_1.2")
    with (
        pytest.raises(
            hx.PatchError, match=r"name an array inside it \('layers_1.0', 'layers_1.1'\)"
        ),
        hx.patching({"layers_1": CLEAN}),
    ):
        model(CORRUPT)


def test_attribution_of_an_array_inside_a_tuple_output():
    model = Decoder()
    est = hx.attribution_patch(model, (CLEAN,), (CORRUPT,), metric, where="layers_1.0")
    clean = _clean_outputs(model)
    corrupt_out = model.layers_1(model.layers_0(CORRUPT, jnp.zeros(()))[0], jnp.ones(()))[0]

    def from_layer_1(h):
        cache = jnp.full((), 2.0)
        return metric(model.layers_2(h, cache)[0])

    g = jax.grad(from_layer_1)(corrupt_out)
    want = ((clean[1] - corrupt_out) * g).sum(axis=(0, 2))
    np.testing.assert_allclose(est[0], want, rtol=1e-5, atol=1e-6)


class ScanLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array):
        return x + jnp.tanh(self.lin(x)), jnp.mean(x, -1)  # (x, aux), as scanned layers return


class Scanned(nnx.Module):
    def __init__(self) -> None:
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> ScanLayer:
            return ScanLayer(rngs)

        self.layers = make(nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        def step(x, layer):
            y, aux = layer(x)
            return y, aux

        return nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, self.layers)[0]


def test_harvest_names_a_tuple_position_apart_from_a_layer(tmp_path):
    model = Scanned()
    h = hx.harvest(model, [CLEAN], where="layers[1]", store=tmp_path / "s.zarr", row_axes=1)
    assert h.names == ("layers[1].0", "layers[1].1")
    w, b = model.layers.lin.kernel[...], model.layers.lin.bias[...]
    x = CLEAN
    x = x + jnp.tanh(x @ w[0] + b[0])
    want1 = x + jnp.tanh(x @ w[1] + b[1])
    np.testing.assert_allclose(h.read("layers[1].0"), want1, rtol=1e-6, atol=1e-6)
    # The same name is a patch target: one layer of the scanned stack, by hand.
    grid = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers[1].0")
    clean1 = jnp.asarray(h.read("layers[1].0"))

    def hand(p):
        x = CORRUPT
        for i in range(3):
            x = x + jnp.tanh(x @ w[i] + b[i])
            if i == 1:
                x = x.at[:, p].set(clean1[:, p])
        return metric(x)

    np.testing.assert_allclose(grid[0], [hand(p) for p in range(T)], rtol=1e-5, atol=1e-5)
