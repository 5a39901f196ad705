"""Registered hooks are part of every jit cache key, closures included; and a process that
leaves hooks registered exits cleanly."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context

X = jnp.array([[1.0, -2.0]])


def two_layers() -> nnx.Sequential:
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs))


def double(module: Any, args: Any, out: Any) -> Any:
    return out * 2


def quadruple(module: Any, args: Any, out: Any) -> Any:
    return out * 4


def _forms(model: nnx.Module, traced: Callable[[], None]) -> dict[str, Callable[[Any], Any]]:
    """Each way a user calls the model, as ``run(x)``; ``traced()`` runs once per trace."""

    def body(x: Any) -> Any:
        traced()
        return model(x)

    def with_model(m: Any, x: Any) -> Any:
        traced()
        return m(x)

    by_arg = jax.jit(with_model)
    return {
        "eager": body,
        "jax.jit(model, x)": lambda x: by_arg(model, x),
        "jax.jit closure": jax.jit(body),
        "nnx.jit closure": nnx.jit(body),
        "eqx.filter_jit closure": eqx.filter_jit(body),
    }


FORMS = list(_forms(nnx.Linear(1, 1, rngs=nnx.Rngs(0)), lambda: None))


def _hooked() -> set[int]:
    """The live modules the registry key holds hooks of."""
    value = _context.REGISTERED.value
    if value is None:
        return set()
    return {id(m) for held in value.held if (m := held.module()) is not None}


@pytest.fixture(autouse=True)
def _no_collection_midway():
    """The registry key names every live module holding hooks, so a hooked module of an earlier
    test that the garbage collector frees in the middle of a test changes the key (one more
    trace, correctly). Collected first, and not during the test, so counts are this test's."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    # Modules of other tests in this process may still hold hooks, and leave the key whenever
    # JAX's caches drop them: check that this test added no hooked module.
    before = _hooked()
    yield
    assert _context.active_entries() == ()
    assert _context.call_stack() == []
    assert _hooked() <= before


@pytest.mark.parametrize("form", FORMS)
def test_registering_and_removing_a_hook_retraces_a_closure(form, traces):
    model = two_layers()
    run = _forms(model, traces)[form]
    eager = form == "eager"
    plain = run(X)
    run(X)
    assert traces.n == (2 if eager else 1)  # nothing changed: no retrace

    h = hx.register_forward_hook(model, double, where="layers/1")
    np.testing.assert_array_equal(run(X), 2 * plain)  # the hook applies: retraced
    np.testing.assert_array_equal(run(X), 2 * plain)
    assert traces.n == (4 if eager else 2)

    h.remove()
    np.testing.assert_array_equal(run(X), plain)  # not applied: the first trace again
    np.testing.assert_array_equal(run(X), plain)
    assert traces.n == (6 if eager else 2)

    with hx.register_forward_hook(model, quadruple, where="layers/1"):
        np.testing.assert_array_equal(run(X), 4 * plain)
        np.testing.assert_array_equal(run(X), 4 * plain)
    assert traces.n == (8 if eager else 3)
    np.testing.assert_array_equal(run(X), plain)
    assert traces.n == (9 if eager else 3)


@pytest.mark.parametrize("form", FORMS)
def test_remove_hooks_and_pre_hooks_retrace_a_closure(form, traces):
    model = two_layers()
    run = _forms(model, traces)[form]
    plain = run(X)
    zeros = model(jnp.zeros_like(X))
    hx.register_forward_pre_hook(model, lambda m, args: jnp.zeros_like(args[0]))
    np.testing.assert_array_equal(run(X), zeros)
    hx.remove_hooks(model)
    np.testing.assert_array_equal(run(X), plain)
    assert traces.n == (3 if form == "eager" else 2)


@pytest.mark.parametrize("form", ["jax.jit closure", "nnx.jit closure"])
def test_a_hook_on_a_submodule_registered_after_the_trace_applies(form, traces):
    """The repro of the bug: the hook is on a layer the closure reaches through the model."""
    model = two_layers()
    run = _forms(model, traces)[form]
    run(X)
    seen: list[tuple[int, ...]] = []
    with hx.register_forward_hook(model.layers[0], lambda m, a, out: seen.append(out.shape)):
        run(X)
    assert seen == [(1, 3)]
    assert traces.n == 2


def test_the_key_is_value_stable_and_weak(traces):
    """Equal hooks on the same module give an equal key (the same jitted trace, eagerly the same
    compiled operations); a removed hook is not kept alive by it."""
    model = two_layers()
    before = _context.REGISTERED.value
    h = hx.register_forward_hook(model, double)
    key = _context.REGISTERED.value
    assert key != before
    hs = vars(model)["_hookax_hooks"]
    h.remove()
    assert _context.REGISTERED.value == before
    h = hx.register_forward_hook(model, double)
    assert _context.REGISTERED.value == key  # the first hook set is still alive (hs)
    h.remove()
    del hs
    h = hx.register_forward_hook(model, double)
    assert _context.REGISTERED.value != key  # it died: equal to nothing
    h.remove()


def test_a_hook_removing_itself_under_a_jitted_closure(traces):
    """Removed while the closure traces: this trace runs it, the next call retraces without."""
    model = two_layers()
    plain = model(X)
    handle: list[Any] = []

    def once(module: Any, args: Any, out: Any) -> Any:
        handle[0].remove()
        return out * 2

    handle.append(hx.register_forward_hook(model, once))
    run = _forms(model, traces)["jax.jit closure"]
    np.testing.assert_array_equal(run(X), 2 * plain)
    np.testing.assert_array_equal(run(X), plain)
    np.testing.assert_array_equal(run(X), plain)
    assert traces.n == 2


def test_exit_with_hooks_registered_is_silent():
    code = textwrap.dedent(
        """
        import jax.numpy as jnp
        from flax import nnx
        import hookax as hx
        rngs = nnx.Rngs(0)
        model = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.relu, nnx.Linear(8, 2, rngs=rngs))
        hx.register_forward_hook(model, lambda m, args, out: print(out.shape), where=nnx.Linear)
        hx.register_forward_pre_hook(model.layers[0], lambda m, args: None)
        model(jnp.ones((3, 4)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "(3, 8)\n(3, 2)\n"
    assert done.stderr == ""
