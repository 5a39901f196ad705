"""The bad-input catalogue: every misuse of the public API, and the exact message it gets.

Each case raises an ``hx.HookaxError`` subclass whose message names the call site (module path and
method) where there is one, what was expected and what was given, and the fix. After each error
nothing is registered or active, and the model still computes the same output.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from tests.models import MLP
from tests.reliability_helpers import assert_clean

X = jnp.ones((2, 3))
MODES = ["eager", "jit"]


def raises(exc: type[BaseException], fn: Callable[[], Any], *parts: str) -> BaseException:
    """``fn()`` raises ``exc`` whose message contains every one of ``parts``, in order."""
    pattern = ".*".join(re.escape(p) for p in parts)
    with pytest.raises(exc, match=re.compile(pattern, re.S)) as info:
        fn()
    assert isinstance(info.value, hx.HookaxError)
    return info.value


def forward(mode: str, model: Any) -> Any:
    if mode == "eager":
        return model(X)
    return nnx.jit(lambda m, x: m(x))(model, X)


def grad(mode: str, model: Any) -> Any:
    g = nnx.grad(lambda m, x: m(x).sum(), argnums=1)
    return g(model, X) if mode == "eager" else nnx.jit(g)(model, X)


# --- wrong hook arity: detected at registration ------------------------------------------------

ARITY = [
    (
        hx.register_forward_pre_hook,
        lambda m, a, extra: None,
        {},
        "hx.register_forward_pre_hook: hook",
        "has the signature (m, a, extra), but forward pre-hooks at 'layers/0' (Linear.__call__) "
        "and 2 more are called as hook(module, args) (2 positional arguments). "
        "Fix: `def hook(module, args): ...` (or pass with_kwargs=True for "
        "hook(module, args, kwargs)).",
    ),
    (
        hx.register_forward_hook,
        lambda m, out: None,
        {},
        "hx.register_forward_hook: hook",
        "has the signature (m, out), but forward hooks at 'layers/0' (Linear.__call__) and 2 more "
        "are called as hook(module, args, output) (3 positional arguments). "
        "Fix: `def hook(module, args, output): ...` (or pass with_kwargs=True for "
        "hook(module, args, kwargs, output)).",
    ),
    (
        hx.register_forward_hook,
        lambda m, a, out: None,
        {"with_kwargs": True},
        "hx.register_forward_hook: hook",
        "has the signature (m, a, out), but forward hooks at 'layers/0' (Linear.__call__) and 2 "
        "more are called as hook(module, args, kwargs, output) (4 positional arguments). "
        "Fix: `def hook(module, args, kwargs, output): ...` (or pass with_kwargs=False for "
        "hook(module, args, output)).",
    ),
    (
        hx.register_full_backward_pre_hook,
        lambda m: None,
        {},
        "hx.register_full_backward_pre_hook: hook",
        "has the signature (m), but backward pre-hooks at 'layers/0' (Linear.__call__) and 2 more "
        "are called as hook(module, grad_output) (2 positional arguments). "
        "Fix: `def hook(module, grad_output): ...`.",
    ),
    (
        hx.register_full_backward_hook,
        lambda m, g: None,
        {},
        "hx.register_full_backward_hook: hook",
        "has the signature (m, g), but backward hooks at 'layers/0' (Linear.__call__) and 2 more "
        "are called as hook(module, grad_input, grad_output) (3 positional arguments). "
        "Fix: `def hook(module, grad_input, grad_output): ...`.",
    ),
]


@pytest.mark.parametrize(("register", "hook", "kw", "head", "tail"), ARITY)
def test_wrong_hook_arity_is_refused_at_registration(register, hook, kw, head, tail):
    model = MLP()
    raises(hx.HookError, lambda: register(model, hook, where=nnx.Linear, **kw), head, tail)
    assert_clean(model)


def test_wrong_arity_names_the_root_without_where_and_accepts_flexible_signatures():
    model = MLP()
    raises(
        hx.HookError,
        lambda: hx.register_forward_hook(model, lambda m: None),
        "forward hooks at '' (MLP.__call__) are called as hook(module, args, output)",
    )

    # *args, defaults and bound methods are accepted: only an impossible call is refused.
    class Hooks:
        def fwd(self, m, args, out, extra=1):
            return None

    for hook in (lambda *a: None, lambda m, a, o, extra=None: None, Hooks().fwd):
        hx.register_forward_hook(model, hook).remove()
    assert_clean(model)


def test_wrong_arity_of_scoped_hooks_and_interceptors():
    raises(
        hx.HookError,
        lambda: hx.hooks(where=nnx.Linear, backward=lambda m, g: None),
        "hx.hooks: hook",
        "backward hooks at the call sites where=<class 'flax.nnx.nn.linear.Linear'> selects are "
        "called as hook(module, grad_input, grad_output)",
        "Fix: `def hook(module, grad_input, grad_output): ...`.",
    )
    raises(
        hx.HookError,
        lambda: hx.hooks(forward_pre=lambda m, a: None, with_kwargs=True),
        "forward pre-hooks at the call sites where=None selects are called as "
        "hook(module, args, kwargs) (3 positional arguments)",
    )
    raises(
        hx.HookError,
        lambda: hx.intercept(lambda next_fun, args, kwargs: None, where="layers/*"),
        "hx.intercept: interceptor",
        "has the signature (next_fun, args, kwargs), but interceptors at the call sites "
        "where='layers/*' selects are called as interceptor(next_fun, args, kwargs, context) "
        "(4 positional arguments). Fix: `def interceptor(next_fun, args, kwargs, context): ...`.",
    )
    assert_clean()


# --- wrong return structure, shape or dtype -----------------------------------------------------

# A forward hook may return an output of any structure or shape, as in PyTorch (see
# tests/test_hooks.py::test_forward_hook_may_change_shape_and_structure): nothing to check there.


@pytest.mark.parametrize("mode", MODES)
def test_pre_hook_with_kwargs_wrong_return(mode):
    model = MLP()
    h = hx.register_forward_pre_hook(model, lambda m, a, k: a, with_kwargs=True, where="layers/2")
    raises(
        hx.HookError,
        lambda: forward(mode, model),
        "forward pre-hook ",
        " (with_kwargs=True) at call site 'layers/2' (Linear.__call__) must return None or a "
        "pair (new_args, new_kwargs), got (",
        "Fix: `return args, kwargs`.",
    )
    h.remove()
    assert_clean(model)


BACKWARD_RETURNS = [
    (
        hx.register_full_backward_pre_hook,
        lambda m, g: (g[0][0],),
        "backward pre-hook ",
        "'s grad_output (entry 0) at call site 'layers/0' (Linear.__call__) has the wrong shape "
        "or dtype at the value: expected float32[2,4], got float32[4]. Fix: return None, or a "
        "tuple like grad_output (an entry None for a zero gradient).",
    ),
    (
        hx.register_full_backward_pre_hook,
        lambda m, g: g[0],
        "backward pre-hook ",
        "'s grad_output at call site 'layers/0' (Linear.__call__) must be a tuple with one "
        "entry per output (1), got float32[2,4]. Fix: return None, or a tuple like grad_output "
        "(an entry None for a zero gradient), e.g. `return (grad_output[0] * 2,)`.",
    ),
    (
        hx.register_full_backward_hook,
        lambda m, gi, go: gi[0],
        "backward hook ",
        "'s grad_input at call site 'layers/0' (Linear.__call__) must be a tuple with one entry "
        "per positional argument (1), got float32[2,3]. Fix: return None, or a tuple like "
        "grad_input (an entry None for a zero gradient), e.g. `return (grad_input[0] * 2,)`.",
    ),
    (
        hx.register_full_backward_hook,
        lambda m, gi, go: (gi[0], gi[0]),
        "backward hook ",
        "must be a tuple with one entry per positional argument (1), got a tuple of length 2 "
        "(`grad_input * k` repeats a tuple: scale its entries instead).",
    ),
    (
        hx.register_full_backward_hook,
        lambda m, gi, go: (gi[0].astype(jnp.bfloat16),),
        "backward hook ",
        "'s grad_input (entry 0) at call site 'layers/0' (Linear.__call__) has the wrong shape "
        "or dtype at the value: expected float32[2,3], got bfloat16[2,3].",
    ),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("register", "hook", "head", "tail"), BACKWARD_RETURNS)
def test_backward_hook_wrong_return(mode, register, hook, head, tail):
    model = MLP()
    want = grad(mode, model)
    h = register(model, hook, where="layers/0")
    raises(hx.HookError, lambda: grad(mode, model), head, tail)
    h.remove()
    assert_clean(model)
    np.testing.assert_array_equal(grad(mode, model), want)


@pytest.mark.parametrize("mode", MODES)
def test_hook_grad_wrong_return(mode):
    def f(x):
        return hx.hook_grad(x, lambda g: g.astype(jnp.bfloat16)).sum()

    g = jax.grad(f) if mode == "eager" else jax.jit(jax.grad(f))
    raises(
        hx.HookError,
        lambda: g(X),
        "gradient hook ",
        "'s cotangent at hx.hook_grad has the wrong shape or dtype at the value: expected "
        "float32[2,3], got bfloat16[2,3]. Fix: return None to keep the cotangent",
    )


# --- where= -------------------------------------------------------------------------------------

SUBMODULES = (
    "its submodules (paths relative to it) include 'layers/0' (Linear), 'layers/1' (Linear), "
    "'layers/2' (Linear), 'layers' (List), '' (MLP). Fix: pass a where= that matches one of "
    'them, e.g. where=nnx.Linear or where="layers/*".'
)


@pytest.mark.parametrize(
    ("where", "shown"),
    [("layers/9", "'layers/9'"), ("**/attn", "'**/attn'"), (nnx.Conv, "<class 'flax.nnx.nn.")],
)
def test_where_matching_nothing_at_registration(where, shown):
    model = MLP()
    for register in (hx.register_forward_hook, hx.register_full_backward_hook):
        raises(
            hx.SelectorError,
            lambda r=register: r(model, lambda m, a, o: None, where=where),
            f"hx.{register.__name__}(where={shown}",
            ") matched no submodule of MLP; ",
            SUBMODULES,
        )
    assert_clean(model)


UNKNOWN = (
    "where= must be None, a class or tuple of classes, a path glob string, a callable "
    "(ctx) -> bool, or hx.Select(...); got 5 of type int. Fix: e.g. where=nnx.Linear, "
    'where="layers/*/attn" or where=hx.Select(methods="encode").'
)


def test_unknown_selector_type_everywhere():
    model = MLP()
    loss = lambda m, x: m(x).sum()  # noqa: E731
    calls = [
        lambda: hx.register_forward_hook(model, lambda m, a, o: None, where=5),
        lambda: hx.hooks(where=5, forward=lambda m, a, o: None),
        lambda: hx.intercept(lambda n, a, k, c: n(*a, **k), where=5),
        lambda: hx.capture(model, where=5),
        lambda: hx.value_and_grad(loss, where=5),
        lambda: hx.Select(paths="layers/*") & 5,
        lambda: 5 | hx.Select(paths="layers/*"),
    ]
    for call in calls:
        raises(hx.SelectorError, call, UNKNOWN)
    assert_clean(model)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"types": "Linear"},
            "Select(types=...) takes a class or a tuple of classes, got 'Linear'. Fix: pass the "
            "module classes themselves, e.g. Select(types=nnx.Linear).",
        ),
        (
            {"paths": 0},
            "Select(paths=...) takes a glob string or a tuple of them, got 0. "
            'Fix: Select(paths="layers/*/attn").',
        ),
        (
            {"methods": ("__call__", 1)},
            "Select(methods=...) takes a method name, a tuple of names or '*', got "
            "('__call__', 1). Fix: Select(methods=('__call__', 'encode')).",
        ),
    ],
)
def test_malformed_select(kwargs, message):
    raises(hx.SelectorError, lambda: hx.Select(**kwargs), message)


# --- not a module, not callable -----------------------------------------------------------------


def fn_not_module(x: Any) -> Any:
    return x


@pytest.mark.parametrize(
    ("obj", "got"),
    [
        (fn_not_module, "got function: <function fn_not_module"),
        (np.zeros(2), "got ndarray: array([0., 0.])"),
        (nnx.Rngs(0), "got Rngs: Rngs("),
    ],
)
def test_non_module_passed_to_register(obj, got):
    register = [
        hx.register_forward_pre_hook,
        hx.register_forward_hook,
        hx.register_full_backward_pre_hook,
        hx.register_full_backward_hook,
    ]
    tail = (
        "Modules of frameworks whose modules are immutable (Equinox, Linen) and plain functions "
        "take hooks in the scoped form. Fix: `with hx.hooks(where=..., forward=hook): "
        "y = model(x)`."
    )
    for r in register:
        raises(
            hx.HookaxError,
            lambda r=r: r(obj, lambda *a: None),
            f"hx.{r.__name__} expects a Flax NNX module (an nnx.Module instance) to store the "
            f"hook on, {got}",
            tail,
        )
    raises(hx.HookaxError, lambda: hx.remove_hooks(obj), "hx.remove_hooks expects", got, tail)
    assert_clean()


def test_non_callable_hooks_interceptors_and_functions():
    model = MLP()
    raises(
        hx.HookaxError,
        lambda: hx.register_forward_hook(model, "print", where=nnx.Linear),
        "hx.register_forward_hook expects a callable hook, got 'print' of type str to run at "
        "MLP.__call__. Fix: pass a function, e.g. `def hook(module, args, output): ...`.",
    )
    raises(
        hx.HookaxError,
        lambda: hx.hooks(backward_pre=3),
        "hx.hooks(backward_pre=...) expects a callable hook, got 3. Fix: pass a function",
    )
    raises(
        hx.HookaxError,
        lambda: hx.intercept(None),
        "hx.intercept expects a callable interceptor(next_fun, args, kwargs, context), got None "
        "of type NoneType. Fix: `def interceptor(next_fun, args, kwargs, context): "
        "return next_fun(*args, **kwargs)`.",
    )
    raises(
        hx.HookaxError,
        lambda: hx.capture([model]),
        "hx.capture expects a module or a function that calls modules, got [MLP(",
        "of type list. Fix: hx.capture(model)(x), or hx.capture(lambda x: model(x))(x).",
    )
    raises(
        hx.HookaxError,
        lambda: hx.value_and_grad(1.0),
        "hx.value_and_grad expects a loss function, got 1.0 of type float. Fix: "
        "hx.value_and_grad(lambda model, x: model(x).sum()).",
    )
    raises(
        hx.HookaxError,
        lambda: hx.value_and_grad(lambda m, x: m(x).sum(), argnums=2)(model, X),
        "hx.value_and_grad: argnums=2 names no positional argument of the 2 given. Pass the "
        "model and data positionally: hx.value_and_grad(loss_fn)(model, x, y).",
    )
    assert_clean(model)


# --- capture keys that collide ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_capture_keys_that_collide(mode):
    a, b = MLP(seed=0), MLP(seed=1)
    fwd = hx.capture(lambda x: a(x) + b(x))
    if mode == "jit":
        fwd = jax.jit(fwd)
    raises(
        hx.HookaxError,
        lambda: fwd(X),
        "hx.capture: call site key '' (MLP.__call__) was recorded for two different "
        "modules (MLP at 0x",
        "the captured function calls separate models, each the root of its own paths, so their "
        "keys collide. Fix: capture each model separately (hx.capture(model_a), "
        "hx.capture(model_b)), or make them submodules of one parent module and call that.",
    )
    assert_clean(a, b)
    # The same model called twice is one call site called twice: no collision.
    _y, acts = hx.capture(lambda x: a(a(x)[:, :3]))(X)
    assert [len(v) for v in acts.values()] == [2, 2, 2, 2]
    # Made submodules of one parent module that is called, they get distinct keys.
    _, acts = hx.capture(Pair(a, b))(X)
    layers = ["layers/0", "layers/1", "layers/2"]
    assert list(acts) == ["", "a", *(f"a/{k}" for k in layers), "b", *(f"b/{k}" for k in layers)]


class Pair(nnx.Module):
    def __init__(self, a: nnx.Module, b: nnx.Module) -> None:
        self.a, self.b = a, b

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.a(x) + self.b(x)
