"""Eager code under hookax: each program JAX runs (a primitive's one-operation program, one of
JAX's own ``jax.jit`` functions) runs with NumPy on its first call while XLA compiles it on
hookax's compile thread; the call after the compile is JAX's own, compiled once."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import hookax as hx
from hookax._engine import eager, firstcall
from hookax._util import jaxcompat

from .test_new_data import compiles


class MLP(nnx.Module):
    def __init__(self, d_in, d_hidden, rngs):
        self.up = nnx.Linear(d_in, d_hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(d_hidden, rngs=rngs)
        self.down = nnx.Linear(d_hidden, 3, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.norm(self.up(x))))


def loss_fn(model, x):
    return jnp.mean(jax.nn.log_softmax(model(x))[..., 0])


def _case(d_hidden):
    """A model and input of shapes no other test uses: every program is new to JAX's caches."""
    model = MLP(5, d_hidden, nnx.Rngs(0))
    x = jnp.linspace(-1.0, 1.0, 4 * 5).reshape(4, 5)
    return model, x


def _values(out):
    return [np.asarray(v) for v in jax.tree.leaves(out)]


def _python_dispatches(monkeypatch):
    """How many calls take JAX's Python path (a compile, or a call JAX's C++ cache lacks)."""
    counter = collections.Counter()
    inner = jaxcompat.pjit._pjit_call_impl_python

    def spy(*args, **params):
        counter["calls"] += 1
        return inner(*args, **params)

    monkeypatch.setattr(jaxcompat.pjit, "_pjit_call_impl_python", spy)
    return counter


@pytest.fixture(autouse=True)
def _fresh():
    jax.clear_caches()
    firstcall.OPS.join()
    yield
    firstcall.OPS.join()


def test_eager_value_and_grad_runs_numpy_first_and_compiles_each_program_once(monkeypatch):
    model, x = _case(11)
    jax.clear_caches()  # (building them compiled programs)
    with hx.first_call("compile"), compiles() as reference:
        want = _values(hx.value_and_grad(loss_fn)(model, x))
    jax.clear_caches()
    before = firstcall.OPS.interpreted
    with hx.first_call("auto"):
        with compiles() as foreground:
            first = _values(hx.value_and_grad(loss_fn)(model, x))
        assert firstcall.OPS.interpreted > before  # its programs ran with NumPy
        # ... instead of being compiled before they ran (the few left: no NumPy form here)
        assert len(foreground) < len(reference) // 4, (foreground, reference)
        with compiles() as background:
            firstcall.OPS.join()
        seen = firstcall.OPS.interpreted
        with compiles() as after:
            again = _values(hx.value_and_grad(loss_fn)(model, x))
        assert after == [] and firstcall.OPS.interpreted == seen  # compiled, and used
        dispatches = _python_dispatches(monkeypatch)
        third = _values(hx.value_and_grad(loss_fn)(model, x))
    assert dispatches["calls"] == 0  # JAX's C++ dispatch holds every program now
    # Nothing compiled twice: the same programs as compiling first.
    assert collections.Counter(foreground + background) == collections.Counter(reference)
    for a, b, c, w in zip(first, again, third, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(b, w)
        np.testing.assert_array_equal(c, w)


def test_eager_capture_at_new_shapes_runs_numpy_first():
    model, x = _case(13)
    jax.clear_caches()
    with hx.first_call("compile"):
        y_want, acts_want = hx.capture(model)(x)
    jax.clear_caches()
    before = firstcall.OPS.interpreted
    with hx.first_call("auto"), compiles() as names:
        y, acts = hx.capture(model)(x)
    assert firstcall.OPS.interpreted > before and len(names) < 4, names
    np.testing.assert_allclose(y, y_want, rtol=1e-5, atol=1e-6)
    assert acts.keys() == acts_want.keys()
    for k in acts:
        np.testing.assert_allclose(acts[k][0], acts_want[k][0], rtol=1e-5, atol=1e-6)


def _double_under_an_entry(x):
    """Eager operations inside a hookax workflow (the block ``hx.capture`` and
    ``hx.value_and_grad`` run the user's code in), with an entry active."""
    with eager.eager_workflow(), hx.intercept(lambda nf, a, k, c: nf(*a, **k), where="no/site"):
        return jnp.sin(x) * 2.0 + 1.0


@pytest.mark.parametrize("committed", [True, False])
def test_results_stay_where_jax_puts_them(committed):
    device = jax.devices()[-1] if committed else jax.devices()[0]
    x = jnp.arange(7.0) / 3
    x = jax.device_put(x, device) if committed else x
    with hx.first_call("compile"):
        want = _double_under_an_entry(x)
    jax.clear_caches()
    before = firstcall.OPS.interpreted
    with hx.first_call("interpret"):
        got = _double_under_an_entry(x)
    assert firstcall.OPS.interpreted > before
    assert got.devices() == want.devices() == {device}
    assert got._committed == want._committed == committed
    assert got.dtype == want.dtype and got.weak_type == want.weak_type
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_sharded_values_are_compiled_as_jax_does():
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, PartitionSpec("d")))
    before = firstcall.OPS.interpreted
    with hx.first_call("interpret"):
        got = _double_under_an_entry(x)
    assert firstcall.OPS.interpreted == before
    assert got.sharding.is_equivalent_to(x.sharding, 1)


def test_debug_nans_is_checked_by_the_compiled_program():
    x = -jnp.ones(9)
    with (
        hx.first_call("interpret"),
        jax.debug_nans(True),
        eager.eager_workflow(),
        pytest.raises(FloatingPointError),
    ):
        jnp.log(x)


def test_nothing_changes_while_hookax_is_idle():
    x = jnp.arange(5.0) * 0.7
    before = firstcall.OPS.interpreted
    with hx.first_call("interpret"):
        jax.block_until_ready(jnp.cos(x) - 3.0)
    assert firstcall.OPS.interpreted == before


def test_a_no_op_interceptor_around_eager_code_changes_no_value():
    model, x = _case(17)
    plain = model(x)
    jax.clear_caches()
    before = firstcall.OPS.interpreted
    with hx.first_call("interpret"), hx.intercept(lambda nf, a, k, c: nf(*a, **k)):
        got = model(x)  # XLA's programs, as without hookax
    assert firstcall.OPS.interpreted == before
    np.testing.assert_array_equal(got, plain)


def _eqx_case():
    import equinox as eqx

    model = eqx.nn.MLP(5, 3, 9, 2, key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 5)
    return model, x


def _linen_case():
    import flax.linen as nn

    model = nn.Sequential([nn.Dense(9), nn.tanh, nn.Dense(3)])
    x = jnp.linspace(-1.0, 1.0, 10).reshape(2, 5)
    variables = model.init(jax.random.key(0), x)
    return (lambda v, x: model.apply(v, x)), variables, x


@pytest.mark.parametrize("kind", ["equinox", "linen"])
def test_eager_value_and_grad_on_other_frameworks(kind):
    if kind == "equinox":
        model, x = _eqx_case()
        fn = hx.value_and_grad(lambda m, x: jnp.sum(jnp.tanh(m(x))), where="layers/*")
    else:
        apply, model, x = _linen_case()
        fn = hx.value_and_grad(lambda v, x: jnp.sum(jnp.tanh(apply(v, x))))
    jax.clear_caches()
    with hx.first_call("compile"):
        want = _values(fn(model, x))
    jax.clear_caches()
    before = firstcall.OPS.interpreted
    with hx.first_call("auto"):
        got = _values(fn(model, x))
    assert firstcall.OPS.interpreted > before
    assert len(got) == len(want)
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6)


def test_results_of_programs_given_no_array_go_to_the_default_device():
    def make():
        with eager.eager_workflow():  # no array; then one made there, uncommitted
            return jnp.sin(jnp.full((4,), 2.5, jnp.float32)) * 3.0

    for device in (None, jax.devices()[2]):
        with jax.default_device(device):
            with hx.first_call("compile"):
                want = make()
            jax.clear_caches()
            before = firstcall.OPS.interpreted
            with hx.first_call("interpret"):
                got = make()
        assert firstcall.OPS.interpreted > before
        assert got.devices() == want.devices() and got._committed == want._committed
        np.testing.assert_allclose(got, want, rtol=1e-6)  # NumPy's sin, XLA's
        firstcall.OPS.join()


def test_under_jit_the_workflow_is_part_of_the_compiled_program():
    model, x = _case(19)

    @nnx.jit
    def step(model, x):
        loss, grads, act_grads = hx.value_and_grad(loss_fn)(model, x)
        _, acts = hx.capture(model)(x)
        return loss, grads, act_grads, acts

    with hx.first_call("compile"):
        want = _values(step(model, x))
    jax.clear_caches()
    before = firstcall.OPS.interpreted
    with hx.first_call("interpret"), compiles() as names:
        got = _values(step(model, x))
    assert firstcall.OPS.interpreted == before  # compiled as the user's program, not NumPy
    assert names.count("jit(step)") == 1, names
    for a, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, w)
