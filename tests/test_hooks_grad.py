"""Backward hooks and ``hx.hook_grad``: gradients against hand-computed ones, under transforms."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

MODES = ["eager", "jit", "vjp", "vmap"]


def two_layers() -> nnx.Sequential:
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs))


def loss_fn(model: Any, x: jax.Array) -> jax.Array:
    return jnp.sum(model(x))


def grads(mode: str, model: Any, x: jax.Array, loss: Any = loss_fn) -> tuple[Any, jax.Array]:
    """(d loss / d params, d loss / d x), computed the way ``mode`` says."""
    if mode == "eager":
        return nnx.grad(loss, argnums=(0, 1))(model, x)
    if mode == "jit":
        return nnx.jit(nnx.grad(loss, argnums=(0, 1)))(model, x)
    graphdef, state = nnx.split(model)

    def pure(state: Any, x: jax.Array) -> jax.Array:
        return loss(nnx.merge(graphdef, state), x)

    if mode == "vjp":
        _, vjp = jax.vjp(pure, state, x)
        return vjp(jnp.ones((), jnp.float32))
    # vmap: per-example gradients of a batch of one example each, summed.
    per = jax.vmap(jax.grad(pure, argnums=(0, 1)), in_axes=(None, 0))(state, x[:, None])
    return jax.tree.map(lambda g: g.sum(0), per[0]), per[1][:, 0]


def hand_grads(model: nnx.Sequential, x: jax.Array) -> dict[str, np.ndarray]:
    w1, b1 = np.asarray(model.layers[0].kernel[...]), np.asarray(model.layers[0].bias[...])
    w2 = np.asarray(model.layers[1].kernel[...])
    xn = np.asarray(x)
    y1 = xn @ w1 + b1
    g2 = np.ones((xn.shape[0], 1), np.float32)  # d loss / d y2
    g1 = g2 @ w2.T  # d loss / d y1
    return {"w2": y1.T @ g2, "b2": g2.sum(0), "w1": xn.T @ g1, "b1": g1.sum(0), "x": g1 @ w1.T}


def as_dict(g: Any, gx: jax.Array) -> dict[str, np.ndarray]:
    return {
        "w2": np.asarray(g["layers"][1]["kernel"][...]),
        "b2": np.asarray(g["layers"][1]["bias"][...]),
        "w1": np.asarray(g["layers"][0]["kernel"][...]),
        "b1": np.asarray(g["layers"][0]["bias"][...]),
        "x": np.asarray(gx),
    }


def assert_grads(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


X = jnp.array([[1.0, -2.0], [0.5, 3.0]])


@pytest.mark.parametrize("mode", MODES)
def test_backward_pre_hook_scales_every_upstream_gradient(mode):
    model = two_layers()
    want = hand_grads(model, X)
    seen = []

    def pre(module, grad_output):
        seen.append(grad_output[0].shape)
        return (grad_output[0] * 3,)

    hx.register_full_backward_pre_hook(model, pre, where="layers/1")
    assert_grads(as_dict(*grads(mode, model, X)), {k: 3 * v for k, v in want.items()})
    assert seen == [(1, 1) if mode == "vmap" else (2, 1)]


@pytest.mark.parametrize("mode", MODES)
def test_backward_hook_sees_and_replaces_grad_input(mode):
    model = two_layers()
    want = hand_grads(model, X)
    seen = []

    def record(gi, go):
        seen.append((np.asarray(gi), np.asarray(go)))

    def hook(module, grad_input, grad_output):
        assert isinstance(grad_input, tuple) and len(grad_input) == 1
        assert isinstance(grad_output, tuple) and len(grad_output) == 1
        jax.debug.callback(record, grad_input[0], grad_output[0])
        return (grad_input[0] * 2,)

    hx.register_full_backward_hook(model, hook, where="layers/1")
    got = as_dict(*grads(mode, model, X))
    # grad_input of layer 1 is d loss / d y1: doubled, it doubles everything upstream of it.
    assert_grads(got, {k: v if k in ("w2", "b2") else 2 * v for k, v in want.items()})
    if mode == "vmap":
        return  # jax.debug.callback under vmap: values are checked in the other modes
    gi = np.concatenate([s[0].reshape(-1, 3) for s in seen])
    go = np.concatenate([s[1].reshape(-1, 1) for s in seen])
    w2 = np.asarray(model.layers[1].kernel[...])
    np.testing.assert_allclose(gi, np.ones((2, 1)) @ w2.T, rtol=1e-6)
    np.testing.assert_array_equal(go, np.ones((2, 1)))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_backward_hook_gets_grad_output_after_pre_hooks(mode):
    model = two_layers()
    seen = []
    hx.register_full_backward_pre_hook(model, lambda m, g: (g[0] + 1,), where="layers/1")
    hx.register_full_backward_hook(
        model,
        lambda m, gi, go: jax.debug.callback(lambda g: seen.append(np.asarray(g)), go[0]),
        where="layers/1",
    )
    grads(mode, model, X)
    np.testing.assert_array_equal(seen[0], np.full((2, 1), 2.0))


class TwoArgs(nnx.Module):
    """``x * w`` gathered at ``idx``: the second positional argument is not differentiable."""

    def __init__(self) -> None:
        self.w = nnx.Param(jnp.array([1.0, 2.0, 3.0]))

    def __call__(self, x: jax.Array, idx: jax.Array) -> jax.Array:
        return (x * self.w[...])[idx]


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_grad_input_is_none_for_non_float_arguments(mode):
    m = TwoArgs()
    shapes = []

    def hook(module, grad_input, grad_output):
        shapes.append(tuple(None if g is None else g.shape for g in grad_input))
        return (grad_input[0] * 10, None)

    hx.register_full_backward_hook(m, hook)
    x, idx = jnp.array([1.0, 1.0, 1.0]), jnp.array([0, 2])

    def loss(m, x):
        return m(x, idx).sum()

    f = nnx.grad(loss, argnums=1)
    gx = (nnx.jit(f) if mode == "jit" else f)(m, x)
    np.testing.assert_array_equal(gx, [10.0, 0.0, 30.0])
    assert shapes == [((3,), None)]


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_backward_hook_without_differentiable_inputs(mode):
    emb = nnx.Embed(4, 2, rngs=nnx.Rngs(0))
    seen = []
    h = hx.register_full_backward_hook(emb, lambda m, gi, go: seen.append((gi, go[0].shape)))
    idx = jnp.array([1, 3])
    f = nnx.grad(lambda m: m(idx).sum())
    g = (nnx.jit(f) if mode == "jit" else f)(emb)
    np.testing.assert_array_equal(g["embedding"][...], [[0, 0], [1, 1], [0, 0], [1, 1]])
    assert seen == [((None,), (2, 2))]
    h.remove()
    h = hx.register_full_backward_hook(emb, lambda m, gi, go: (None,))  # all None: allowed
    (nnx.jit(f) if mode == "jit" else f)(emb)
    h.remove()
    hx.register_full_backward_hook(emb, lambda m, gi, go: go)
    with pytest.raises(
        hx.HookError,
        match=r"backward hook .*<lambda>'s grad_input at call site '' \(Embed.__call__\): no "
        r"input of this call is differentiated, so a backward hook here must return None \(or a "
        r"tuple of None\), got a tuple of gradients \(as in PyTorch",
    ):
        nnx.grad(lambda m: m(idx).sum())(emb)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_backward_hook_errors_are_pinned(mode):
    model = two_layers()

    def run():
        f = nnx.grad(loss_fn, argnums=1)
        return (nnx.jit(f) if mode == "jit" else f)(model, X)

    h = hx.register_full_backward_pre_hook(model, lambda m, g: (g[0][:1],), where="layers/1")
    with pytest.raises(
        hx.HookError,
        match=re.escape("backward pre-hook test_backward_hook_errors_are_pinned.<locals>.<lambda>")
        + r"'s grad_output \(entry 0\) at call site 'layers/1' \(Linear.__call__\) has the "
        r"wrong shape or dtype at the value: expected float32\[2,1\], got float32\[1,1\]. "
        r"Fix: return None",
    ):
        run()
    h.remove()
    h = hx.register_full_backward_hook(model, lambda m, gi, go: gi[0], where="layers/0")
    with pytest.raises(
        hx.HookError,
        match=r"grad_input at call site 'layers/0' \(Linear.__call__\) must be a tuple with one "
        r"entry per positional argument \(1\), got float32\[2,2\]. Fix: return None, or a "
        r"tuple like grad_input",
    ):
        run()
    h.remove()
    err = FloatingPointError("bad grad")

    def raises(m, gi, go):
        raise err

    hx.register_full_backward_hook(model, raises, where="layers/0")
    with pytest.raises(FloatingPointError) as info:
        run()
    assert info.value is err
    assert info.value.__notes__[0] == (
        "hookax: raised in backward hook test_backward_hook_errors_are_pinned.<locals>.raises "
        "at call site 'layers/0' (Linear.__call__)"
    )


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_scoped_backward_hooks(mode, traces):
    model = two_layers()
    want = hand_grads(model, X)

    def loss(m, x):
        traces()
        return loss_fn(m, x)

    def triple(m, g):
        return (g[0] * 3,)

    f = nnx.grad(loss, argnums=(0, 1))
    f = nnx.jit(f) if mode == "jit" else f
    with hx.hooks(where="layers/1", backward_pre=triple):
        assert_grads(as_dict(*f(model, X)), {k: 3 * v for k, v in want.items()})
    assert_grads(as_dict(*f(model, X)), want)
    with hx.hooks(where="layers/1", backward_pre=triple):
        assert_grads(as_dict(*f(model, X)), {k: 3 * v for k, v in want.items()})
    if mode == "jit":
        assert traces.n == 2


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.lin(x))


class Stack(nnx.Module):
    """Four blocks with stacked parameters, applied with ``nnx.scan``."""

    def __init__(self) -> None:
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.blocks = make(nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(b: Block, x: jax.Array) -> jax.Array:
            return b(x)

        return body(self.blocks, x)


@pytest.mark.parametrize("mode", ["eager", "jit", "remat"])
def test_backward_hooks_through_nnx_scan(mode):
    model = Stack()
    x = jnp.array([[0.1, 0.2, 0.3]])
    loss = nnx.remat(loss_fn) if mode == "remat" else loss_fn
    f = nnx.grad(loss, argnums=1)
    f = nnx.jit(f) if mode == "jit" else f
    plain = f(model, x)
    keys = []

    def double(module, grad_input, grad_output):
        keys.append(type(module).__name__)
        return (grad_input[0] * 2,)

    hx.register_full_backward_hook(model, double, where="blocks")
    np.testing.assert_allclose(f(model, x), 16 * plain, rtol=1e-6)  # 2 ** 4 blocks
    assert keys == ["Block"]  # the scanned call site: one trace of the body's backward


def test_backward_hooks_inside_nnx_vmap_under_grad():
    model = two_layers()
    xs = X[:, None]  # two examples of batch 1
    want = hand_grads(model, X)
    hx.register_full_backward_pre_hook(model, lambda m, g: (g[0] * 5,), where="layers/1")

    def loss(m, xs):
        return nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, xs).sum()

    gx = nnx.jit(nnx.grad(loss, argnums=1))(model, xs)
    np.testing.assert_allclose(gx[:, 0], 5 * want["x"], rtol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_hook_grad_doubles_every_upstream_gradient(mode):
    model = two_layers()
    want = hand_grads(model, X)

    def loss(m, x):
        return hx.hook_grad(loss_fn(m, x), lambda g: g * 2)

    assert_grads(as_dict(*grads(mode, model, X, loss)), {k: 2 * v for k, v in want.items()})


@pytest.mark.parametrize("mode", ["eager", "jit", "vmap"])
def test_hook_grad_on_a_pytree(mode):
    seen = []

    def fn(g):
        seen.append(jax.tree.map(jnp.shape, g))
        return {"a": g["a"] * 10, "i": None}

    def f(a):
        tree = hx.hook_grad({"a": a, "i": jnp.array([1, 2])}, fn)
        assert tree["i"].dtype == jnp.int32
        return jnp.sum(tree["a"] ** 2)

    a = jnp.array([1.0, 2.0])
    g = jax.grad(f)
    if mode == "jit":
        g = jax.jit(g)
    if mode == "vmap":
        out = jax.vmap(g)(jnp.stack([a, a]))
        np.testing.assert_array_equal(out, [[20.0, 40.0], [20.0, 40.0]])
    else:
        np.testing.assert_array_equal(g(a), [20.0, 40.0])
    assert seen == [{"a": (2,), "i": None}]
    assert hx.hook_grad(3, fn) == 3  # nothing to differentiate: returned as is
    np.testing.assert_array_equal(jax.grad(lambda x: hx.hook_grad(x, lambda g: None) * 3)(a[0]), 3)


def test_hook_grad_errors():
    with pytest.raises(
        hx.HookError,
        match=r"gradient hook .*<lambda>'s cotangent at hx.hook_grad has the wrong shape or "
        r"dtype at the value: expected float32\[2\], got float32\[1\]. Fix: return None",
    ):
        jax.grad(lambda x: hx.hook_grad(x, lambda g: g[:1]).sum())(jnp.ones(2))
    err = ArithmeticError("x")

    def bad(g):
        raise err

    with pytest.raises(ArithmeticError) as info:
        jax.grad(lambda x: hx.hook_grad(x, bad).sum())(jnp.ones(2))
    assert info.value is err
    assert info.value.__notes__[0].startswith("hookax: raised in gradient hook ")


def _hlo(fn: Any, model: Any, x: jax.Array) -> str:
    graphdef, state = nnx.split(model)
    text = jax.jit(lambda s, x: fn(nnx.merge(graphdef, s), x)).lower(state, x).compile().as_text()
    text = text.split("\nFileNames", 1)[0]  # source-location tables
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)


def test_noop_hooks_compile_to_the_same_program():
    plain, hooked = two_layers(), two_layers()
    hx.register_forward_pre_hook(hooked, lambda m, a: None, where=nnx.Linear)
    hx.register_forward_hook(hooked, lambda m, a, o: None, where=nnx.Linear)
    hx.register_full_backward_pre_hook(hooked, lambda m, g: None, where=nnx.Linear)
    hx.register_full_backward_hook(hooked, lambda m, gi, go: None, where=nnx.Linear)

    def fwd_bwd(m, x):
        return nnx.grad(loss_fn, argnums=(0, 1))(m, x)

    assert _hlo(fwd_bwd, plain, X) == _hlo(fwd_bwd, hooked, X)
    assert _hlo(lambda m, x: m(x), plain, X) == _hlo(lambda m, x: m(x), hooked, X)


class Split(nnx.Module):
    """Two outputs: ``(x * 2, x * 3)``."""

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return x * 2, x * 3


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_grad_output_is_none_for_an_output_that_does_not_reach_the_loss(mode):
    """A tuple output gives one entry each; the unused one is None (symbolic zero), as PyTorch."""
    m = Split()
    seen = []

    def pre(module, grad_output):
        seen.append(tuple(None if g is None else g.shape for g in grad_output))
        return (grad_output[0] * 10, None)

    def post(module, grad_input, grad_output):
        seen.append((grad_input[0].shape, grad_output[1]))

    hx.register_full_backward_pre_hook(m, pre)
    hx.register_full_backward_hook(m, post)
    f = nnx.grad(lambda m, x: m(x)[0].sum(), argnums=1)
    gx = (nnx.jit(f) if mode == "jit" else f)(m, jnp.ones(3))
    np.testing.assert_array_equal(gx, [20.0, 20.0, 20.0])
    assert seen == [((3,), None), ((3,), None)]
    seen.clear()
    # No output reaches the loss: no backward hook runs (PyTorch's graph never reaches them).
    f = nnx.grad(lambda m, x: (m(x), x.sum())[1], argnums=1)
    np.testing.assert_array_equal((nnx.jit(f) if mode == "jit" else f)(m, jnp.ones(3)), [1.0] * 3)
    assert seen == []


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_backward_hook_may_return_none_entries_and_a_namedtuple_output_is_a_tuple(mode):
    import collections

    Pair = collections.namedtuple("Pair", "a b")

    class Named(nnx.Module):
        def __call__(self, x: jax.Array) -> Any:
            return Pair(x * 2, {"c": x * 3, "i": jnp.arange(3)})

    m = Named()
    seen = []

    def pre(module, grad_output):
        seen.append(jax.tree.map(jnp.shape, grad_output))
        return (None, {"c": grad_output[1]["c"], "i": None})  # a's gradient cut

    hx.register_full_backward_pre_hook(m, pre)

    def loss(m, x):
        out = m(x)
        return out.a.sum() + out.b["c"].sum()

    f = nnx.grad(loss, argnums=1)
    gx = (nnx.jit(f) if mode == "jit" else f)(m, jnp.ones(3))
    np.testing.assert_array_equal(gx, [3.0, 3.0, 3.0])
    assert seen == [((3,), {"c": (3,), "i": None})]


class Unused(nnx.Module):
    """``y`` is an input that does not reach the output."""

    def __call__(self, x, y):
        return x * 2.0


@pytest.mark.parametrize("mode", ["eager", "jit", "vjp"])
def test_grad_input_is_zeros_for_a_differentiated_input_that_does_not_reach_the_output(mode):
    # PyTorch: a full backward hook's grad_input entry for an input that requires grad but does
    # not reach the output is zeros; an input that is not differentiated gets None.
    m = Unused()
    seen = []

    def hook(module, grad_input, grad_output):
        seen.append(tuple(None if g is None else g.shape for g in grad_input))
        if grad_input[1] is not None:  # zeros: adding one gives exactly one
            return (grad_input[0] * 10.0, grad_input[1] + 1.0)
        return None

    hx.register_full_backward_hook(m, hook)
    x, y = jnp.array([1.0, 2.0, 3.0]), jnp.array([4.0, 5.0])

    def loss(x, y):
        return m(x, y).sum()

    if mode == "vjp":
        _, vjp = jax.vjp(loss, x, y)
        gx, gy = vjp(jnp.ones((), jnp.float32))
    else:
        f = jax.grad(loss, argnums=(0, 1))
        gx, gy = (jax.jit(f) if mode == "jit" else f)(x, y)
    np.testing.assert_array_equal(gx, [20.0, 20.0, 20.0])
    np.testing.assert_array_equal(gy, [1.0, 1.0])
    assert seen == [((3,), (2,))]
    seen.clear()
    f1 = jax.grad(loss, argnums=0)  # y is not differentiated: None, as before
    gx = (jax.jit(f1) if mode == "jit" else f1)(x, y)
    assert seen == [((3,), None)]
    np.testing.assert_array_equal(gx, [2.0, 2.0, 2.0])
