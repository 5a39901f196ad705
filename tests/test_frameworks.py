"""What is particular to Flax Linen and Equinox: parity with their own tools, their transforms."""

from __future__ import annotations

import io
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import hookax as hx
from hookax._engine import context as _context

from .test_conformance import close, keys


def zero(next_fun: Any, args: tuple, kwargs: dict, ctx: Any) -> Any:
    return next_fun(*args, **kwargs) * 0


def zero_out(m: Any, args: tuple, output: Any) -> Any:
    return output * 0


def zero_grad(m: Any, grad_output: tuple) -> tuple:
    return (grad_output[0] * 0,)


@pytest.fixture(autouse=True)
def nothing_left_active() -> Any:
    yield
    assert _context.active_entries() == ()


# ---------------------------------------------------------------------------------------------
# Flax Linen


class Block(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(nn.Dense(3, name="lin")(x))


class ScanCell(nn.Module):
    @nn.compact
    def __call__(self, c: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return Block(name="blk")(c), None


class Lifted(nn.Module):
    """Named layers, a setup-built list, nn.remat, nn.scan and nn.vmap."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(3, name="inp")(x)
        x = nn.remat(Block)(name="rem")(x)
        scan = nn.scan(ScanCell, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        x, _ = scan(name="scanned")(x, None)
        vmap = nn.vmap(
            Block, variable_axes={"params": None}, split_rngs={"params": False}, in_axes=0
        )
        return vmap(name="vm")(x[None])[0]


@pytest.fixture(scope="module")
def lifted() -> tuple[Lifted, Any]:
    model = Lifted()
    return model, model.init(jax.random.key(0), jnp.ones((2, 3)))


def test_linen_paths_through_lifted_transforms_setup_not_a_call_site(lifted: Any) -> None:
    model, params = lifted
    rec = keys()
    with hx.intercept(rec):
        model.apply(params, jnp.ones((2, 3)))
    # nn.scan traces its body twice; nn.remat's internal <lambda> is not a call site
    body = [("scanned", "ScanCell"), ("scanned/blk", "Block"), ("scanned/blk/lin", "Dense")]
    assert rec.seen == [
        ("", "Lifted"),
        ("inp", "Dense"),
        ("rem", "Block"),
        ("rem/lin", "Dense"),
        *body,
        *body,
        ("vm", "Block"),
        ("vm/lin", "Dense"),
    ]


class WithSetup(nn.Module):
    def setup(self) -> None:
        self.layers = [nn.Dense(2), nn.Dense(2)]

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.double(self.layers[1](self.layers[0](x)))

    def double(self, x: jax.Array) -> jax.Array:
        return x * 2


def test_linen_setup_and_public_methods(traces: Any) -> None:
    model = WithSetup()
    x = jnp.ones((1, 2))
    params = model.init(jax.random.key(0), x)
    rec = keys()
    with hx.intercept(rec):
        model.apply(params, x)
    assert rec.seen == [
        ("", "WithSetup"),
        ("layers_0", "Dense"),
        ("layers_1", "Dense"),
        (":double", "WithSetup"),
    ]
    # a capture inside jax.jit of apply, cache-keyed: the same capture hits the cache
    fn = jax.jit(lambda p, x: (traces(), hx.capture(model.apply, where=nn.Dense)(p, x))[1])
    for _ in range(2):
        _, acts = fn(params, x)
        assert list(acts) == ["layers_0", "layers_1"]
    assert traces.n == 1


def test_linen_capture_equals_capture_intermediates() -> None:
    model = WithSetup()
    x = jnp.arange(4.0, dtype=jnp.float32).reshape(2, 2)
    params = model.init(jax.random.key(0), x)
    _, state = model.apply(
        params,
        x,
        capture_intermediates=lambda m, name: isinstance(m, nn.Dense),
        mutable=["intermediates"],
    )
    _, acts = hx.capture(model.apply, where=nn.Dense)(params, x)
    inter = state["intermediates"]
    assert set(acts) == {"layers_0", "layers_1"}
    for key, values in acts.items():
        theirs = inter[key]["__call__"]
        assert len(values) == len(theirs) == 1
        close(values[0], theirs[0])


def test_linen_capture_inside_lifted_transforms(lifted: Any) -> None:
    model, params = lifted
    x = jnp.ones((2, 3))
    fwd = hx.capture(model.apply, where=hx.Select(paths="scanned/**"))
    _, acts = fwd(params, x)
    assert acts, "nothing captured inside nn.scan"
    for key, values in acts.items():
        for v in jax.tree.leaves(values):
            assert v.shape[0] == jax.tree.leaves(params["params"]["scanned"])[0].shape[0], key
    # Call sites outside the lifted transforms are captured as usual.
    _, acts = hx.capture(model.apply, where="inp")(params, jnp.ones((2, 3)))
    assert [v.shape for v in acts["inp"]] == [(2, 3)]


def test_linen_intercept_methods_is_cache_correct_under_jit_when_keyed(traces: Any) -> None:
    previous = hx.key_linen_interceptors()  # opt in (default: Linen's behaviour, unkeyed)
    try:
        _check_linen_intercept_methods_keyed(traces)
    finally:
        hx.key_linen_interceptors(previous)


def _check_linen_intercept_methods_keyed(traces: Any) -> None:
    model = nn.Dense(2)
    x = jnp.ones((1, 3))
    params = model.init(jax.random.key(0), x)
    f = jax.jit(lambda p, x: (traces(), model.apply(p, x))[1])
    plain = f(params, x)
    with nn.intercept_methods(zero):
        close(f(params, x), jnp.zeros((1, 2)))  # Linen alone would reuse the stale trace
    close(f(params, x), plain)
    with hx.intercept(zero):
        close(f(params, x), jnp.zeros((1, 2)))
    with nn.intercept_methods(zero):
        f(params, x)
    assert traces.n == 3


def test_linen_hooks_and_hook_grad_inside_nn_scan(lifted: Any) -> None:
    model, params = lifted
    x = jnp.ones((2, 3))

    def loss(x: jax.Array) -> jax.Array:
        return jnp.sum(model.apply(params, x))

    grad = jax.jit(jax.grad(loss))
    assert float(jnp.abs(grad(x)).sum()) > 0
    with hx.hooks(where="scanned/blk/lin", backward_pre=zero_grad):
        # the scanned layer's gradient is cut: nothing reaches the input through the scan
        close(grad(x), jnp.zeros_like(x))


# ---------------------------------------------------------------------------------------------
# Equinox


class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    mlp: eqx.nn.MLP
    scale: jax.Array

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 2, 3, key=k1)
        self.mlp = eqx.nn.MLP(8, 2, 4, 1, key=k2)
        self.scale = jnp.array(2.0, jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.conv(x).reshape(-1)) * self.scale

    def head(self, h: jax.Array) -> jax.Array:
        return self.mlp(h)


@pytest.fixture(scope="module")
def net() -> Net:
    return Net(jax.random.key(0))


XI = jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float32).reshape(1, 4, 4)


def test_equinox_library_layers_paths_and_internal_wrappers(net: Net) -> None:
    expected = [
        ("", "Net"),
        ("conv", "Conv2d"),
        (":head", "Net"),
        ("mlp", "MLP"),
        ("mlp/layers/0", "Linear"),
        ("mlp/layers/1", "Linear"),
    ]
    for run in (
        lambda: net(XI),
        lambda: eqx.filter_jit(net)(XI),
        lambda: eqx.filter_jit(lambda m, x: m(x))(net, XI),
        lambda: eqx.filter_vmap(net)(XI[None])[0],
        lambda: eqx.filter_grad(lambda m, x: jnp.sum(m(x)))(net, XI),
        lambda: eqx.Partial(net)(XI),
    ):
        rec = keys()
        with hx.intercept(rec):
            run()
        assert rec.seen == expected
    rec = keys()
    with hx.intercept(rec):
        net.head(jnp.ones(8))  # a BoundMethod: the module is the root, the wrapper is nothing
    assert rec.seen == [(":head", "Net"), *expected[3:]]


def test_equinox_filter_jit_cache_and_pytree_tools(net: Net, traces: Any) -> None:
    f = eqx.filter_jit(lambda m, x: (traces(), m(x))[1])
    plain = f(net, XI)
    with hx.hooks(where=eqx.nn.Conv2d, forward=zero_out):
        hooked = f(net, XI)
    close(f(net, XI), plain)
    with hx.hooks(where=eqx.nn.Conv2d, forward=zero_out):
        close(f(net, XI), hooked)
    assert traces.n == 2
    # the model itself is untouched: same pytree, same tools
    dyn, static = eqx.partition(net, eqx.is_array)
    close(eqx.combine(dyn, static)(XI), plain)
    doubled = eqx.tree_at(lambda m: m.scale, net, jnp.array(4.0, jnp.float32))
    close(f(doubled, XI), 2 * plain)
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, net)
    buf.seek(0)
    back = eqx.tree_deserialise_leaves(buf, net)
    close(back(XI), plain)
    assert traces.n == 2  # a new scale is a new array, not a new trace
    with hx.intercept(keys()):
        pass
    assert jax.tree.structure(net) == jax.tree.structure(Net(jax.random.key(1)))


class Perturbed(eqx.Module):
    """The hand-written way: wrap a layer so a zero array is added to its output."""

    layer: Any
    delta: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layer(x) + self.delta


def test_equinox_activation_grads_equal_tree_at_perturbation(net: Net) -> None:
    def loss(m: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(m(x) ** 2)

    _, grads, act_grads = hx.value_and_grad(loss, where=eqx.nn.Linear)(net, XI)
    layers = net.mlp.layers
    wrapped = eqx.tree_at(
        lambda m: m.mlp.layers,
        net,
        (
            Perturbed(layers[0], jnp.zeros(4, jnp.float32)),
            Perturbed(layers[1], jnp.zeros(2, jnp.float32)),
        ),
    )

    def by_delta(deltas: Any, m: Any, x: jax.Array) -> jax.Array:
        m = eqx.tree_at(lambda m: (m.mlp.layers[0].delta, m.mlp.layers[1].delta), m, deltas)
        return loss(m, x)

    zeros = (jnp.zeros(4, jnp.float32), jnp.zeros(2, jnp.float32))
    d0, d1 = jax.grad(by_delta)(zeros, wrapped, XI)
    close(act_grads["mlp/layers/0"][0], d0)
    close(act_grads["mlp/layers/1"][0], d1)
    own = eqx.filter_grad(loss)(net, XI)
    jax.tree.map(close, grads, own)
    assert grads.mlp.activation is None or not eqx.is_array(grads.mlp.activation)


def test_equinox_capture_under_filter_vmap_and_inner_transform(net: Net) -> None:
    xs = jnp.stack([XI, -XI])
    _, acts = eqx.filter_vmap(hx.capture(net, where=eqx.nn.Linear))(xs)
    assert [v.shape for v in acts["mlp/layers/1"]] == [(2, 2)]
    _, inner = hx.capture(lambda m, x: jax.vmap(m)(x), where=eqx.nn.Conv2d)(net, xs)
    close(inner["conv"][0], jax.vmap(net.conv)(xs))


def test_equinox_summary_counts_every_float_array(net: Net) -> None:
    s = hx.summary(net, jax.ShapeDtypeStruct((1, 4, 4), jnp.float32))
    assert [r.key for r in s.rows] == [
        "",
        "conv",
        ":head",
        "mlp",
        "mlp/layers/0",
        "mlp/layers/1",
    ]
    conv = 2 * 9 + 2
    mlp = 8 * 4 + 4 + 4 * 2 + 2
    # ":head" is a method of the model, run by its __call__: counted on the model's row
    assert [r.params for r in s.rows] == [conv + mlp + 1, conv, 0, mlp, 36, 10]
    assert s.rows[2].params_in == ""
    assert s.totals.params == conv + mlp + 1
    assert s.rows[1].outputs == ("f32[2,2,2]",)
    assert s.rows[4].flops == s.rows[4].flops and s.rows[4].flops is not None
