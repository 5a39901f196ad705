"""hx.value_grad_and_stats: statistics against numpy on hx.capture / hx.value_and_grad values."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context
from hookax._transforms import tags as _tags
from tests import models

W = 4
ALL = ("norm", "rms", "mean", "std", "max_abs", "frac_zero", "nonfinite")
JIT = {"eager": lambda f: f, "jax.jit": jax.jit, "nnx.jit": nnx.jit}


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(W, W, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(self.lin(x))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, n: int = 3) -> None:
        self.layers = nnx.List([Block(rngs) for _ in range(n)])
        self.head = nnx.Linear(W, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Stack(models.Stack):
    """3 blocks stacked and run with ``nnx.scan``, then a head."""

    def __init__(self, n: int = 3) -> None:
        super().__init__(Block, n, W, 2)


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


@pytest.fixture
def data() -> tuple[jax.Array, jax.Array]:
    return (
        jax.random.normal(jax.random.key(1), (6, W)),
        jax.random.normal(jax.random.key(2), (6, 2)),
    )


def numpy_stats(x: Any, lead: int = 0) -> dict[str, np.ndarray]:
    """Every statistic of ``x`` with numpy, over all but its first ``lead`` axes."""
    x = np.asarray(x, np.float64)
    axes = tuple(range(lead, x.ndim))
    return {
        "norm": np.sqrt((x**2).sum(axis=axes)),
        "rms": np.sqrt((x**2).mean(axis=axes)),
        "mean": x.mean(axis=axes),
        "std": x.std(axis=axes),
        "max_abs": np.abs(x).max(axis=axes),
        "frac_zero": (x == 0).mean(axis=axes),
        "nonfinite": (~np.isfinite(x)).sum(axis=axes),
    }


def assert_stats_match(stats: Any, acts: Any, act_grads: Any, lead: dict[str, int]) -> None:
    """``stats`` equal numpy's on the captured values and gradients, key by key."""
    assert set(stats) == set(acts)
    for key, (value,) in acts.items():
        for kind, ref in (("act", value), ("grad", act_grads[key][0])):
            want = numpy_stats(ref, lead.get(key, 0))
            for name in ALL:
                got = stats[key][kind][name]
                assert got.dtype == jnp.float32 and got.shape == want[name].shape, (key, name)
                np.testing.assert_allclose(
                    got, want[name], rtol=2e-5, atol=1e-7, err_msg=f"{key} {kind} {name}"
                )


def assert_clean() -> None:
    assert _context.active_entries() == ()
    assert _tags.depth() == 0


def assert_grads_equal(grads: Any, ref: Any) -> None:
    assert jax.tree.structure(grads) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", JIT)
def test_equal_numpy_on_captured_values_and_gradients(mode: str, data: Any) -> None:
    x, y = data
    model = MLP(nnx.Rngs(0))
    loss, grads, stats = JIT[mode](hx.value_grad_and_stats(mse, stats=ALL))(model, x, y)
    assert_clean()
    _, acts = hx.capture(lambda m, x: mse(m, x, y))(model, x)
    ref_loss, ref_grads, act_grads = hx.value_and_grad(mse)(model, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_grads_equal(grads, nnx.value_and_grad(mse)(model, x, y)[1])
    assert_grads_equal(grads, ref_grads)
    assert_stats_match(stats, acts, act_grads, {})
    # relu zeros some outputs: the fraction is a real check, not 0 == 0
    assert 0 < float(stats["layers/0"]["act"]["frac_zero"]) < 1


@pytest.mark.parametrize("mode", JIT)
def test_scanned_stack_gives_one_value_per_layer(mode: str, data: Any) -> None:
    x, y = data
    model = Stack(n=3)
    step = JIT[mode](lambda m, x, y: hx.value_grad_and_stats(mse, stats=ALL)(m, x, y))
    loss, grads, stats = step(model, x, y)
    assert_clean()
    _, acts = hx.capture(lambda m, x: mse(m, x, y))(model, x)
    _, _, act_grads = hx.value_and_grad(mse)(model, x, y)
    assert stats["blocks/lin"]["grad"]["norm"].shape == (3,)
    assert_stats_match(stats, acts, act_grads, {"blocks": 1, "blocks/lin": 1})
    assert_grads_equal(grads, nnx.value_and_grad(mse)(model, x, y)[1])
    np.testing.assert_allclose(loss, mse(model, x, y), rtol=1e-6)


def test_vmap_around_the_step(data: Any) -> None:
    """vmap over the batch around the whole call: one value per example (as capture's values)."""
    x, y = data
    model = MLP(nnx.Rngs(0))

    def per_example(x: jax.Array, y: jax.Array) -> Any:
        return hx.value_grad_and_stats(lambda x: mse(model, x, y), stats=ALL)(x)

    _, gx, stats = jax.jit(jax.vmap(per_example))(x, y)
    _, acts = jax.vmap(hx.capture(lambda x: model(x)))(x)
    _, ref_gx, act_grads = jax.vmap(lambda x, y: hx.value_and_grad(lambda x: mse(model, x, y))(x))(
        x, y
    )
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-6, atol=1e-8)
    assert_stats_match(stats, acts, act_grads, dict.fromkeys(acts, 1))
    assert stats["layers/0"]["act"]["norm"].shape == (6,)


class VmapInside(nnx.Module):
    """A layer run per example by ``jax.vmap`` inside the model."""

    def __init__(self) -> None:
        self.lin = nnx.Linear(W, W, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(W, 2, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(lambda row: jnp.tanh(self.lin(row)))(x)
        return self.head(h)


@pytest.mark.parametrize("mode", JIT)
def test_vmap_inside_the_model_gives_one_value_per_example(mode: str, data: Any) -> None:
    x, y = data
    model = VmapInside()
    stats_fn = hx.value_grad_and_stats(mse, stats=ALL, per_example=True)
    step = JIT[mode](lambda m, x, y: stats_fn(m, x, y))
    _, _, stats = step(model, x, y)
    _, acts = hx.capture(model)(x)
    _, _, act_grads = hx.value_and_grad(mse)(model, x, y)
    assert stats["lin"]["act"]["norm"].shape == (6,)
    assert_stats_match(stats, acts, act_grads, {"lin": 1})


class Twice(nnx.Module):
    def __init__(self) -> None:
        self.lin = nnx.Linear(W, W, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(W, 2, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = self.head(self.lin(self.lin(x)))
        return h, jnp.argmax(h, axis=-1)


@pytest.mark.parametrize("mode", JIT)
def test_calls_stacked_aux_argnums_and_integer_outputs(mode: str, data: Any) -> None:
    x, y = data
    model = Twice()

    def loss(m: Twice, x: jax.Array) -> Any:
        h, idx = m(x)
        return jnp.mean((h - y) ** 2), idx

    (value, idx), (gm, gx), stats = JIT[mode](
        hx.value_grad_and_stats(loss, argnums=(0, 1), has_aux=True, stats=("norm", "max_abs"))
    )(model, x)
    (ref, ref_idx), (rgm, rgx), act_grads = hx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        model, x
    )
    _, acts = hx.capture(model)(x)
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    np.testing.assert_array_equal(idx, ref_idx)
    assert_grads_equal((gm, gx), (rgm, rgx))
    assert set(stats["lin"]["act"]) == {"norm", "max_abs"}  # (jit returns dicts key-sorted)
    # two calls of "lin": stacked in call order; the root's integer output is left out
    for kind, values in (("act", acts["lin"]), ("grad", act_grads["lin"])):
        want = [np.linalg.norm(np.asarray(v)) for v in values]
        np.testing.assert_allclose(stats["lin"][kind]["norm"], want, rtol=1e-5)
    np.testing.assert_allclose(stats[""]["act"]["norm"], np.linalg.norm(acts[""][0][0]), rtol=1e-5)


def test_optax_train_step_under_nnx_jit(data: Any) -> None:
    """Statistics from inside a real train step: the update is the plain step's, bit for bit."""
    x, y = data
    model, ref_model = Stack(), Stack()
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model: Stack, opt: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads, stats = hx.value_grad_and_stats(mse, where="blocks/lin")(model, x, y)
        opt.update(model, grads)
        return loss, stats

    @nnx.jit
    def plain(model: Stack, opt: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = nnx.value_and_grad(mse)(model, x, y)
        opt.update(model, grads)
        return loss

    for _ in range(3):
        _, _, act_grads = hx.value_and_grad(mse, where="blocks/lin")(model, x, y)
        _, acts = hx.capture(lambda m, x: m(x), where="blocks/lin")(model, x)
        with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes Python floats and int32
            loss, stats = step(model, opt, x, y)
            ref_loss = plain(ref_model, ref_opt, x, y)
        np.testing.assert_array_equal(loss, ref_loss)
        assert list(stats) == ["blocks/lin"]
        want = numpy_stats(act_grads["blocks/lin"][0], 1)["norm"]
        np.testing.assert_allclose(stats["blocks/lin"]["grad"]["norm"], want, rtol=2e-5)
        want = numpy_stats(acts["blocks/lin"][0], 1)["max_abs"]
        np.testing.assert_allclose(stats["blocks/lin"]["act"]["max_abs"], want, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref_model))):
        np.testing.assert_array_equal(a, b)


def test_nonfinite_counts_and_statistics_of_a_poisoned_layer(data: Any) -> None:
    x, y = data
    model = MLP(nnx.Rngs(0))
    model.layers[1].lin.kernel[0, 0] = jnp.nan
    _, _, stats = jax.jit(hx.value_grad_and_stats(mse))(model, x, y)
    assert float(stats["layers/0"]["act"]["nonfinite"]) == 0
    # column 0 of layers/1's output is NaN for every row with x[:, 0] != 0; relu keeps NaN
    assert float(stats["layers/1/lin"]["act"]["nonfinite"]) == x.shape[0]
    assert np.isnan(stats["layers/1"]["act"]["norm"])


def test_no_activation_sized_memory_per_layer() -> None:
    """Nothing is stacked per layer: the compiled step's extra temporary memory over the plain
    step does not grow with the number of layers (stacking the values would add one activation
    per layer and call site), and no argument is added but the statistics' dummies."""
    x = jax.random.normal(jax.random.key(1), (256, W))
    y = jax.random.normal(jax.random.key(2), (256, 2))
    activation = x.size * 4

    def extra(n: int) -> tuple[int, int]:
        model = Stack(n=n)
        plain = nnx.jit(nnx.value_and_grad(mse)).lower(model, x, y).compile().memory_analysis()
        ours = nnx.jit(hx.value_grad_and_stats(mse)).lower(model, x, y).compile()
        mem = ours.memory_analysis()
        args = mem.argument_size_in_bytes - plain.argument_size_in_bytes
        return mem.temp_size_in_bytes - plain.temp_size_in_bytes, args

    (small, args_small), (big, args_big) = extra(4), extra(16)
    assert big - small < 12 * activation // 16, (small, big)
    assert args_small == args_big == 0


def test_trace_counts(data: Any, traces: Any) -> None:
    x, y = data
    model = MLP(nnx.Rngs(0))

    @nnx.jit(static_argnums=3)
    def step(m: MLP, x: jax.Array, y: jax.Array, stats: Any) -> Any:
        traces()
        return hx.value_grad_and_stats(mse, stats=stats)(m, x, y)[2]

    step(model, x, y, ("norm",))
    step(model, x, y, ("norm",))
    assert traces.n == 1
    stats = step(model, x, y, ("mean",))
    assert traces.n == 2 and list(stats["head"]["act"]) == ["mean"]


def test_errors(data: Any) -> None:
    x, y = data
    model = MLP(nnx.Rngs(0))
    with pytest.raises(hx.HookaxError, match=r"'median' is unknown\). Known: norm, rms"):
        hx.value_grad_and_stats(mse, stats=("norm", "median"))
    with pytest.raises(hx.HookaxError, match="expects a loss function"):
        hx.value_grad_and_stats(None)  # type: ignore[arg-type]
    with pytest.raises(hx.SelectorError, match="no_such"):
        hx.value_grad_and_stats(mse, where="no_such/*")(model, x, y)
    with pytest.raises(hx.HookaxError, match=r"argnums=3 names no positional argument"):
        hx.value_grad_and_stats(mse, argnums=3)(model, x, y)
    assert_clean()


def test_sharded_batch_equals_unsharded(data: Any) -> None:
    x, y = data
    x, y = jnp.tile(x, (4, 1)), jnp.tile(y, (4, 1))  # 24 rows over 8 devices
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    model = Stack()
    step = nnx.jit(hx.value_grad_and_stats(mse))
    _, _, ref = step(model, x, y)
    _, _, stats = step(model, jax.device_put(x, rows), jax.device_put(y, rows))
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["nnx", "linen", "equinox"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_every_framework(name: str, mode: str) -> None:
    """Linen's parameter dicts and Equinox modules too, under each framework's own jit."""
    from .test_conformance import X, _make

    fw = _make(name)
    step = hx.value_grad_and_stats(fw.loss, stats=ALL)
    _, grads, stats = (step if mode == "eager" else fw.jit(step))(fw.state, X)
    _, acts = hx.capture(fw.apply)(fw.state, X)
    _, ref_grads, act_grads = hx.value_and_grad(fw.loss)(fw.state, X)
    assert set(stats) == {"", *fw.keys}
    assert_stats_match(stats, acts, act_grads, {})
    assert_grads_equal(grads, ref_grads)
    assert hx.find_nonfinite(fw.loss, fw.state, X) is None


def test_one_buffer_leaves_the_step_keys_in_call_order(data: Any) -> None:
    """Every statistic lives in one array (one output buffer of the jitted step); the keys are
    in the order the call sites finished, also under jit (no dict key sorting)."""
    x, y = data
    model = MLP(nnx.Rngs(0))
    _, _, stats = jax.jit(hx.value_grad_and_stats(mse))(model, x, y)
    assert isinstance(stats, hx.Stats) and len(jax.tree.leaves(stats)) == 1
    order = ["layers/0/lin", "layers/0", "layers/1/lin", "layers/1", "layers/2/lin", "layers/2"]
    assert list(stats) == [*order, "head", ""]
    assert stats.array.shape == (8 * 2 * 5,)
    plain = stats.to_dict()
    assert list(plain["head"]) == ["act", "grad"]
    assert list(plain["head"]["act"]) == ["norm", "mean", "max_abs", "frac_zero", "nonfinite"]
    np.testing.assert_array_equal(plain["head"]["grad"]["norm"], stats["head"].array[1, 0])
    with pytest.raises(KeyError):
        stats["nope"]
    with pytest.raises(KeyError):
        stats["head"]["weights"]
    assert repr(stats).startswith("Stats(keys=['layers/0/lin', ")


@jax.custom_vjp
def hand_tap(x: jax.Array, dummy: jax.Array) -> jax.Array:
    return x


def _hand_reduce(x: jax.Array) -> jax.Array:
    return jnp.stack(
        [
            jnp.sqrt(jnp.sum(x * x)),
            jnp.mean(x),
            jnp.max(jnp.abs(x)),
            jnp.mean((x == 0).astype(jnp.float32)),
            jnp.sum((~jnp.isfinite(x)).astype(jnp.float32)),
        ]
    )


hand_tap.defvjp(
    lambda x, d: (x, _hand_reduce(x)),
    lambda fwd, ct: (ct, jnp.concatenate([fwd, _hand_reduce(ct)])),
)


def test_compiled_step_has_no_more_kernels_than_hand_written_taps(data: Any) -> None:
    """The same program as the hand-written method (DESIGN.md point 19: a custom_vjp identity
    per layer, dummies threaded by hand), counted in kernels of the compiled step."""
    x, y = data
    model = MLP(nnx.Rngs(0))

    def hand_loss(model: MLP, dummies: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        h = x
        for i, layer in enumerate(model.layers):
            h = hand_tap(layer(h), dummies[i])
        return jnp.mean((model.head(h) - y) ** 2)

    def kernels(fn: Any, *args: Any) -> int:
        hlo = jax.jit(fn).lower(*args).compile().as_text()
        entry = hlo[hlo.index("ENTRY") :]
        return len(re.findall(r" (?:fusion|concatenate|reduce)\(", entry))

    dummies = jnp.zeros((3, 10))
    hand = kernels(nnx.value_and_grad(hand_loss, argnums=(0, 1)), model, dummies, x, y)
    ours = kernels(hx.value_grad_and_stats(mse, where="layers/*"), model, x, y)
    plain = kernels(nnx.value_and_grad(mse), model, x, y)
    assert plain < ours <= hand


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_one_layer_selection(mode: str, data: Any) -> None:
    """``where="blocks/lin[1]"``: the statistics of that layer only, under its own key."""
    x, y = data
    model = Stack(n=3)
    step = JIT[mode](lambda m, x, y: hx.value_grad_and_stats(mse, where="blocks/lin[1]")(m, x, y))
    _, _, stats = step(model, x, y)
    assert list(stats) == ["blocks/lin[1]"]
    _, acts = hx.capture(model, where="blocks/lin")(x)
    _, _, act_grads = hx.value_and_grad(mse, where="blocks/lin")(model, x, y)
    want_act = numpy_stats(acts["blocks/lin"][0][1])
    want_grad = numpy_stats(act_grads["blocks/lin"][0][1])
    np.testing.assert_allclose(stats["blocks/lin[1]"]["act"]["norm"], want_act["norm"], rtol=2e-5)
    np.testing.assert_allclose(stats["blocks/lin[1]"]["grad"]["norm"], want_grad["norm"], rtol=2e-5)
    np.testing.assert_allclose(
        stats["blocks/lin[1]"]["grad"]["max_abs"], want_grad["max_abs"], rtol=2e-5
    )
