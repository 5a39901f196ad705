"""The conformance suite: the same behaviour on Flax NNX, Flax Linen, Equinox and Haiku.

Each framework builds the same two-layer MLP (``Linear(3, 4)``, relu, ``Linear(4, 2)``) from its
library layers (``nnx.Linear``, ``nn.Dense``, ``eqx.nn.Linear``, ``hk.Linear``) with the same
weights, so every expected value is computed once, by hand, and is exact for all four. Every
behaviour runs eagerly and under the framework's own jit (``nnx.jit``, ``jax.jit`` of ``apply``,
``eqx.filter_jit``), where trace counts prove the caches right. Haiku has no model object: its
"state" is the parameters of ``hk.transform``, and its outermost module is keyed by its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context

W1 = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 10 - 0.5
B1 = jnp.array([0.1, -0.2, 0.3, -0.4], jnp.float32)
W2 = jnp.arange(8, dtype=jnp.float32).reshape(4, 2) / 8 - 0.4
B2 = jnp.array([0.05, -0.05], jnp.float32)
X = jnp.array([1.0, -2.0, 0.5], jnp.float32)


def h1(x: jax.Array) -> jax.Array:
    return x @ W1 + B1


def out(h: jax.Array) -> jax.Array:
    return jax.nn.relu(h) @ W2 + B2


class NNXMLP(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)])
        for layer, w, b in zip(self.layers, (W1, W2), (B1, B2)):
            layer.kernel.set_value(w)
            layer.bias.set_value(b)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


class LinenMLP(nn.Module):
    def setup(self) -> None:
        self.layers = [nn.Dense(4), nn.Dense(2)]

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


class EqxMLP(eqx.Module):
    layers: list[eqx.nn.Linear]

    def __init__(self) -> None:
        k1, k2 = jax.random.split(jax.random.key(0))
        layers = [eqx.nn.Linear(3, 4, key=k1), eqx.nn.Linear(4, 2, key=k2)]
        self.layers = eqx.tree_at(
            lambda ls: (ls[0].weight, ls[0].bias, ls[1].weight, ls[1].bias),
            layers,
            (W1.T, B1, W2.T, B2),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


class HaikuMLP(hk.Module):
    def __init__(self) -> None:
        super().__init__(name="mlp")
        self.layers = [hk.Linear(4), hk.Linear(2)]

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


def haiku_forward(x: jax.Array) -> jax.Array:
    return HaikuMLP()(x)


HAIKU = hk.transform(haiku_forward)
HAIKU_PARAMS = {"mlp/~/linear": {"w": W1, "b": B1}, "mlp/~/linear_1": {"w": W2, "b": B2}}


@dataclasses.dataclass
class Framework:
    """One framework's model, how to call it, and how it names things."""

    name: str
    state: Any  # what is passed to the forward: the model (NNX, Equinox) or its variables (Linen)
    apply: Callable[[Any, jax.Array], jax.Array]  # (state, x) -> y, plain Python
    jit: Callable[[Callable[..., Any]], Callable[..., Any]]  # the framework's jit
    linear: type
    keys: tuple[str, str]  # the two layers' call-site keys
    module_type: type
    root: str = ""  # the outermost module's key

    def forward(self, mode: str, counter: Callable[[], None] | None = None) -> Callable:
        """``f(x) -> y`` eagerly or under the framework's jit (one jitted function per call)."""

        def body(state: Any, x: jax.Array) -> jax.Array:
            if counter is not None:
                counter()
            return self.apply(state, x)

        fn = body if mode == "eager" else self.jit(body)
        return lambda x: fn(self.state, x)

    def loss(self, state: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(self.apply(state, x) ** 2)

    def grad_x(self, mode: str) -> jax.Array:
        """d sum(model(x)) / dx at ``X``, through the framework's grad (NNX: ``nnx.grad``)."""
        grad = nnx.grad if self.name == "nnx" else jax.grad
        fn = grad(lambda s, x: jnp.sum(self.apply(s, x)), argnums=1)
        return (fn if mode == "eager" else self.jit(fn))(self.state, X)


def _make(name: str) -> Framework:
    if name == "nnx":
        m = NNXMLP()
        return Framework(
            "nnx", m, lambda s, x: s(x), nnx.jit, nnx.Linear, ("layers/0", "layers/1"), NNXMLP
        )
    if name == "linen":
        lm = LinenMLP()
        params = {
            "params": {
                "layers_0": {"kernel": W1, "bias": B1},
                "layers_1": {"kernel": W2, "bias": B2},
            }
        }
        return Framework(
            "linen", params, lm.apply, jax.jit, nn.Dense, ("layers_0", "layers_1"), LinenMLP
        )
    if name == "haiku":
        return Framework(
            "haiku",
            HAIKU_PARAMS,
            lambda p, x: HAIKU.apply(p, None, x),
            jax.jit,
            hk.Linear,
            ("mlp/linear", "mlp/linear_1"),
            HaikuMLP,
            root="mlp",
        )
    em = EqxMLP()
    return Framework(
        "equinox",
        em,
        lambda s, x: s(x),
        eqx.filter_jit,
        eqx.nn.Linear,
        ("layers/0", "layers/1"),
        EqxMLP,
    )


@pytest.fixture(params=["nnx", "linen", "equinox", "haiku"])
def framework(request: Any) -> Framework:
    return _make(request.param)


modes = pytest.mark.parametrize("mode", ["eager", "jit"])


def close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


class Keys:
    """An interceptor recording each call site's key and module type."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
        self.seen.append((ctx.key, type(ctx.module).__name__))
        return next_fun(*args, **kwargs)


_KEYS = Keys()


def keys() -> Keys:
    """The one recorder, emptied: one object, so one jit-cache key for every test."""
    _KEYS.seen.clear()
    return _KEYS


# Hooks and interceptors are module-level: equal jit-cache keys across tests, so the eager
# operations compiled for one test are reused by the next (a fresh function is a fresh key).
def double(next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
    return next_fun(*args, **kwargs) * 2


def plus_one(m: Any, args: tuple, output: Any) -> Any:
    return output + 1


def ones_in(m: Any, args: tuple) -> Any:
    return jnp.ones_like(args[0])


def triple(m: Any, grad_output: tuple) -> tuple:
    return (grad_output[0] * 3,)


def twice_grad(m: Any, args: tuple, output: Any) -> Any:
    return hx.hook_grad(output, lambda g: g * 2)


@pytest.fixture(autouse=True)
def nothing_left_active() -> Any:
    yield
    assert _context.active_entries() == ()
    assert _context.call_stack() == []


# ---------------------------------------------------------------------------------------------
# intercept and selectors


@modes
def test_intercept_sees_every_call_site_with_paths(framework: Framework, mode: str) -> None:
    rec = keys()
    with hx.intercept(rec):
        close(framework.forward(mode)(X), out(h1(X)))
    lin = framework.linear.__name__
    assert rec.seen == [
        (framework.root, framework.module_type.__name__),
        (framework.keys[0], lin),
        (framework.keys[1], lin),
    ]


@modes
def test_intercept_changes_output_and_keys_the_cache(
    framework: Framework, mode: str, traces: Any
) -> None:
    f = framework.forward(mode, traces)
    close(f(X), out(h1(X)))
    with hx.intercept(double, where=framework.linear):
        close(f(X), 2 * out(2 * h1(X)))
    close(f(X), out(h1(X)))
    with hx.intercept(double, where=framework.linear):
        close(f(X), 2 * out(2 * h1(X)))
    assert traces.n == (2 if mode == "jit" else 4)


@modes
def test_path_glob_and_callable_selectors(framework: Framework, mode: str) -> None:
    f = framework.forward(mode)
    with hx.intercept(double, where=framework.keys[0]):
        close(f(X), out(2 * h1(X)))
    with hx.intercept(double, where=lambda ctx: ctx.key == framework.keys[1]):
        close(f(X), 2 * out(h1(X)))
    glob = framework.keys[0][:-1] + "*"  # "layers/*" or "layers_*"
    with hx.intercept(double, where=hx.Select(paths=glob) & ~hx.Select(paths=framework.keys[1])):
        close(f(X), out(2 * h1(X)))
    # nesting: the first-entered interceptor is the outermost
    order: list[str] = []

    def tag(name: str) -> Any:
        def icpt(next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
            order.append(name)
            return next_fun(*args, **kwargs)

        return icpt

    where = framework.keys[1]
    with hx.intercept(tag("outer"), where=where), hx.intercept(tag("inner"), where=where):
        f(X)
    assert order == ["outer", "inner"]


# ---------------------------------------------------------------------------------------------
# scoped hooks


@modes
def test_forward_and_pre_hooks(framework: Framework, mode: str, traces: Any) -> None:
    f = framework.forward(mode, traces)
    with hx.hooks(where=framework.keys[0], forward=plus_one):
        close(f(X), out(h1(X) + 1))
    with hx.hooks(where=framework.keys[1], forward_pre=ones_in):
        close(f(X), jnp.ones(4) @ W2 + B2)
    close(f(X), out(h1(X)))
    with hx.hooks(where=framework.keys[0], forward=plus_one):
        close(f(X), out(h1(X) + 1))
    assert traces.n == (3 if mode == "jit" else 4)
    seen: list[Any] = []

    def hook(m: Any, args: tuple, kwargs: dict, output: Any) -> None:
        seen.append((args[0].shape, output.shape, tuple(kwargs)))

    with hx.hooks(where=framework.linear, forward=hook, with_kwargs=True):
        f(X)
    assert seen == [((3,), (4,), ()), ((4,), (2,), ())]


@modes
def test_backward_hooks_and_hook_grad(framework: Framework, mode: str) -> None:
    plain = framework.grad_x(mode)
    seen: list[Any] = []

    def record(m: Any, grad_input: tuple, grad_output: tuple) -> None:
        seen.append((type(m), grad_input[0].shape, grad_output[0].shape))

    with hx.hooks(where=framework.keys[1], backward_pre=triple, backward=record):
        close(framework.grad_x(mode), 3 * plain)
    assert seen == [(framework.linear, (4,), (2,))]
    with hx.hooks(where=framework.keys[0], forward=twice_grad):
        close(framework.grad_x(mode), 2 * plain)


def test_register_hooks(framework: Framework) -> None:
    hook = plus_one
    if framework.name == "nnx":
        with hx.register_forward_hook(framework.state, hook, where=framework.keys[0]):
            close(framework.forward("eager")(X), out(h1(X) + 1))
        return
    model = {"equinox": framework.state, "haiku": HAIKU}.get(framework.name, LinenMLP())
    kind = {"equinox": "Equinox", "haiku": "Haiku"}.get(framework.name, "Flax Linen")
    for register in (hx.register_forward_hook, hx.register_full_backward_hook):
        with pytest.raises(hx.HookaxError, match=rf"{kind} modules are .*hx\.hooks\("):
            register(model, hook)


def test_errors_propagate_with_a_note_and_nothing_stays(framework: Framework) -> None:
    class Boom(Exception):
        pass

    def bad(m: Any, args: tuple, output: Any) -> Any:
        raise Boom("no")

    with pytest.raises(Boom) as info, hx.hooks(where=framework.keys[1], forward=bad):
        framework.forward("eager")(X)
    assert any(framework.keys[1] in n for n in info.value.__notes__)


# ---------------------------------------------------------------------------------------------
# capture, value_and_grad, summary


@modes
def test_capture(framework: Framework, mode: str, traces: Any) -> None:
    def run(state: Any, x: jax.Array) -> Any:
        traces()
        return hx.capture(framework.apply, where=framework.linear)(state, x)

    fn = run if mode == "eager" else framework.jit(run)
    for _ in range(2):
        y, acts = fn(framework.state, X)
        close(y, out(h1(X)))
        assert list(acts) == list(framework.keys)
        close(acts[framework.keys[0]][0], h1(X))
        close(acts[framework.keys[1]][0], out(h1(X)))
        assert [len(v) for v in acts.values()] == [1, 1]
    assert traces.n == (1 if mode == "jit" else 2)


def test_capture_under_vmap_and_after_hooks(framework: Framework) -> None:
    xs = jnp.stack([X, -X, 2 * X])
    y, acts = jax.vmap(hx.capture(framework.apply), in_axes=(None, 0))(framework.state, xs)
    close(y, jax.vmap(lambda x: out(h1(x)))(xs))
    assert list(acts) == [framework.root, *framework.keys]
    close(acts[framework.keys[0]][0], jax.vmap(h1)(xs))
    # outputs are captured after forward hooks ran
    with hx.hooks(where=framework.keys[0], forward=plus_one):
        _, acts = hx.capture(framework.apply)(framework.state, X)
    close(acts[framework.keys[0]][0], h1(X) + 1)


@modes
def test_value_and_grad(framework: Framework, mode: str) -> None:
    def run(state: Any, x: jax.Array) -> Any:
        return hx.value_and_grad(framework.loss, where=framework.linear)(state, x)

    fn = run if mode == "eager" else framework.jit(run)
    loss, grads, act_grads = fn(framework.state, X)
    y = out(h1(X))
    close(loss, jnp.sum(y**2))
    close(act_grads[framework.keys[1]][0], 2 * y)
    close(act_grads[framework.keys[0]][0], (W2 @ (2 * y)) * (h1(X) > 0).astype(jnp.float32))
    if framework.name == "nnx":
        own_loss, own = nnx.value_and_grad(framework.loss)(framework.state, X)
    elif framework.name == "equinox":
        own_loss, own = eqx.filter_value_and_grad(framework.loss)(framework.state, X)
        assert isinstance(grads, EqxMLP)
    else:
        own_loss, own = jax.value_and_grad(framework.loss)(framework.state, X)
    close(own_loss, loss)
    assert jax.tree.structure(grads) == jax.tree.structure(own)
    jax.tree.map(close, grads, own)


def test_summary(framework: Framework) -> None:
    model = {"linen": LinenMLP(), "haiku": HAIKU}.get(framework.name, framework.state)
    s = hx.summary(model, jax.ShapeDtypeStruct((3,), jnp.float32))
    # Haiku's first row is the function given to hk.transform, its outermost module the second
    lead = [("", "haiku_forward", 26, ("f32[2]",))] if framework.name == "haiku" else []
    mlp = framework.module_type.__name__
    lin = framework.linear.__name__
    assert [(r.key, r.type, r.params, r.outputs) for r in s.rows] == [
        *lead,
        (framework.root, mlp, 26, ("f32[2]",)),
        (framework.keys[0], lin, 16, ("f32[4]",)),
        (framework.keys[1], lin, 10, ("f32[2]",)),
    ]
    assert [r.depth for r in s.rows[len(lead) :]] == [len(lead), len(lead) + 1, len(lead) + 1]
    assert (s.totals.params, s.totals.param_bytes) == (26, 104)
    # XLA's FLOP count of the same computation, whichever framework wrote it.
    flops = [_reference_flops()] * (len(lead) + 1)
    assert [r.flops for r in s.rows] == [*flops, 28, 18]
    assert "26" in str(s)


def _reference_flops() -> int | None:
    lowered = jax.jit(lambda x: out(h1(x))).lower(X)
    cost = lowered.cost_analysis()
    return round(cost["flops"]) if cost else None
