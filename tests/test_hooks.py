"""Forward hooks, pre-hooks, handles and where=: PyTorch's semantics, eagerly and under jit."""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context
from hookax._hooks import hooks as _hooks

MODES = ["eager", "jit"]


class Scale(nnx.Module):
    """``x * k * scale``: a module with a keyword argument and no state."""

    def __init__(self, k: float = 1.0) -> None:
        self.k = k

    def __call__(self, x: jax.Array, *, scale: float = 1.0) -> jax.Array:
        return x * self.k * scale


class Boom(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        raise ValueError("boom")


class Coder(nnx.Module):
    def __init__(self) -> None:
        self.inner = Scale(2.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.encode(x) + 1

    def encode(self, x: jax.Array) -> jax.Array:
        return self.inner(x)


def two_layers() -> nnx.Sequential:
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs))


def call(mode: str, model: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``model`` eagerly, or through a fresh ``nnx.jit`` (so hooks run while tracing)."""
    if mode == "eager":
        return model(*args, **kwargs)
    return nnx.jit(lambda m, a, k: m(*a, **k))(model, args, kwargs)


X = jnp.array([1.0, 2.0])


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    yield
    assert _context.active_entries() == ()
    assert _context.call_stack() == []


# -- forward pre-hooks --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_pre_hook_single_value_means_one_tuple(mode):
    m = Scale(3.0)
    seen = []

    def pre(module, args):
        seen.append((module is m or mode == "jit", type(args), len(args)))
        return args[0] + 1  # not a tuple: means (value,)

    with hx.register_forward_pre_hook(m, pre):
        np.testing.assert_array_equal(call(mode, m, X), [6.0, 9.0])
    assert seen == [(True, tuple, 1)]
    np.testing.assert_array_equal(call(mode, m, X), [3.0, 6.0])


@pytest.mark.parametrize("mode", MODES)
def test_pre_hook_tuple_and_none(mode):
    m = Scale(1.0)
    hx.register_forward_pre_hook(m, lambda mod, args: (args[0] * 10,))
    hx.register_forward_pre_hook(m, lambda mod, args: None)
    np.testing.assert_array_equal(call(mode, m, X), [10.0, 20.0])


@pytest.mark.parametrize("mode", MODES)
def test_pre_hook_with_kwargs(mode):
    m = Scale(1.0)
    seen = []

    def pre(module, args, kwargs):
        seen.append(sorted(kwargs))
        return (args[0] + 1,), {**kwargs, "scale": 2.0}

    hx.register_forward_pre_hook(m, pre, with_kwargs=True)
    np.testing.assert_array_equal(call(mode, m, X, scale=5.0), [4.0, 6.0])
    assert seen == [["scale"]]


@pytest.mark.parametrize("mode", MODES)
def test_pre_hook_with_kwargs_bad_return(mode):
    m = Scale(1.0)
    hx.register_forward_pre_hook(m, lambda mod, a, k: a, with_kwargs=True)
    with pytest.raises(
        hx.HookError,
        match=r"forward pre-hook .*<lambda> \(with_kwargs=True\) at call site '' "
        r"\(Scale.__call__\) must return None or a pair \(new_args, new_kwargs\).*"
        r"Fix: `return args, kwargs`",
    ):
        call(mode, m, X)


# -- forward hooks ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_forward_hook_arguments_and_replacement(mode):
    m = Scale(2.0)
    seen = []

    def hook(module, args, output):
        seen.append((len(args), output.shape))
        return output + 100

    hx.register_forward_hook(m, hook)
    np.testing.assert_array_equal(call(mode, m, X), [102.0, 104.0])
    assert seen == [(1, (2,))]


@pytest.mark.parametrize("mode", MODES)
def test_forward_hook_with_kwargs(mode):
    m = Scale(1.0)
    seen = []

    def hook(module, args, kwargs, output):
        seen.append(dict(kwargs).keys() == {"scale"})
        return output * 0

    hx.register_forward_hook(m, hook, with_kwargs=True)
    np.testing.assert_array_equal(call(mode, m, X, scale=3.0), [0.0, 0.0])
    assert seen == [True]


@pytest.mark.parametrize("mode", MODES)
def test_forward_hook_may_change_shape_and_structure(mode):
    """As in PyTorch; the backward hooks of the call site then see the new structure."""
    m = Scale(1.0)
    h = hx.register_forward_hook(m, lambda mod, a, out: out[:1])
    np.testing.assert_array_equal(call(mode, m, X), [1.0])
    h.remove()
    seen = []
    hx.register_forward_hook(m, lambda mod, a, out: {"y": out, "y2": out * 2})
    hx.register_full_backward_pre_hook(m, lambda mod, g: seen.append(jax.tree.map(jnp.shape, g)))

    def loss(m, x):
        out = m(x)
        return out["y"].sum() + out["y2"].sum()

    grad = nnx.grad(loss, argnums=1) if mode == "eager" else nnx.jit(nnx.grad(loss, argnums=1))
    np.testing.assert_array_equal(grad(m, X), [3.0, 3.0])
    assert seen == [({"y": (2,), "y2": (2,)},)]


@pytest.mark.parametrize("mode", MODES)
def test_order_registration_and_prepend(mode):
    m = Scale(1.0)
    log = []

    def mk(name, kind):
        if kind == "pre":
            return lambda mod, args: log.append(name)
        return lambda mod, args, out: log.append(name)

    hx.register_forward_pre_hook(m, mk("pre1", "pre"))
    hx.register_forward_pre_hook(m, mk("pre2", "pre"))
    hx.register_forward_pre_hook(m, mk("pre0", "pre"), prepend=True)
    hx.register_forward_pre_hook(m, mk("pre-1", "pre"), prepend=True)
    hx.register_forward_hook(m, mk("fwd1", "fwd"))
    hx.register_forward_hook(m, mk("fwd0", "fwd"), prepend=True)
    hx.register_forward_hook(m, mk("fwd2", "fwd"))
    with (
        hx.hooks(forward_pre=mk("scoped-outer", "pre"), forward=mk("scoped-outer-f", "fwd")),
        hx.hooks(forward_pre=mk("scoped-inner", "pre")),
    ):
        call(mode, m, X)
    assert log == [
        *("scoped-outer", "scoped-inner", "pre-1", "pre0", "pre1", "pre2"),
        *("scoped-outer-f", "fwd0", "fwd1", "fwd2"),
    ]


# -- always_call and exceptions -----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_always_call_runs_with_none_and_exception_propagates(mode):
    m = Boom()
    seen = []
    hx.register_forward_hook(m, lambda mod, a, out: seen.append(("always", out)), always_call=True)
    hx.register_forward_hook(m, lambda mod, a, out: seen.append(("plain", out)))
    with pytest.raises(ValueError, match="boom") as info:
        call(mode, m, X)
    assert seen == [("always", None)]
    assert "hookax: raised in call site '' (Boom.__call__)" in info.value.__notes__


@pytest.mark.parametrize("mode", MODES)
def test_always_call_after_a_forward_hook_raised(mode):
    m = Scale(1.0)
    err = RuntimeError("hook failed")
    seen = []

    def bad(mod, a, out):
        raise err

    hx.register_forward_hook(m, bad)
    hx.register_forward_hook(m, lambda mod, a, out: seen.append(out.shape), always_call=True)
    with pytest.raises(RuntimeError) as info:
        call(mode, m, X)
    assert info.value is err
    assert seen == [(2,)]
    assert info.value.__notes__[:1] == [
        "hookax: raised in forward hook "
        "test_always_call_after_a_forward_hook_raised.<locals>.bad at call site '' "
        "(Scale.__call__)"
    ]


def test_always_call_hook_that_raises_is_silenced_with_a_warning():
    m = Boom()

    def bad(mod, a, out):
        raise KeyError("second")

    hx.register_forward_hook(m, bad, always_call=True)
    with (
        pytest.warns(RuntimeWarning, match=r"always_call=True.*raised KeyError.*ValueError"),
        pytest.raises(ValueError, match="boom"),
    ):
        m(X)


@pytest.mark.parametrize("mode", MODES)
def test_hook_exception_is_the_same_object_with_a_note(mode):
    m = Coder()
    err = ZeroDivisionError("nope")

    def pre(mod, args):
        raise err

    hx.register_forward_pre_hook(m, pre, where="inner")
    with pytest.raises(ZeroDivisionError) as info:
        call(mode, m, X)
    assert info.value is err
    assert info.value.__notes__[:1] == [
        "hookax: raised in forward pre-hook "
        "test_hook_exception_is_the_same_object_with_a_note.<locals>.pre at call site 'inner' "
        "(Scale.__call__)"
    ]


# -- where=, handles, remove_hooks --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_where_registers_on_every_match_with_one_handle(mode):
    model = two_layers()
    seen = []
    h = hx.register_forward_hook(
        model, lambda mod, a, out: seen.append((type(mod).__name__, out.shape)), where=nnx.Linear
    )
    x = jnp.ones((4, 2))
    call(mode, model, x)
    assert seen == [("Linear", (4, 3)), ("Linear", (4, 1))]
    h.remove()
    h.remove()  # idempotent
    call(mode, model, x)
    assert len(seen) == 2
    assert all(hx._hooks.hooks.hook_set(m) is None for _, m in nnx.iter_modules(model))


@pytest.mark.parametrize("mode", MODES)
def test_where_with_methods(mode):
    m = Coder()
    seen = []
    hx.register_forward_hook(
        m, lambda mod, a, out: seen.append(out) or out * 0, where=hx.Select(methods="encode")
    )
    np.testing.assert_array_equal(call(mode, m, X), [1.0, 1.0])
    assert len(seen) == 1


def test_where_matching_nothing_and_non_modules():
    model = two_layers()
    with pytest.raises(
        hx.SelectorError,
        match=r"register_forward_hook\(where='blocks/\*'\) matched no submodule of Sequential; "
        r"its submodules .* include .*'layers/0' \(Linear\)",
    ):
        hx.register_forward_hook(model, lambda *a: None, where="blocks/*")
    with pytest.raises(
        hx.HookaxError,
        match=r"hx.register_forward_pre_hook expects a Flax NNX module .* got function.*"
        r"Fix: `with hx.hooks\(where=..., forward=hook\)",
    ):
        hx.register_forward_pre_hook(lambda x: x, lambda *a: None)
    with pytest.raises(hx.HookaxError, match="expects a callable hook, got 3"):
        hx.register_forward_hook(model, 3)
    assert all(hx._hooks.hooks.hook_set(m) is None for _, m in nnx.iter_modules(model))


def test_handle_context_manager_and_remove_hooks():
    model = two_layers()
    x = jnp.ones((1, 2))
    plain = model(x)
    with hx.register_forward_hook(model, lambda mod, a, out: out * 0):
        np.testing.assert_array_equal(model(x), [[0.0]])
    np.testing.assert_array_equal(model(x), plain)
    h = hx.register_forward_hook(model, lambda mod, a, out: out * 0, where=nnx.Linear)
    hx.register_forward_pre_hook(model, lambda mod, a: None)
    hx.remove_hooks(model)
    np.testing.assert_array_equal(model(x), plain)
    h.remove()  # after remove_hooks: nothing to do


def test_removing_one_of_two_equal_hooks_keeps_the_other():
    m = Scale(1.0)
    log = []

    def a(mod, args, out):
        log.append("a")

    def b(mod, args, out):
        log.append("b")

    h1 = hx.register_forward_hook(m, a)
    hx.register_forward_hook(m, b)
    h3 = hx.register_forward_hook(m, a)
    h3.remove()
    m(X)
    assert log == ["a", "b"]
    h1.remove()
    m(X)
    assert log == ["a", "b", "b"]


def test_forward_hooks_are_read_after_the_method_returns():
    """As PyTorch: a forward hook a pre-hook adds runs in the same call (pre-hooks are read at
    the start). Eager only: registering inside a jitted call mutates the outer module."""
    m = Scale(1.0)
    log = []
    added = []

    def late(mod, args, out):
        log.append("late")

    def pre(mod, args):
        log.append("pre")
        if not added:
            added.append(hx.register_forward_hook(m, late))

    hx.register_forward_pre_hook(m, pre)
    m(X)
    assert log == ["pre", "late"]
    m(X)
    assert log == ["pre", "late", "pre", "late"]
    log.clear()
    added[0].remove()
    hx.register_forward_pre_hook(m, lambda mod, args: hx.remove_hooks(m))
    m(X)  # removed during the call: the pre-hooks of this call still run
    assert log == ["pre"]
    m(X)
    assert log == ["pre"]


# -- where the hooks live: graphdef, state, caches ----------------------------------------------


def test_hooks_are_static_graph_structure_not_state():
    model = two_layers()
    state_before = nnx.state(model)
    graphdef_before, _ = nnx.split(model)

    def hook(mod, args, out):
        return out * 2

    h = hx.register_forward_hook(model, hook, where=nnx.Linear)
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(state_before)
    graphdef, state = nnx.split(model)
    assert graphdef != graphdef_before
    copy = nnx.merge(graphdef, state)
    x = jnp.ones((1, 2))
    np.testing.assert_allclose(copy(x), model(x))
    h.remove()
    assert nnx.split(model)[0] == graphdef_before
    h2 = hx.register_forward_hook(model, hook, where=nnx.Linear)
    assert nnx.split(model)[0] == graphdef  # same hook again: an equal graphdef
    h2.remove()
    assert copy(x)[0, 0] == 4 * model(x)[0, 0]  # the copy keeps its hooks


def test_trace_counts_on_add_and_remove(traces):
    model = two_layers()
    x = jnp.ones((1, 2))

    @nnx.jit
    def f(m, x):
        traces()
        return m(x)

    @jax.jit
    def g(m, x):
        traces()
        return m(x)

    def double(mod, args, out):
        return out * 2

    plain = f(model, x)
    g(model, x)
    assert traces.n == 2
    h = hx.register_forward_hook(model, double)
    np.testing.assert_allclose(f(model, x), 2 * plain)
    np.testing.assert_allclose(g(model, x), 2 * plain)
    f(model, x)
    g(model, x)
    assert traces.n == 4
    h.remove()
    np.testing.assert_allclose(f(model, x), plain)  # back to the first trace: cache hit
    np.testing.assert_allclose(g(model, x), plain)
    assert traces.n == 4
    hx.register_forward_hook(model, double)  # equal to the second: cache hit
    np.testing.assert_allclose(f(model, x), 2 * plain)
    assert traces.n == 4
    hx.remove_hooks(model)


def test_scoped_hooks_are_cache_correct_and_thread_local(traces):
    m = Scale(1.0)

    @nnx.jit
    def f(m, x):
        traces()
        return m(x)

    def zero(mod, args, out):
        return out * 0

    np.testing.assert_array_equal(f(m, X), X)
    with hx.hooks(forward=zero):
        np.testing.assert_array_equal(f(m, X), [0.0, 0.0])
        other = []
        t = threading.Thread(target=lambda: other.append(np.asarray(m(X))))
        t.start()
        t.join()
        np.testing.assert_array_equal(other[0], X)  # another thread sees no hooks
    np.testing.assert_array_equal(f(m, X), X)
    with hx.hooks(forward=zero):  # equal entry: cache hit
        np.testing.assert_array_equal(f(m, X), [0.0, 0.0])
    assert traces.n == 2


@pytest.mark.parametrize("mode", MODES)
def test_scoped_hooks_where_and_with_kwargs(mode):
    m = Coder()
    seen = []

    def fwd(mod, args, kwargs, out):
        seen.append((type(mod).__name__, kwargs))

    with hx.hooks(where=Scale, forward=fwd, with_kwargs=True):
        call(mode, m, X)
    assert seen == [("Scale", {})]
    with pytest.raises(hx.HookaxError, match=r"hx.hooks\(forward=...\) expects a callable"):
        hx.hooks(forward="nope")


def test_scoped_exception_leaves_nothing_active():
    m = Boom()
    with pytest.raises(ValueError), hx.hooks(forward=lambda mod, a, out: None):
        m(X)
    assert _context.active_entries() == ()


@pytest.mark.parametrize("mode", ["eager", "jit", "vmap"])
def test_forward_hooks_under_vmap(mode):
    m = Scale(2.0)
    hx.register_forward_hook(m, lambda mod, a, out: out + a[0])
    xs = jnp.arange(6.0).reshape(3, 2)
    if mode == "vmap":
        out = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, xs)
    else:
        out = call(mode, m, xs)
    np.testing.assert_array_equal(out, 3 * xs)


def test_hooks_live_on_the_instance_and_removal_restores_it():
    m = Scale(1.0)
    before = nnx.graphdef(m)
    h = hx.register_forward_hook(m, lambda *a: None)
    hx.register_forward_pre_hook(m, lambda *a: None)
    assert "_hookax_hooks" in vars(m) and "_hookax_hooks" not in vars(Scale(1.0))
    h.remove()
    assert "_hookax_hooks" in vars(m) and id(m) in _context.HOOKED  # slow path: root tracked
    hx.remove_hooks(m)
    assert "_hookax_hooks" not in vars(m) and nnx.graphdef(m) == before
    assert id(m) not in _context.HOOKED  # the idle fast path is back


@pytest.mark.parametrize("mode", MODES)
def test_a_pre_hook_removing_a_forward_hook_stops_it_in_the_same_call(mode):
    """PyTorch reads the forward hooks after ``forward`` returns; under nnx.jit too."""
    m = Scale(1.0)
    log = []
    fwd = hx.register_forward_hook(m, lambda mod, a, out: log.append("forward"))

    def pre(mod, args):
        log.append("pre")
        fwd.remove()

    pre_h = hx.register_forward_pre_hook(m, pre)
    call(mode, m, X)
    assert log == ["pre"]
    pre_h.remove()
    assert _hooks.hook_set(m) is None


def module_level_hook(module: Any, args: Any, out: Any) -> Any:
    return out * 2


def test_modules_with_hooks_pickle_and_deepcopy():
    """Hooks that pickle are kept; a hook that does not pickle fails as it would in PyTorch."""
    import copy
    import pickle

    m = Scale(1.0)
    h = hx.register_forward_hook(m, module_level_hook)
    for m2 in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        np.testing.assert_array_equal(m2(X), X * 2)
        assert _hooks.hook_set(m2) == _hooks.hook_set(m)  # equal: the same jit cache entries
        h.remove()  # the handle removes the original's hook only
        np.testing.assert_array_equal(m2(X), X * 2)
        hx.remove_hooks(m2)
        h = hx.register_forward_hook(m, module_level_hook)
    h.remove()
    lam = hx.register_forward_hook(m, lambda mod, a, out: None)
    np.testing.assert_array_equal(copy.deepcopy(m)(X), X)
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(m)
    lam.remove()
    assert pickle.loads(pickle.dumps(m)).k == 1.0
