"""Sharded models on a mesh of 8 CPU devices: every feature works and changes no sharding.

The model's parameters are sharded with ``NamedSharding`` (``nnx.with_partitioning`` under
``jax.set_mesh``), its hidden activation is constrained with ``with_sharding_constraint``, and its
second layer computes with ``jax.shard_map``. Interceptors, forward and backward hooks, capture
and ``hx.value_and_grad`` keep every value's sharding, and the compiled programs contain exactly
the collectives and host transfers of the unhooked program (no gather, no transfer is added).
"""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hookax as hx
from tests.reliability_helpers import assert_clean

MODES = ["eager", "jit"]

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
INIT = nnx.initializers.lecun_normal()
HIDDEN = NamedSharding(MESH, P("data", "model"))
ROWS = NamedSharding(MESH, P("data", None))


class Up(nnx.Module):
    """A column-sharded Linear, relu, and a sharding constraint on the activation."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        kinit = nnx.with_partitioning(INIT, (None, "model"))
        self.lin = nnx.Linear(8, 16, kernel_init=kinit, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(jax.nn.relu(self.lin(x)), HIDDEN)


class Down(nnx.Module):
    """A row-sharded matmul written with ``jax.shard_map`` and a ``psum``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.kernel = nnx.Param(
            jax.device_put(INIT(rngs.params(), (16, 8)), NamedSharding(MESH, P("model", None)))
        )

    def __call__(self, h: jax.Array) -> jax.Array:
        def body(w: jax.Array, h: jax.Array) -> jax.Array:
            return jax.lax.psum(h @ w, "model")

        specs = (P("model", None), P("data", "model"))
        return jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=P("data", None))(
            self.kernel[...], h
        )


class Net(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.up = Up(rngs)
        self.down = Down(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.up(x))


@pytest.fixture(scope="module")
def net() -> Net:
    with jax.set_mesh(MESH):
        return Net()


@pytest.fixture(scope="module")
def x() -> jax.Array:
    data = jnp.arange(32 * 8, dtype=jnp.float32).reshape(32, 8) / 100 - 1
    return jax.device_put(data, ROWS)


def run(mode: str, fn: Any, *args: Any) -> Any:
    return fn(*args) if mode == "eager" else jax.jit(fn)(*args)


_OPS = re.compile(
    r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|collective-broadcast"
    r"|send|recv|infeed|outfeed)(?:-start)?\("
)
_METADATA = re.compile(r"metadata=\{[^}]*\}")
_HOST = re.compile(r"callback|host_transfer|_xla_host|MoveToHost|MoveToDevice")


def collectives(fn: Any, *args: Any) -> collections.Counter[str]:
    """The collective and host-transfer operations of ``jax.jit(fn)``'s compiled program."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    # Instructions only: the text's metadata and its table of source frames name the functions
    # that traced the program (a test called "..._host_transfer" would count as one).
    text = "\n".join(_METADATA.sub("", line) for line in text.splitlines() if " = " in line)
    found = collections.Counter(_OPS.findall(text))
    found["host transfers"] = len(_HOST.findall(text))
    return found


def same_sharding(a: jax.Array, want: NamedSharding) -> None:
    assert a.sharding.is_equivalent_to(want, a.ndim), (a.sharding, want)


def forward(m: Net, x: jax.Array) -> jax.Array:
    return m(x)


def loss(m: Net, x: jax.Array) -> jax.Array:
    return jnp.sum(m(x) ** 2)


def test_the_model_is_sharded(net, x):
    assert net.up.lin.kernel.sharding.spec == P(None, "model")
    assert net.down.kernel.sharding.spec == P("model", None)
    for mode in MODES:
        same_sharding(run(mode, forward, net, x), ROWS)
    base = collectives(forward, net, x)
    assert base["all-reduce"] == 1 and base["all-gather"] == 0 and base["host transfers"] == 0


def test_the_detector_sees_a_forced_gather_and_a_host_transfer(net, x):
    """A hook that does gather or call back to the host is seen: the checks below can fail."""
    base = collectives(forward, net, x)
    with hx.register_forward_hook(
        net.up, lambda m, a, out: jax.lax.with_sharding_constraint(out, NamedSharding(MESH, P()))
    ):
        assert collectives(forward, net, x)["all-gather"] > base["all-gather"]
    with hx.register_forward_hook(net.up, lambda m, a, out: jax.debug.callback(print, out)):
        assert collectives(forward, net, x)["host transfers"] > 0
    assert_clean(net)


@pytest.mark.parametrize("mode", MODES)
def test_interceptor_and_forward_hooks(net, x, mode):
    up = net.up(x)
    want = net.down(up * 2) + 1
    base = collectives(forward, net, x)

    def double(next_fun, args, kwargs, ctx):
        return next_fun(*args, **kwargs) * 2

    seen = []
    pre = hx.register_forward_pre_hook(net, lambda m, args: seen.append(args[0].shape), where="up")
    post = hx.register_forward_hook(net, lambda m, args, out: out + 1, where="down")
    with hx.intercept(double, where="up"):
        y = run(mode, forward, net, x)
        assert collectives(forward, net, x) == base
    np.testing.assert_allclose(y, want, rtol=1e-6)
    same_sharding(y, ROWS)
    assert seen[0] == (32, 8)
    pre.remove()
    post.remove()
    assert_clean(net)


@pytest.mark.parametrize("mode", MODES)
def test_backward_hooks(net, x, mode):
    grad = nnx.grad(loss, argnums=(0, 1))
    (g_model, g_x) = run(mode, grad, net, x)
    base = collectives(grad, net, x)

    shapes = []

    def record(m, grad_input, grad_output):
        shapes.append((grad_input[0].shape, grad_output[0].shape))

    a = hx.register_full_backward_pre_hook(net, lambda m, g: (g[0] * 2,), where="down")
    b = hx.register_full_backward_hook(net, record, where="up")
    (h_model, h_x) = run(mode, grad, net, x)
    assert shapes == [((32, 8), (32, 16))]
    assert collectives(grad, net, x) == base
    a.remove()
    b.remove()
    assert_clean(net)
    # Doubling d loss / d (down's output) doubles every gradient behind it, keeping shardings.
    np.testing.assert_allclose(h_x, 2 * g_x, rtol=1e-6)
    pairs = zip(jax.tree.leaves(h_model), jax.tree.leaves(g_model))
    for h, g in pairs:
        np.testing.assert_allclose(h, 2 * g, rtol=1e-6)
        assert h.sharding.is_equivalent_to(g.sharding, g.ndim)
    same_sharding(h_x, ROWS)


@pytest.mark.parametrize("mode", MODES)
def test_capture_keeps_each_activations_sharding(net, x, mode):
    base = collectives(forward, net, x)
    y, acts = run(mode, hx.capture(net), x)
    assert collectives(hx.capture(net), x) == base
    lin = x @ net.up.lin.kernel[...] + net.up.lin.bias[...]
    hidden = jax.nn.relu(lin)
    want = {"": hidden @ net.down.kernel[...], "up": hidden, "up/lin": lin}
    want["down"] = want[""]
    assert set(acts) == set(want)
    for key, value in want.items():
        (got,) = acts[key]
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y, acts[""][0])
    same_sharding(acts["up"][0], HIDDEN)
    same_sharding(acts["up/lin"][0], HIDDEN)
    same_sharding(acts["down"][0], ROWS)
    same_sharding(acts[""][0], ROWS)
    assert_clean(net)


@pytest.mark.parametrize("mode", MODES)
def test_value_and_grad_of_activations(net, x, mode):
    base = collectives(nnx.value_and_grad(loss), net, x)
    want_loss, want_grads = nnx.value_and_grad(loss)(net, x)
    value, grads, act_grads = run(mode, hx.value_and_grad(loss), net, x)
    assert collectives(hx.value_and_grad(loss), net, x) == base
    np.testing.assert_allclose(value, want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
        assert g.sharding.is_equivalent_to(w.sharding, w.ndim)
    y = net(x)
    np.testing.assert_allclose(act_grads[""][0], 2 * y, rtol=1e-6)
    np.testing.assert_allclose(act_grads["down"][0], 2 * y, rtol=1e-6)
    same_sharding(act_grads[""][0], ROWS)
    same_sharding(act_grads["up"][0], HIDDEN)
    assert_clean(net)


@pytest.mark.parametrize("mode", MODES)
def test_hooks_intercept_and_capture_inside_a_shard_map_body(net, x, mode):
    """Data parallel: the model runs per shard inside ``jax.shard_map``; hooks run per shard."""
    small = nnx.Linear(8, 4, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(small)
    want = small(x)

    def per_shard(state: Any, x: jax.Array) -> Any:
        m = nnx.merge(graphdef, state)
        return hx.capture(m)(x)

    body = jax.shard_map(
        per_shard, mesh=MESH, in_specs=(P(), P("data")), out_specs=(P("data"), P("data"))
    )
    shard_shapes = []

    def note_shape(next_fun, args, kwargs, ctx):
        shard_shapes.append(args[0].shape)
        return next_fun(*args, **kwargs)

    with hx.register_forward_hook(small, lambda m, a, out: out * 3):
        graphdef, state = nnx.split(small)  # the hooks travel in the graphdef
        with hx.intercept(note_shape):
            y, acts = run(mode, body, state, x)
    np.testing.assert_allclose(y, want * 3, rtol=1e-6)
    np.testing.assert_array_equal(acts[""][0], y)
    same_sharding(acts[""][0], NamedSharding(MESH, P("data")))
    assert shard_shapes[0] == (16, 8)  # the per-shard batch: 32 rows over 2 data shards
    assert_clean(small)
