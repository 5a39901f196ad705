"""hx.capture on Flax NNX: values, keys, order, transforms, cache keys, errors."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context
from hookax._transforms import tags as _tags

W = 4


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(W, W, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.lin(x))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, n: int = 3) -> None:
        self.layers = nnx.List([Block(rngs) for _ in range(n)])
        self.head = nnx.Linear(W, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Encoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(W, W, rngs=rngs)

    def encode(self, x: jax.Array) -> jax.Array:
        return self.lin(x) * 2.0

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.encode(self.encode(x))


def make_stack(n: int = 3) -> Any:
    class Stack(nnx.Module):
        def __init__(self) -> None:
            @nnx.vmap(in_axes=0, out_axes=0)
            def make(key: jax.Array) -> Block:
                return Block(nnx.Rngs(key))

            self.blocks = make(jax.random.split(jax.random.key(0), n))

        def __call__(self, x: jax.Array) -> jax.Array:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x: jax.Array, block: Block) -> jax.Array:
                return block(x)

            return body(x, self.blocks)

    return Stack()


@pytest.fixture
def model() -> MLP:
    return MLP(nnx.Rngs(0))


@pytest.fixture
def x() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (5, W))


def unrolled(model: MLP, x: jax.Array) -> dict[str, list[jax.Array]]:
    """The expected outputs, computed by hand."""
    acts: dict[str, list[jax.Array]] = {}
    h = x
    for i, layer in enumerate(model.layers):
        lin = layer.lin.kernel[...]
        acts[f"layers/{i}/lin"] = [h @ lin + layer.lin.bias[...]]
        h = jnp.tanh(acts[f"layers/{i}/lin"][0])
        acts[f"layers/{i}"] = [h]
    y = h @ model.head.kernel[...] + model.head.bias[...]
    acts["head"] = [y]
    acts[""] = [y]
    return acts


def assert_acts(acts: dict, expected: dict) -> None:
    assert sorted(acts) == sorted(expected)
    for key, values in expected.items():
        assert len(acts[key]) == len(values), key
        for got, want in zip(acts[key], values):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=key)


def assert_clean(model: Any) -> None:
    """Nothing stays active, no session stays open, no capture attribute stays on a module."""
    assert _context.active_entries() == ()
    assert _tags.depth() == 0
    for _, m in nnx.iter_modules(model):
        assert not [k for k in vars(m) if k.startswith("__hookax")], m


JIT = {
    "eager": lambda f: f,
    "jax.jit": jax.jit,
    "nnx.jit": nnx.jit,
}


@pytest.mark.parametrize("mode", JIT)
def test_values_keys_and_order(mode: str, model: MLP, x: jax.Array) -> None:
    forward = JIT[mode](lambda m, x: hx.capture(m)(x))
    y, acts = forward(model, x)
    expected = unrolled(model, x)
    assert_acts(acts, expected)
    np.testing.assert_allclose(y, expected[""][0], rtol=1e-6)
    order = ["", "layers/0", "layers/0/lin", "layers/1", "layers/1/lin"]
    order += ["layers/2", "layers/2/lin", "head"]
    # Keys in the order of each call site's first call (the order calls start); a dict that
    # comes back out of jax.jit has sorted keys, as every JAX pytree dict does.
    assert list(acts) == (order if mode == "eager" else sorted(order))
    assert all(isinstance(v, tuple) for v in acts.values())
    assert_clean(model)


@pytest.mark.parametrize("mode", JIT)
def test_parity_with_nnx_capture(mode: str, model: MLP, x: jax.Array) -> None:
    y, acts = JIT[mode](lambda m, x: hx.capture(m)(x))(model, x)
    y_nnx, st = JIT[mode](
        lambda m, x: nnx.capture(m, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)
    )(model, x)
    np.testing.assert_array_equal(y, y_nnx)
    flat = {
        "/".join(str(k) for k in path[:-1]): v.get_value()
        for path, v in nnx.to_flat_state(st)
        if path[-1] == "__call__"
    }
    assert sorted(flat) == sorted(acts)
    for key, values in flat.items():
        assert len(values) == len(acts[key])
        for a, b in zip(values, acts[key]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", JIT)
def test_where_and_methods(mode: str, x: jax.Array) -> None:
    enc = Encoder(nnx.Rngs(0))
    forward = JIT[mode](lambda m, x: hx.capture(m, where=hx.Select(methods="encode"))(x))
    y, acts = forward(enc, x)
    h1 = (x @ enc.lin.kernel[...] + enc.lin.bias[...]) * 2.0
    h2 = (h1 @ enc.lin.kernel[...] + enc.lin.bias[...]) * 2.0
    assert list(acts) == [":encode"]
    assert len(acts[":encode"]) == 2  # one per call, in call order
    np.testing.assert_allclose(acts[":encode"][0], h1, rtol=1e-5)
    np.testing.assert_allclose(acts[":encode"][1], h2, rtol=1e-5)
    np.testing.assert_allclose(y, h2, rtol=1e-5)

    model = MLP(nnx.Rngs(0))
    _, acts = JIT[mode](lambda m, x: hx.capture(m, where=Block)(x))(model, x)
    assert sorted(acts) == ["layers/0", "layers/1", "layers/2"]
    _, acts = JIT[mode](lambda m, x: hx.capture(m, where="**/lin")(x))(model, x)
    assert sorted(acts) == ["layers/0/lin", "layers/1/lin", "layers/2/lin"]


def test_function_closing_over_model(model: MLP, x: jax.Array) -> None:
    forward = hx.capture(lambda x: model(x) * 2.0, where=Block)
    y, acts = forward(x)
    expected = unrolled(model, x)
    np.testing.assert_allclose(y, 2 * expected[""][0], rtol=1e-5)
    assert_acts(acts, {k: expected[k] for k in ("layers/0", "layers/1", "layers/2")})
    y2, acts2 = jax.jit(forward)(x)
    np.testing.assert_allclose(y2, y, rtol=1e-6)
    assert_acts(acts2, acts)
    assert_clean(model)


def test_trace_counts(model: MLP, x: jax.Array, traces: Any) -> None:
    @nnx.jit(static_argnums=2)
    def forward(m: MLP, x: jax.Array, where: Any) -> Any:
        traces()
        return hx.capture(m, where=where)(x)

    forward(model, x, Block)
    forward(model, x, Block)
    assert traces.n == 1  # the same where= hits the cache
    _, acts = forward(model, x, "head")
    assert traces.n == 2 and list(acts) == ["head"]  # a different one retraces

    @nnx.jit
    def inner(m: MLP, x: jax.Array) -> jax.Array:
        traces()
        return m(x)

    traces.n = 0
    hx.capture(inner, where=Block)(model, x)
    _, acts = hx.capture(inner, where=Block)(model, x)
    assert traces.n == 1 and sorted(acts) == ["layers/0", "layers/1", "layers/2"]
    _, acts = hx.capture(inner, where="head")(model, x)
    assert traces.n == 2 and list(acts) == ["head"]
    inner(model, x)  # outside any capture: a trace of its own, never a captured one
    assert traces.n == 3


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_vmap_outside(mode: str, model: MLP) -> None:
    xs = jax.random.normal(jax.random.key(2), (3, 5, W))
    forward = JIT[mode](jax.vmap(hx.capture(model)))
    _, acts = forward(xs)
    for key in ("layers/1", "head"):
        want = jnp.stack([unrolled(model, xs[i])[key][0] for i in range(3)])
        np.testing.assert_allclose(acts[key][0], want, rtol=1e-5, atol=1e-6)
    _, acts = nnx.vmap(lambda m, x: hx.capture(m)(x), in_axes=(None, 0))(model, xs)
    assert acts["layers/0"][0].shape == (3, 5, W)


class VmapInside(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.block = Block(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        axes = nnx.StateAxes({nnx.Intermediate: 0, ...: None})
        return nnx.vmap(lambda b, x: b(x), in_axes=(axes, 0))(self.block, x)


@pytest.mark.parametrize("mode", JIT)
def test_nnx_vmap_inside(mode: str) -> None:
    m = VmapInside(nnx.Rngs(0))
    xs = jax.random.normal(jax.random.key(2), (3, W))
    _, acts = JIT[mode](lambda m, x: hx.capture(m)(x))(m, xs)
    lin = xs @ m.block.lin.kernel[...] + m.block.lin.bias[...]
    assert sorted(acts) == ["", "block", "block/lin"]
    np.testing.assert_allclose(acts["block/lin"][0], lin, rtol=1e-5)
    np.testing.assert_allclose(acts["block"][0], jnp.tanh(lin), rtol=1e-5)
    assert_clean(m)


@pytest.mark.parametrize("mode", JIT)
def test_nnx_scan_inside(mode: str) -> None:
    stack = make_stack(3)
    x = jax.random.normal(jax.random.key(1), (5, W))
    y, acts = JIT[mode](lambda m, x: hx.capture(m)(x))(stack, x)
    kernel, bias = stack.blocks.lin.kernel[...], stack.blocks.lin.bias[...]
    h, lins, outs = x, [], []
    for i in range(3):
        lins.append(h @ kernel[i] + bias[i])
        h = jnp.tanh(lins[-1])
        outs.append(h)
    assert sorted(acts) == ["", "blocks", "blocks/lin"]
    # One entry for the scanned call site, stacked along the scan axis.
    assert len(acts["blocks"]) == 1 and acts["blocks"][0].shape == (3, 5, W)
    np.testing.assert_allclose(acts["blocks"][0], jnp.stack(outs), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acts["blocks/lin"][0], jnp.stack(lins), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-6)
    assert_clean(stack)


class RematInside(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.block = Block(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.remat(lambda b, x: b(x))(self.block, x)


@pytest.mark.parametrize("mode", JIT)
def test_nnx_remat_and_nnx_jit_inside(mode: str, x: jax.Array) -> None:
    m = RematInside(nnx.Rngs(0))
    _, acts = JIT[mode](lambda m, x: hx.capture(m)(x))(m, x)
    lin = x @ m.block.lin.kernel[...] + m.block.lin.bias[...]
    np.testing.assert_allclose(acts["block/lin"][0], lin, rtol=1e-5)
    np.testing.assert_allclose(acts["block"][0], jnp.tanh(lin), rtol=1e-5)

    inner = nnx.jit(lambda m, x: m(x))
    model = MLP(nnx.Rngs(0))

    def twice(m: MLP, x: jax.Array) -> jax.Array:
        return inner(m, inner(m, x)[:, :2] @ jnp.ones((2, W)))

    for _ in range(2):  # the second run hits the inner nnx.jit's cache: values still arrive
        _, acts = JIT[mode](hx.capture(twice))(model, x)
        assert len(acts["head"]) == 2
        np.testing.assert_allclose(acts["head"][0], unrolled(model, x)["head"][0], rtol=1e-5)
    assert_clean(model)


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_capture_inside_differentiated_function(mode: str, model: MLP, x: jax.Array) -> None:
    def loss(x: jax.Array) -> jax.Array:
        _, acts = hx.capture(model, where="layers/1")(x)
        return jnp.sum(acts["layers/1"][0] ** 2)

    def reference(x: jax.Array) -> jax.Array:
        return jnp.sum(unrolled(model, x)["layers/1"][0] ** 2)

    g = JIT[mode](jax.grad(loss))(x)
    np.testing.assert_allclose(g, jax.grad(reference)(x), rtol=1e-5, atol=1e-6)
    g = JIT[mode](nnx.grad(lambda m, x: jnp.sum(hx.capture(m)(x)[1]["head"][0])))(model, x)
    np.testing.assert_allclose(g["head"]["bias"][...], jnp.full((2,), float(x.shape[0])), rtol=1e-6)


@pytest.mark.parametrize("mode", JIT)
def test_nnx_grad_inside_capture(mode: str, model: MLP, x: jax.Array) -> None:
    def fn(m: MLP, x: jax.Array) -> Any:
        return nnx.grad(lambda m, x: jnp.sum(m(x)))(m, x)

    grads, acts = JIT[mode](hx.capture(fn, where="head"))(model, x)
    np.testing.assert_allclose(acts["head"][0], unrolled(model, x)["head"][0], rtol=1e-5)
    np.testing.assert_allclose(grads["head"]["bias"][...], jnp.full((2,), 5.0), rtol=1e-6)


@pytest.mark.parametrize("mode", JIT)
def test_nested_captures(mode: str, model: MLP, x: jax.Array) -> None:
    def fn(m: MLP, x: jax.Array) -> Any:
        return hx.capture(m, where="head")(x)

    (_, inner), outer = JIT[mode](hx.capture(fn, where=Block))(model, x)
    expected = unrolled(model, x)
    assert list(inner) == ["head"] and sorted(outer) == ["layers/0", "layers/1", "layers/2"]
    np.testing.assert_allclose(inner["head"][0], expected["head"][0], rtol=1e-5)
    np.testing.assert_allclose(outer["layers/2"][0], expected["layers/2"][0], rtol=1e-5)
    assert_clean(model)


def test_jax_transforms_closing_over_model(model: MLP, x: jax.Array) -> None:
    # jax.vmap over a model it closes over: values gain the batch axis in front.
    _, acts = hx.capture(lambda x: jax.vmap(model)(x))(x[:, None])
    expected = unrolled(model, x)
    assert_acts(acts, {k: [v[0][:, None]] for k, v in expected.items()})
    assert_clean(model)
    # jax.grad inside the captured function: the primal values.
    _, acts = hx.capture(lambda x: jax.grad(lambda x: jnp.sum(model(x)))(x))(x)
    assert_acts(acts, expected)
    assert_clean(model)


class Broadcast(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.block = Block(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.vmap(lambda b, x: b(x), in_axes=(None, 0))(self.block, x)


def test_broadcast_module_in_nnx_vmap(x: jax.Array) -> None:
    m = Broadcast(nnx.Rngs(0))
    _, acts = hx.capture(m)(x)
    lin = x @ m.block.lin.kernel[...] + m.block.lin.bias[...]
    assert_acts(acts, {"block/lin": [lin], "block": [jnp.tanh(lin)], "": [jnp.tanh(lin)]})
    assert_clean(m)


def test_error_not_callable() -> None:
    with pytest.raises(hx.HookaxError, match="expects a module or a function"):
        hx.capture(3)  # type: ignore[arg-type]


def test_exception_in_model_leaves_nothing_behind(model: MLP) -> None:
    with pytest.raises(TypeError):
        hx.capture(model)(jnp.ones((2, W + 1)))
    assert_clean(model)


@pytest.mark.parametrize(
    "who", ["capture", "value_and_grad", "capture ops", "intercept", "intercept_op"]
)
def test_a_where_matching_nothing_is_reported_again_on_a_cached_trace(who):
    """The second call of a user's jitted function reuses its cached trace, so the Python that
    sees the call sites does not run; a selection that matched nothing still says so (a notebook
    cell run again after the error must not return an empty dict, or an unedited output)."""
    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    f = jax.jit(lambda x: model(x).sum())
    x = jnp.ones((1, 2))

    def intercepted(x):
        with hx.intercept(lambda next_fun, a, k, ctx: next_fun(*a, **k) * 2, where="layerz/*"):
            return f(x)

    def op_edited(x):
        with hx.intercept_op(lambda v, op: v * 2, ops="layers/0:nosuchop"):
            return f(x)

    run = {
        "capture": hx.capture(f, where="layerz/*"),
        "value_and_grad": hx.value_and_grad(f, where="layerz/*"),
        "capture ops": hx.capture(f, ops="layers/0:nosuchop"),
        "intercept": intercepted,
        "intercept_op": op_edited,
    }[who]
    for _ in range(3):
        with pytest.raises(hx.SelectorError, match=r"matched no (call site|operation)"):
            run(x)
    # once it matches, the same function records as usual
    assert list(hx.capture(f, where="layers/0")(x)[1]) == ["layers/0"]


def test_a_remembered_failure_is_said_only_for_what_failed():
    """The error said again on a cached trace belongs to the interceptor or function that
    failed: another interceptor with the same where=, in a block that runs no module, is
    silent."""
    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    f = jax.jit(lambda x: model(x))
    x = jnp.ones((1, 2))
    with pytest.raises(hx.SelectorError), hx.intercept(lambda n, a, k, c: n(*a, **k), where="mlp"):
        f(x)
    with hx.intercept(lambda n, a, k, c: n(*a, **k) * 2, where="mlp"):
        jnp.ones(3) * 2  # no module runs: nothing to say
