"""Exception safety: a hook, an interceptor or the model raising leaves nothing behind.

After each fault: the exception propagates as itself (same type, same object), no interceptor,
scoped hook or capture is active, the call stack is empty, the registered hooks are exactly those
registered before, and the next call computes the right value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from tests.models import MLP
from tests.reliability_helpers import assert_clean, hook_sets

X = jnp.ones((2, 3))
MODES = ["eager", "jit"]


class Faulty(nnx.Module):
    """Runs its first layer, then raises when ``fail`` is set (a model that raises mid-forward)."""

    def __init__(self) -> None:
        self.mlp = MLP()
        self.fail = False

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.mlp.layers[0](x)
        if self.fail:
            raise RuntimeError("mid-forward")
        return self.mlp.layers[1](h)


def call(mode: str, fn: Any, *args: Any) -> Any:
    return fn(*args) if mode == "eager" else jax.jit(fn)(*args)


def passthrough(next_fun, args, kwargs, ctx):
    return next_fun(*args, **kwargs)


class Boom(Exception):
    pass


def raiser(exc: BaseException) -> Any:
    def hook(module, args, out):
        raise exc

    return hook


FAULTS = [Boom("in a hook"), KeyboardInterrupt()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("exc", FAULTS, ids=["Exception", "KeyboardInterrupt"])
def test_a_hook_that_raises(mode, exc):
    model = MLP()
    want = model(X)
    keep = hx.register_forward_hook(model, lambda m, a, out: out * 2, where="layers/2")
    before = hook_sets(model)
    bad = hx.register_forward_hook(model, raiser(exc), where="layers/1")
    scoped = hx.hooks(forward=lambda m, a, out: None)
    with pytest.raises(type(exc)) as info, hx.intercept(passthrough), scoped:
        call(mode, lambda x: hx.capture(model)(x), X)
    assert info.value is exc
    assert any("layers/1" in n for n in info.value.__notes__)
    bad.remove()
    assert hook_sets(model) == before
    np.testing.assert_array_equal(call(mode, model, X), want * 2)
    keep.remove()
    assert_clean(model)


@pytest.mark.parametrize("mode", MODES)
def test_a_scoped_hook_that_raises_keyboard_interrupt(mode):
    model = MLP()
    want = model(X)
    with (
        pytest.raises(KeyboardInterrupt),
        hx.hooks(
            where="layers/0", forward_pre=lambda m, args: (_ for _ in ()).throw(KeyboardInterrupt())
        ),
    ):
        call(mode, model, X)
    assert_clean(model)
    np.testing.assert_array_equal(call(mode, model, X), want)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_that_raises_mid_forward(mode):
    model = Faulty()
    ok = model(X)
    model.fail = True
    log: list[str] = []

    def note(next_fun, args, kwargs, ctx):
        log.append(ctx.key)
        return next_fun(*args, **kwargs)

    always = []
    h = hx.register_forward_hook(model, lambda m, a, out: always.append(out), always_call=True)
    before = hook_sets(model)
    with pytest.raises(RuntimeError, match="mid-forward") as info, hx.intercept(note):
        call(mode, hx.capture(model), X)
    assert info.value.__notes__[0] == "hookax: raised in call site '' (Faulty.__call__)"
    assert log == ["", "mlp/layers/0"]
    assert always == [None]  # the always_call hook saw the failed call
    assert hook_sets(model) == before
    h.remove()
    assert_clean(model)
    model.fail = False
    y, acts = call(mode, hx.capture(model), X)
    np.testing.assert_array_equal(y, ok)
    assert list(acts) == ["", "mlp/layers/0", "mlp/layers/1"]


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_hook_that_raises(mode):
    model = MLP()
    grad = nnx.grad(lambda m, x: m(x).sum(), argnums=1)
    want = grad(model, X)

    def bad(m, g):
        raise Boom("in a backward hook")

    h = hx.register_full_backward_pre_hook(model, bad, where="layers/1")
    with pytest.raises(Boom):
        call(mode, grad, model, X)
    h.remove()
    assert_clean(model)
    np.testing.assert_array_equal(call(mode, grad, model, X), want)


@pytest.mark.parametrize("mode", MODES)
def test_an_interceptor_that_raises_inside_nested_blocks(mode):
    model = MLP()
    want = model(X)

    def bad(next_fun, args, kwargs, ctx):
        raise KeyboardInterrupt

    inner = hx.intercept(bad, where="layers/2")
    with pytest.raises(KeyboardInterrupt) as info, hx.intercept(passthrough), inner:
        call(mode, hx.value_and_grad(lambda m, x: m(x).sum()), model, X)
    assert "interceptor" in info.value.__notes__[0]
    assert_clean(model)
    np.testing.assert_array_equal(call(mode, model, X), want)


@pytest.mark.parametrize("mode", MODES)
def test_removing_hooks_from_inside_a_hook(mode):
    """Removal from inside a hook: this call still runs the call site's snapshot; not the next."""
    model = MLP()
    runs: list[str] = []
    handles: dict[str, hx.HookHandle] = {}

    def first(m, a, out):
        runs.append("first")
        handles["first"].remove()  # itself
        handles["second"].remove()  # a hook of a call site that has not started yet

    def second(m, a, out):
        runs.append("second")

    handles["first"] = hx.register_forward_hook(model, first, where="layers/0")
    handles["second"] = hx.register_forward_hook(model, second, where="layers/1")
    # jax.jit closing over the model: the hooks run while tracing and nothing is written back.
    fwd = jax.jit(lambda x: model(x)) if mode == "jit" else model
    want = MLP()(X)
    np.testing.assert_array_equal(fwd(X), want)
    assert runs == ["first"]
    assert hook_sets(model) == {}
    np.testing.assert_array_equal(fwd(X), want)  # the next call runs neither hook
    assert runs == ["first"]
    assert_clean(model)


@pytest.mark.parametrize("others", [False, True], ids=["alone", "with-other-hooks"])
def test_removing_a_hook_from_inside_a_hook_under_nnx_jit(others):
    """Under ``nnx.jit`` the hook runs on a copy that NNX writes back when the call returns; the
    removal reaches both, so it sticks (with other hooks left, NNX's "Cannot mutate ... from
    different trace level" is not raised)."""
    model = MLP()
    runs: list[str] = []
    handle: list[hx.HookHandle] = []

    def once(m, a, o):
        runs.append("once")
        handle[0].remove()

    handle.append(hx.register_forward_hook(model, once))
    kept = hx.register_forward_hook(model, lambda m, a, o: runs.append("kept")) if others else None
    fwd = nnx.jit(lambda m, x: m(x))
    want = MLP()(X)
    np.testing.assert_array_equal(fwd(model, X), want)
    np.testing.assert_array_equal(fwd(model, X), want)  # retraced: the graphdef changed
    assert runs == (["once", "kept", "kept"] if others else ["once"])
    if kept is not None:
        assert [r.fn.__name__ for r in hook_sets(model)[()].records] == ["<lambda>"]
        kept.remove()
    assert_clean(model)


def test_registering_during_a_call_takes_effect_at_the_next_call():
    model = MLP()
    runs: list[str] = []
    added: list[hx.HookHandle] = []

    def late(m, a, out):
        runs.append("late")

    def adder(m, a, out):
        runs.append("adder")
        if not added:  # on the call site in progress: its hooks were decided when it started
            added.append(hx.register_forward_hook(m, late))

    h = hx.register_forward_hook(model, adder, where="layers/0")
    y = model(X)
    assert runs == ["adder"]
    np.testing.assert_array_equal(model(X), y)
    assert runs == ["adder", "adder", "late"]
    h.remove()
    added[0].remove()
    assert_clean(model)
