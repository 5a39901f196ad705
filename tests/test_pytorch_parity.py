"""PyTorch's own hook tests, ported to hookax on Flax NNX, each eagerly and under ``nnx.jit``.

Sources: ``test/nn/test_module_hooks.py`` (classes ``TestModuleHooks``, ``TestStateDictHooks``,
``TestModuleGlobalHooks``, ``TestModuleHookNN``) and the tensor-hook tests of
``test/test_autograd.py`` in pytorch/pytorch. Each test keeps PyTorch's name and PyTorch's
expected values; the JAX spelling of each step:

* ``out = model(x)`` is a forward call; ``model(x).sum().backward()`` is ``nnx.grad`` of the
  sum (a forward then a backward pass); ``out.backward(g)`` is ``jax.vjp``'s function applied to
  ``g``. A tensor that does not require grad is an argument not in ``argnums``.
* PyTorch's global module hooks (``register_module_forward_hook``...) are ``hx.hooks`` blocks;
  removing a global hook is leaving its block.
* ``Tensor.register_hook`` is ``hx.hook_grad``.
* Under ``"jit"`` every call goes through a fresh ``nnx.jit``: hooks are Python and run while
  JAX traces, once per trace (a cached trace runs none; see tests/test_hooks.py for the counts).
  Under NNX transforms (``nnx.jit``, ``nnx.grad``) a hook gets the copy of its module that the
  transform rebuilt, which carries the same hook set: that stands for PyTorch's ``id`` checks.

Not ported, as their subject does not exist in JAX: state-dict hooks (``load_state_dict``),
buffer/parameter/submodule registration hooks, in-place operations (``test_hook_inplace``), the
legacy non-full ``register_backward_hook`` (``test_hook_non_full_warning``; its other tests are
ported with ``register_full_backward_hook``). ``test_bw_hook_warning_for_non_tensor_or_tuple``
is ported with hookax's documented difference: a dict output gets backward hooks.
"""

from __future__ import annotations

import copy
import gc
import math
import pickle
import weakref
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._hooks import hooks as _hooks

MODES = ["eager", "jit"]


def jit(mode: str, fn: Any) -> Any:
    """``fn`` itself, or a fresh ``nnx.jit`` of it (so its hooks run while it is traced)."""
    return fn if mode == "eager" else nnx.jit(fn)


def forward(mode: str, model: Any, *args: Any, **kwargs: Any) -> Any:
    return jit(mode, lambda m, a, k: m(*a, **k))(model, args, kwargs)


def backward(mode: str, model: Any, *args: Any, argnums: Any = 0) -> Any:
    """``model(*args).sum().backward()``: gradients for ``argnums`` (0: the parameters)."""
    return jit(mode, nnx.grad(lambda m, *a: m(*a).sum(), argnums=argnums))(model, *args)


def vjp(mode: str, model: Any, x: Any) -> tuple[Any, Any]:
    """``out = model(x)`` with ``x`` requiring grad: the output and ``out.backward``."""
    return jax.vjp(jit(mode, lambda x: model(x)), x)


def same(mode: str, got: Any, expected: Any) -> bool:
    """PyTorch's ``id(got) == id(expected)``. Under NNX transforms (``nnx.jit``, ``nnx.grad``,
    also eagerly) the module is a copy rebuilt from its graphdef, carrying the same hook set."""
    if got is expected:
        return True
    return type(got) is type(expected) and _hooks.hook_set(got) is _hooks.hook_set(expected)


def close(a: Any, b: Any, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=atol)


def close_in_hook(a: Any, b: Any) -> None:
    """``close`` for a value a hook sees, which may be traced: checked when it is computed."""
    jax.debug.callback(lambda v: close(v, b), a)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.seq1 = nnx.Sequential(*[nnx.Linear(10, 10, rngs=rngs) for _ in range(2)])
        self.seq2 = nnx.Sequential(*[nnx.Linear(10, 10, rngs=rngs) for _ in range(2)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.seq2(self.seq1(x))


class ToyModel(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.net1 = Net(rngs)
        self.net2 = Net(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.net2(self.net1(x))


class Sigmoid(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.sigmoid(x)


X10 = jax.random.normal(jax.random.key(0), (10, 10))
ONES55 = jnp.ones((5, 5))
RANDN55 = jax.random.normal(jax.random.key(1), (5, 5))


def fwd_hook(mode, fired, expected, hook_id, module, inp, out):
    fired.append(hook_id)
    assert same(mode, module, expected)
    assert len(inp) == 1


def fwd_pre_hook(mode, fired, expected, hook_id, module, inp):
    fired.append(hook_id)
    assert same(mode, module, expected)
    assert len(inp) == 1


def bwd_hook(mode, fired, expected, hook_id, module, grad_input, grad_output):
    fired.append(hook_id)
    assert same(mode, module, expected)
    assert len(grad_input) == 1
    assert len(grad_output) == 1


def bwd_pre_hook(mode, fired, expected, hook_id, module, grad_output):
    fired.append(hook_id)
    assert same(mode, module, expected)
    assert len(grad_output) == 1


# -- TestModuleHooks ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_forward_hooks(mode):
    fired: list[int] = []
    model = ToyModel()
    target = model.net1.seq2
    hook = partial(fwd_hook, mode, fired, target)
    for i, prepend in [(0, False), (1, True), (2, False), (3, False), (4, True)]:
        hx.register_forward_hook(target, partial(hook, i), prepend=prepend)
    expected = [4, 1, 0, 2, 3]
    assert fired == []
    forward(mode, model, X10)
    assert fired == expected
    backward(mode, model, X10)  # its forward pass runs them; its backward pass does not
    assert fired == expected + expected


@pytest.mark.parametrize("mode", MODES)
def test_forward_pre_hooks(mode):
    fired: list[int] = []
    model = ToyModel()
    target = model.net2.seq1
    hook = partial(fwd_pre_hook, mode, fired, target)
    for i, prepend in [(0, True), (1, False), (2, False), (3, False), (4, True)]:
        hx.register_forward_pre_hook(target, partial(hook, i), prepend=prepend)
    expected = [4, 0, 1, 2, 3]
    assert fired == []
    forward(mode, model, X10)
    assert fired == expected
    backward(mode, model, X10)
    assert fired == expected + expected


@pytest.mark.parametrize("mode", MODES)
def test_full_backward_hooks(mode):
    """On ``net1``, whose input ``x`` is not differentiated: the hooks get ``(None,)``."""
    fired: list[int] = []
    model = ToyModel()
    hook = partial(bwd_hook, mode, fired, model.net1)
    for i, prepend in [(0, False), (1, False), (2, False), (3, True), (4, True)]:
        hx.register_full_backward_hook(model.net1, partial(hook, i), prepend=prepend)
    expected = [4, 3, 0, 1, 2]
    assert fired == []
    forward(mode, model, X10)
    assert fired == []
    backward(mode, model, X10)
    assert fired == expected
    backward(mode, model, X10)
    assert fired == expected + expected


@pytest.mark.parametrize("mode", MODES)
def test_full_backward_pre_hooks(mode):
    fired: list[int] = []
    model = ToyModel()
    hook = partial(bwd_pre_hook, mode, fired, model.net1)
    for i, prepend in [(0, True), (1, True), (2, False), (3, False), (4, False)]:
        hx.register_full_backward_pre_hook(model.net1, partial(hook, i), prepend=prepend)
    expected = [1, 0, 2, 3, 4]
    assert fired == []
    forward(mode, model, X10)
    assert fired == []
    backward(mode, model, X10)
    assert fired == expected
    backward(mode, model, X10)
    assert fired == expected + expected

    # A backward pre-hook changes the gradient that flows on.
    a = jnp.ones(2)
    lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    hx.register_full_backward_pre_hook(lin, lambda m, grad_output: (grad_output[0] * 0,))
    np.testing.assert_array_equal(backward(mode, lin, a, argnums=1), jnp.zeros_like(a))


@pytest.mark.parametrize("mode", MODES)
def test_mixed_hooks(mode):
    fired: list[int] = []
    model = ToyModel()
    hx.register_forward_pre_hook(model, partial(fwd_pre_hook, mode, fired, model, 0))
    hx.register_forward_hook(model, partial(fwd_hook, mode, fired, model, 1))
    hx.register_full_backward_pre_hook(model, partial(bwd_pre_hook, mode, fired, model, 2))
    hx.register_full_backward_hook(model, partial(bwd_hook, mode, fired, model, 3))
    assert fired == []
    forward(mode, model, X10)
    assert fired == [0, 1]
    fired.clear()
    backward(mode, model, X10)
    assert fired == [0, 1, 2, 3]
    backward(mode, model, X10)
    assert fired == [0, 1, 2, 3, 0, 1, 2, 3]


class KwargModel(nnx.Module):
    def __init__(self) -> None:
        self.net1 = Net(nnx.Rngs(0))
        self.net2 = Net(nnx.Rngs(1))

    def __call__(self, x: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        return x if bias is None else x + bias

    def internal_forward_hook(self, module, args, kwargs, out):
        return out + kwargs["bias"]


def kwarg_pre_hook(mode, fired, expected, hook_id, module, args, kwargs):
    fired.append(hook_id)
    assert same(mode, module, expected)
    assert len(args) == 1
    kwargs["bias"] = 2 * kwargs["bias"]
    return args, kwargs


def kwarg_hook(mode, fired, expected, hook_id, module, args, kwargs, out):
    fired.append(hook_id)
    assert same(mode, module, expected)
    assert len(args) == 1
    return out + kwargs["bias"]


@pytest.mark.parametrize("mode", MODES)
def test_kwarg_hooks(mode):
    x, bias = jnp.ones((10, 10)), jnp.ones((10, 10))
    fired: list[int] = []
    model = KwargModel()
    hx.register_forward_pre_hook(
        model, partial(kwarg_pre_hook, mode, fired, model, 0), with_kwargs=True
    )
    close(forward(mode, model, x, bias=bias), x + 2 * bias)
    assert fired == [0]

    fired = []
    model = KwargModel()
    hx.register_forward_hook(model, partial(kwarg_hook, mode, fired, model, 1), with_kwargs=True)
    hx.register_forward_pre_hook(
        model, partial(kwarg_pre_hook, mode, fired, model, 0), with_kwargs=True
    )
    close(forward(mode, model, x, bias=bias), x + 4 * bias)
    assert fired == [0, 1]

    model = KwargModel()  # a method of the module as its forward hook
    hx.register_forward_hook(model, model.internal_forward_hook, with_kwargs=True)
    close(forward(mode, model, x, bias=bias), x + 2 * bias)


@pytest.mark.parametrize("mode", MODES)
def test_remove_kwarg_hooks(mode):
    x, bias = jnp.ones((10, 10)), jnp.ones((10, 10))
    fired: list[int] = []
    model = KwargModel()
    fh = hx.register_forward_hook(
        model, partial(kwarg_hook, mode, fired, model, 1), with_kwargs=True
    )
    ph = hx.register_forward_pre_hook(
        model, partial(kwarg_pre_hook, mode, fired, model, 0), with_kwargs=True
    )
    close(forward(mode, model, x, bias=bias), x + 4 * bias)
    assert fired == [0, 1]
    fh.remove()
    close(forward(mode, model, x, bias=bias), x + 2 * bias)
    assert fired == [0, 1, 0]
    assert all(r.token != fh.id for r in _hooks.hook_set(model).records)
    ph.remove()
    close(forward(mode, model, x, bias=bias), x + bias)
    assert fired == [0, 1, 0]
    assert _hooks.hook_set(model) is None


class FailsInForwardModel(nnx.Module):
    def __init__(self) -> None:
        self.net1 = Net(nnx.Rngs(0))

    def __call__(self, x: jax.Array, fail: bool = True) -> jax.Array:
        if fail:
            raise RuntimeError("failing in forward")
        return self.net1(x)


class DummyContextManager:
    def __init__(self, stack: list[int]) -> None:
        self.stack = stack

    def __enter__(self) -> None:
        self.stack.append(2)

    def __exit__(self, *exc: object) -> None:
        self.stack.append(-1)


@pytest.mark.parametrize("mode", MODES)
def test_always_called_forward_hooks(mode):
    x = jnp.ones((10, 10))
    model = FailsInForwardModel()
    stack: list[int] = []
    ctx: list[DummyContextManager] = []

    def run(fail: bool = True) -> Any:
        return jit(mode, lambda m, x: m(x, fail=fail))(model, x)

    def setup(m, i):
        ctx[:] = [DummyContextManager(stack)]
        ctx[0].__enter__()

    def setup_fails(m, i):
        setup(m, i)
        raise RuntimeError("failing in ctx setup")

    def shutdown(m, i, o):
        ctx[0].__exit__()

    def shutdown_fails(m, i, o):
        ctx[0].__exit__()
        raise RuntimeError("failing in ctx shutdown")

    def throw(m, i, o):
        raise RuntimeError("failing in throw")

    pre = hx.register_forward_pre_hook(model, setup)
    fh = hx.register_forward_hook(model, shutdown, always_call=True)
    # the method raises: the always-called hook runs
    with pytest.raises(RuntimeError, match="failing in forward"):
        run()
    assert stack == [2, -1]
    # no error: it runs once
    run(fail=False)
    assert stack == [2, -1] * 2
    # a forward pre-hook raises: it runs
    pre.remove()
    hx.register_forward_pre_hook(model, setup_fails)
    with pytest.raises(RuntimeError, match="failing in ctx setup"):
        run(fail=False)
    assert stack == [2, -1] * 3
    # another always-called hook raises: this one still runs, the first error propagates
    fh2 = hx.register_forward_hook(model, throw, prepend=True, always_call=True)
    with (
        pytest.warns(RuntimeWarning, match="failing in throw"),
        pytest.raises(RuntimeError, match="failing in ctx setup"),
    ):
        run(fail=False)
    assert stack == [2, -1] * 4
    fh.remove()
    fh2.remove()
    assert not any(r.always_call for r in _hooks.hook_set(model).records)
    # an always-called hook that fails is not run a second time
    fh3 = hx.register_forward_hook(model, shutdown_fails, always_call=True)
    with (
        pytest.warns(RuntimeWarning, match="failing in ctx shutdown"),
        pytest.raises(RuntimeError, match="failing in ctx setup"),
    ):
        run(fail=False)
    assert stack == [2, -1] * 5
    fh3.remove()
    # a global (scoped) always-called hook runs when a forward pre-hook raises
    with (
        hx.hooks(forward=shutdown, always_call=True),
        pytest.raises(RuntimeError, match="failing in ctx setup"),
    ):
        run(fail=False)
    assert stack == [2, -1] * 6
    # ... and no more once its block is left
    with pytest.raises(RuntimeError, match="failing in ctx setup"):
        run()
    assert stack == [2, -1] * 6 + [2]


@pytest.mark.parametrize("mode", MODES)
def test_bw_hook_warning_for_non_tensor_or_tuple(mode):
    """Difference by design: PyTorch skips backward hooks on a dict output with a warning;
    hookax passes any pytree output, as a 1-tuple of the tree."""
    counter = {"forward": 0, "backward": 0}

    class TestModule(nnx.Module):
        def __call__(self, d: dict) -> dict:
            return {"x": jax.nn.softmax(d["x"], axis=0)}

    def fw_pre_hook(m, inputs):
        counter["forward"] += 1

    def fw_hook(m, inputs, outputs):
        counter["forward"] += 1

    def bw_pre_hook(m, grad_output):
        assert isinstance(grad_output, tuple) and list(grad_output[0]) == ["x"]
        counter["backward"] += 1

    def bw_hook(m, grad_input, grad_output):
        assert isinstance(grad_input[0], dict) and isinstance(grad_output[0], dict)
        counter["backward"] += 1

    model = TestModule()
    hx.register_forward_pre_hook(model, fw_pre_hook)
    hx.register_forward_hook(model, fw_hook)
    hx.register_full_backward_pre_hook(model, bw_pre_hook)
    hx.register_full_backward_hook(model, bw_hook)
    jit(mode, nnx.grad(lambda m, d: m(d)["x"].sum(), argnums=1))(model, {"x": jnp.ones(2)})
    assert counter == {"forward": 2, "backward": 2}


# -- TestStateDictHooks: the tests that are not about state dicts ---------------------------------


def _hook_to_pickle(*args: Any, **kwargs: Any) -> None:
    pass


def test_no_extra_ref_to_module():
    gc.disable()
    try:
        m = nnx.Linear(10, 10, rngs=nnx.Rngs(0))
        hx.register_forward_hook(m, _hook_to_pickle)
        weak_m = weakref.ref(m)
        del m
        assert weak_m() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", MODES)
def test_pickled_hook(mode):
    """PyTorch pickles a state-dict hook; here forward hooks, which survive pickle and deepcopy."""
    m = nnx.Linear(10, 10, rngs=nnx.Rngs(0))
    h = hx.register_forward_hook(m, _hook_to_pickle)
    for m2 in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert [r.fn for r in _hooks.hook_set(m2).records] == [_hook_to_pickle]
        close(forward(mode, m2, X10), forward(mode, m, X10))
        h.remove()  # removes the original's hook only, as PyTorch's handle
        assert _hooks.hook_set(m2) is not None
        hx.remove_hooks(m2)
        h = hx.register_forward_hook(m, _hook_to_pickle)


# -- TestModuleGlobalHooks ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_module_global_hooks(mode):
    modules = [Sigmoid(), Sigmoid(), Sigmoid()]
    counter = {"forwards": 0, "backwards": 0}
    sig1 = np.full((5, 5), 1 / (1 + 1 / math.e), np.float32)

    def fw_hook(inc, h_module, inp, output):
        assert isinstance(inp, tuple) and isinstance(h_module, Sigmoid)
        if mode == "eager":  # under jax.vjp of nnx.jit, debug callbacks see tracers
            close_in_hook(inp[0], ONES55)
            close_in_hook(output, sig1)
        counter["forwards"] += inc

    def bw_hook(inc, h_module, grad_input, grad_output):
        assert isinstance(grad_input, tuple) and isinstance(grad_output, tuple)
        assert isinstance(h_module, Sigmoid)
        if mode == "eager":
            close_in_hook(grad_output[0], ONES55 * 2)
        counter["backwards"] += inc

    def fw(k):
        return lambda *a: fw_hook(k, *a)

    def bw(k):
        return lambda *a: bw_hook(k, *a)

    def check(f, b):
        assert counter == {"forwards": f, "backwards": b}

    g = ONES55 * 2
    with hx.hooks(forward=fw(1)):
        for m in modules:
            forward(mode, m, ONES55)
        check(3, 0)
        with hx.hooks(backward=bw(1)):
            outs = [vjp(mode, m, ONES55) for m in modules]
            check(6, 0)
            for _, back in outs:
                back(g)
            check(6, 3)
            outs[0][1](g)  # retain_graph: a second backward of the same output
            b = 4 if mode == "eager" else 3  # under jit: once per trace, the transpose is cached
            check(6, b)
            with hx.hooks(forward=fw(2)):
                for m in modules:
                    forward(mode, m, ONES55)
                check(15, b)
                with hx.hooks(backward=bw(2)):
                    vjp(mode, modules[0], ONES55)[1](g)
                    check(18, b + 3)
                vjp(mode, modules[1], ONES55)[1](g)
                check(21, b + 4)
            vjp(mode, modules[2], ONES55)[1](g)
            check(22, b + 5)


@pytest.mark.parametrize("mode", MODES)
def test_module_global_hook_invalid_outputs(mode):
    module = Sigmoid()

    def bw_fail1(m, grad_input, grad_output):
        return grad_input[:-1]

    def bw_fail2(m, grad_input, grad_output):
        return (*grad_input, jnp.ones((2, 2)))

    for hook, got in [(bw_fail1, "got a tuple of length 0"), (bw_fail2, "of length 2")]:
        with hx.hooks(backward=hook), pytest.raises(hx.HookError, match=got):
            backward(mode, module, RANDN55, argnums=1)


@pytest.mark.parametrize("mode", MODES)
def test_module_backward_global_hook_writeable(mode):
    module = Sigmoid()
    sig_x = jax.nn.sigmoid(RANDN55)

    def bw_hook(m, grad_input, grad_output):
        assert all(isinstance(g, jax.Array) for g in (*grad_input, *grad_output))
        return tuple(gi * 2 for gi in grad_input)

    with hx.hooks(backward=bw_hook):
        _, back = vjp(mode, module, RANDN55)
        close(back(ONES55)[0], sig_x * (1 - sig_x) * 2)


@pytest.mark.parametrize("mode", MODES)
def test_module_global_forward_preforward_hook_writeable(mode):
    module = Sigmoid()
    sig_x = jax.nn.sigmoid(RANDN55)
    pre = lambda m, inp: jax.nn.relu(inp[0])  # noqa: E731
    with hx.hooks(forward_pre=pre, forward=lambda m, inp, out: -out):
        out, back = vjp(mode, module, RANDN55)
        close(out, -jax.nn.sigmoid(jax.nn.relu(RANDN55)))
        mask = (RANDN55 > 0).astype(jnp.float32)
        close(back(ONES55 * 2)[0], -sig_x * (1 - sig_x) * 2 * mask)


@pytest.mark.parametrize("mode", MODES)
def test_module_forward_preforward_hook_removable(mode):
    module = Sigmoid()
    handles: list[hx.HookHandle] = []

    def removable_hook(m, inp):
        handles[0].remove()
        return inp

    def removable_hook_2(m, inp):
        handles[1].remove()
        return inp

    handles.append(hx.register_forward_pre_hook(module, removable_hook))
    handles.append(hx.register_forward_pre_hook(module, removable_hook_2))
    assert len(_hooks.hook_set(module).records) == 2
    x = jax.random.normal(jax.random.key(2), (2, 2))
    close(forward(mode, module, x), jax.nn.sigmoid(x))
    assert _hooks.hook_set(module) is None


@pytest.mark.parametrize("mode", MODES)
def test_module_forward_forward_hook_removable(mode):
    module = Sigmoid()
    handles: list[hx.HookHandle] = []

    def removable_hook(m, inp, out):
        handles[0].remove()
        return out

    def removable_hook_2(m, inp, out):
        handles[1].remove()
        return out

    handles.append(hx.register_forward_hook(module, removable_hook))
    handles.append(hx.register_forward_hook(module, removable_hook_2))
    assert len(_hooks.hook_set(module).records) == 2
    x = jax.random.normal(jax.random.key(2), (2, 2))
    close(forward(mode, module, x), jax.nn.sigmoid(x))
    assert _hooks.hook_set(module) is None


@pytest.mark.parametrize("mode", MODES)
def test_global_and_local_hooks_order(mode):
    module = Sigmoid()
    called: list[str] = []

    def hook(name: str, before: str | None, ret: int) -> Any:
        def fn(m, *a):
            assert before is None or before in called
            assert name not in called
            called.append(name)
            return a[ret]

        return fn

    hx.register_forward_pre_hook(module, hook("local_pre", "global_pre", 0))
    hx.register_forward_hook(module, hook("local_fwd", "global_fwd", 1))
    hx.register_full_backward_hook(module, hook("local_bwd", "global_bwd", 0))
    scoped = hx.hooks(
        forward_pre=hook("global_pre", None, 0),
        forward=hook("global_fwd", None, 1),
        backward=hook("global_bwd", None, 0),
    )
    with scoped:
        _, back = vjp(mode, module, RANDN55)
        assert set(called) == {"global_pre", "local_pre", "global_fwd", "local_fwd"}
        back(ONES55)
        assert {"global_bwd", "local_bwd"} <= set(called)


# -- TestModuleHookNN -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "register", ["register_full_backward_hook", "register_full_backward_pre_hook"]
)
@pytest.mark.parametrize("mode", MODES)
def test_hooks(mode, register):
    """PyTorch's ``_test_hooks`` (the legacy ``register_backward_hook`` variant is not ported)."""
    module = Sigmoid()
    counter = {"forwards": 0, "backwards": 0}

    def fw_hook(inc, h_module, inp, output):
        assert isinstance(inp, tuple) and same(mode, h_module, module)
        if mode == "eager":  # under jax.vjp of nnx.jit, debug callbacks see tracers
            close_in_hook(inp[0], ONES55)
            close_in_hook(output, np.full((5, 5), 1 / (1 + 1 / math.e)))
        counter["forwards"] += inc

    def bw_hook(inc, h_module, *grads):
        assert all(isinstance(g, tuple) for g in grads) and same(mode, h_module, module)
        if mode == "eager":
            close_in_hook(grads[-1][0], ONES55 * 2)
        counter["backwards"] += inc

    def check(f, b):
        assert counter == {"forwards": f, "backwards": b}

    reg = getattr(hx, register)
    g = ONES55 * 2
    fwd1 = hx.register_forward_hook(module, lambda *a: fw_hook(1, *a))
    forward(mode, module, ONES55)
    forward(mode, module, ONES55)
    check(2, 0)
    bwd1 = reg(module, lambda *a: bw_hook(1, *a))
    _, back = vjp(mode, module, ONES55)
    check(3, 0)
    back(g)
    check(3, 1)
    back(g)  # retain_graph; under jit the transpose is cached: once per trace
    b = 2 if mode == "eager" else 1
    check(3, b)
    fwd2 = hx.register_forward_hook(module, lambda *a: fw_hook(2, *a))
    forward(mode, module, ONES55)
    check(6, b)
    bwd2 = reg(module, lambda *a: bw_hook(2, *a))
    vjp(mode, module, ONES55)[1](g)
    check(9, b + 3)
    bwd2.remove()
    vjp(mode, module, ONES55)[1](g)
    check(12, b + 4)
    fwd2.remove()
    vjp(mode, module, ONES55)[1](g)
    check(13, b + 5)
    fwd1.remove()
    bwd1.remove()
    assert _hooks.hook_set(module) is None


@pytest.mark.parametrize("mode", MODES)
def test_hook_cpp(mode):
    bn = nnx.BatchNorm(5, rngs=nnx.Rngs(0))
    seen = []

    def hook(module, grad_inputs, grad_outputs):
        assert len(grad_inputs) == 1 and len(grad_outputs) == 1
        assert same(mode, module, bn)
        seen.append(1)

    hx.register_full_backward_hook(bn, hook)
    backward(mode, bn, jax.random.normal(jax.random.key(3), (5, 5)), argnums=1)
    assert seen == [1]


@pytest.mark.parametrize("mode", MODES)
def test_backward_hooks_interaction(mode):
    """The grad_output a backward pre-hook returns is what the backward hook gets."""
    module = Sigmoid()
    cnt = {"backward_cnt": 0}

    def bw_pre_hook(m, grad_output):
        cnt["backward_cnt"] += 1
        return (grad_output[0] * 0.5,)

    def bw_hook(m, grad_in, grad_output):
        close_in_hook(grad_output[0], np.full((1, 2), 0.5))
        cnt["backward_cnt"] += 1
        return grad_output

    hx.register_full_backward_pre_hook(module, bw_pre_hook)
    hx.register_full_backward_hook(module, bw_hook)
    backward(mode, module, jnp.ones((1, 2)), argnums=1)
    assert cnt["backward_cnt"] == 2


@pytest.mark.parametrize("mode", MODES)
def test_hook_invalid_outputs(mode):
    module = Sigmoid()

    def run() -> Any:
        return backward(mode, module, RANDN55, argnums=1)

    bad = [
        (hx.register_full_backward_hook, lambda m, gi, go: gi[:-1], "of length 0"),
        (hx.register_full_backward_hook, lambda m, gi, go: (*gi, jnp.ones((2, 2))), "of length 2"),
        (hx.register_full_backward_pre_hook, lambda m, go: (), "of length 0"),
        (hx.register_full_backward_pre_hook, lambda m, go: (*go, jnp.ones((2, 2))), "of length 2"),
    ]
    for register, hook, got in bad:
        with register(module, hook), pytest.raises(hx.HookError, match=f"got a tuple {got}"):
            run()


@pytest.mark.parametrize("mode", MODES)
def test_hook_requires_grad(mode):
    """The hooks' identities do not change which arguments JAX differentiates."""

    class MyModule(nnx.Module):
        def __call__(self, arg1, arg2, arg3):
            return arg1.sum() + arg2.sum() + arg3.sum()

    inp = jax.random.uniform(jax.random.key(4), (2,))
    mod = MyModule()

    def loss(m, x):
        return m(x, jax.lax.stop_gradient(x), x)

    f = jit(mode, nnx.grad(loss, argnums=1))
    want = f(mod, inp)
    hx.register_full_backward_hook(mod, lambda mod, gi, go: None)
    close(f(mod, inp), want)
    close(want, 2 * jnp.ones(2))


@pytest.mark.parametrize("mode", MODES)
def test_hook_no_requires_grad(mode):
    mod = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    inp = jax.random.uniform(jax.random.key(5), (1, 2))
    return_val = ["None"]
    hook_called = [0]

    def hook(m, grad_input, grad_output):
        hook_called[0] += 1
        assert all(gi is None for gi in grad_input)
        assert all(go.shape == (1, 3) for go in grad_output)
        return {"grad_input": grad_input, "invalid": inp, "None": None}[return_val[0]]

    hx.register_full_backward_hook(mod, hook)
    backward(mode, mod, inp)  # parameters only: the input is not differentiated
    assert hook_called[0] == 1
    return_val[0] = "grad_input"
    backward(mode, mod, inp)
    assert hook_called[0] == 2
    return_val[0] = "invalid"
    with pytest.raises(hx.HookError, match="no input of this call is differentiated"):
        backward(mode, mod, inp)


@pytest.mark.parametrize("mode", MODES)
def test_hook_last_arg_requires_grad(mode):
    class L1Loss(nnx.Module):
        def __call__(self, a, b):
            return jnp.abs(a - b).mean()

    mod = L1Loss()
    inp = jax.random.uniform(jax.random.key(6), (1,))
    hx.register_full_backward_hook(mod, lambda m, gi, go: None)
    jit(mode, nnx.grad(lambda m, x: m(jax.lax.stop_gradient(x), x), argnums=1))(mod, inp)


@pytest.mark.parametrize("mode", MODES)
def test_hook_extra_input(mode):
    class MyModule(nnx.Module):
        def __call__(self, non_tensor, tensor):
            return tensor * 1, non_tensor

    inp = jax.random.uniform(jax.random.key(7), (2,))
    mod = MyModule()
    seen = []

    def hook(m, grad_input, grad_output):
        assert grad_input[0] is None and isinstance(grad_input[1], jax.Array)
        assert isinstance(grad_output[0], jax.Array) and grad_output[1] is None
        seen.append(1)

    hx.register_full_backward_hook(mod, hook)
    jit(mode, nnx.grad(lambda m, x: m(True, x)[0].sum(), argnums=1))(mod, inp)
    assert seen == [1]


@pytest.mark.parametrize("mode", MODES)
def test_hook_backward_size(mode):
    class MyModule(nnx.Module):
        def __call__(self, arg1, arg2):
            tmp = arg1.sum() * arg2
            tmp = tmp + arg2.sum() * arg1.sum()
            return jnp.broadcast_to(tmp.sum().reshape(1), (8,))

    module = MyModule()
    inp1 = jax.random.normal(jax.random.key(8), (5, 5))
    inp2 = jax.random.normal(jax.random.key(9), (10, 10))
    seen = []

    def bw_hook(m, grad_input, grad_output):
        assert [g.shape for g in grad_input] == [(5, 5), (10, 10)]
        assert [g.shape for g in grad_output] == [(8,)]
        seen.append(1)

    with hx.register_full_backward_hook(module, bw_hook):
        jit(mode, nnx.grad(lambda m, a, b: m(a, b).sum(), argnums=(1, 2)))(module, inp1, inp2)
    assert seen == [1]


@pytest.mark.parametrize("mode", MODES)
def test_hook_backward_writeable(mode):
    module = Sigmoid()
    sig_x = jax.nn.sigmoid(RANDN55)

    def bw_hook(m, grad_input, grad_output):
        assert all(isinstance(g, jax.Array) for g in (*grad_input, *grad_output))
        return tuple(gi * 2 for gi in grad_input)

    hx.register_full_backward_hook(module, bw_hook)
    close(vjp(mode, module, RANDN55)[1](ONES55)[0], sig_x * (1 - sig_x) * 2)


@pytest.mark.parametrize("mode", MODES)
def test_hook_forward_preforward_writable(mode):
    module = Sigmoid()
    sig_x = jax.nn.sigmoid(RANDN55)
    hx.register_forward_pre_hook(module, lambda m, inp: jax.nn.relu(inp[0]))
    hx.register_forward_hook(module, lambda m, inp, out: -out)
    out, back = vjp(mode, module, RANDN55)
    close(out, -jax.nn.sigmoid(jax.nn.relu(RANDN55)))
    close(back(ONES55 * 2)[0], -sig_x * (1 - sig_x) * 2 * (RANDN55 > 0).astype(jnp.float32))


# -- test_autograd.py: tensor hooks (Tensor.register_hook is hx.hook_grad) ------------------------


@pytest.mark.parametrize("mode", MODES)
def test_hooks_tensor(mode):
    """``TestAutograd.test_hooks``: the hooks on ``z`` change, between backward passes."""
    x = jnp.ones((5, 5))
    y = jnp.ones((5, 5)) * 4
    counter = [0]

    def bw_hook(inc, grad):
        assert isinstance(grad, jax.Array)
        counter[0] += inc

    def grads(z_hooks, y_hooks=()):
        def f(x, y):
            for h in y_hooks:
                y = hx.hook_grad(y, h)
            x = hx.hook_grad(x, lambda g: bw_hook(0, g))
            z = x**2 + x * 2 + x * y + y
            for h in z_hooks:
                z = hx.hook_grad(z, h)
            return z

        return jit(mode, lambda x, y: jax.vjp(f, x, y)[1](jnp.ones((5, 5))))(x, y)

    one, two = (lambda g: bw_hook(1, g)), (lambda g: bw_hook(2, g))
    grads([one])
    assert counter[0] == 1
    grads([one, two])
    assert counter[0] == 4
    grads([one])
    assert counter[0] == 5
    double = lambda g: g * 2  # noqa: E731
    close(grads([double])[1], (x + 1) * 2)
    close(grads([double], [double])[1], (x + 1) * 4)


@pytest.mark.parametrize("mode", MODES)
def test_hook_grad_order(mode):
    """Difference: two ``Tensor.register_hook`` on one tensor run in registration order; two
    ``hx.hook_grad`` on one value are nested identities, so the outer (later) one runs first.
    PyTorch's order: one ``hook_grad`` whose function runs the hooks in turn."""
    order: list[int] = []

    def grad(*layers: Any) -> Any:
        def f(x):
            for fn in layers:
                x = hx.hook_grad(x, fn)
            return x.sum()

        return jit(mode, jax.grad(f))(jnp.ones(2))

    h1, h2 = (lambda g: order.append(1)), (lambda g: order.append(2))
    grad(h1, h2)
    assert order == [2, 1]
    order.clear()

    def in_turn(*hooks: Any) -> Any:
        def fn(g: Any) -> Any:
            for h in hooks:
                out = h(g)
                g = g if out is None else out
            return g

        return fn

    grad(in_turn(h1, h2))
    assert order == [1, 2]


@pytest.mark.parametrize("mode", MODES)
def test_hooks_cpp(mode):
    bn = nnx.BatchNorm(5, use_bias=False, use_scale=False, use_running_average=True, rngs=None)
    counter = [0]

    def bw_hook(grad):
        counter[0] += 1
        return grad * 2

    f = jit(mode, nnx.grad(lambda m, x: hx.hook_grad(m(x), bw_hook).sum(), argnums=1))
    close(f(bn, jnp.ones((5, 5))), jnp.ones((5, 5)) * 2, atol=1e-5)
    assert counter[0] == 1


@pytest.mark.parametrize("mode", MODES)
def test_hook_none(mode):
    """A hook is never called with None: ``ry`` gets no gradient, so its hook does not run."""
    was_called = []

    def hook(grad):
        assert grad is not None
        was_called.append(grad.shape)

    x = jax.random.normal(jax.random.key(10), (5, 5))
    y = jax.random.normal(jax.random.key(11), (5, 5))

    def f(x):
        rx, ry = hx.hook_grad(x, hook), hx.hook_grad(y, hook)
        return (rx + ry).sum()

    jit(mode, jax.grad(f))(x)
    assert was_called == [(5, 5)]


# -- the same numbers as PyTorch itself, when it is installed -------------------------------------


def test_against_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w, b, x = rng.normal(size=(3, 4)), rng.normal(size=3), rng.normal(size=(2, 4))
    seen: dict[str, list[Any]] = {"torch": [], "hookax": []}

    tl = torch.nn.Linear(4, 3).double()
    with torch.no_grad():
        tl.weight.copy_(torch.tensor(w))
        tl.bias.copy_(torch.tensor(b))
    tl.register_full_backward_pre_hook(lambda m, go: (go[0] * 3,))
    tl.register_full_backward_hook(lambda m, gi, go: seen["torch"].append(gi[0].numpy()))
    tx = torch.tensor(x, requires_grad=True)
    (tl(tx) ** 2).sum().backward()

    jax.config.update("jax_enable_x64", True)
    try:
        jl = nnx.Linear(4, 3, param_dtype=jnp.float64, dtype=jnp.float64, rngs=nnx.Rngs(0))
        jl.kernel[...] = jnp.asarray(w.T)
        jl.bias[...] = jnp.asarray(b)
        hx.register_full_backward_pre_hook(jl, lambda m, go: (go[0] * 3,))
        hx.register_full_backward_hook(jl, lambda m, gi, go: seen["hookax"].append(gi[0]))
        gx = nnx.grad(lambda m, x: (m(x) ** 2).sum(), argnums=1)(jl, jnp.asarray(x))
    finally:
        jax.config.update("jax_enable_x64", False)
    close(gx, tx.grad.numpy())
    close(seen["hookax"][0], seen["torch"][0])
