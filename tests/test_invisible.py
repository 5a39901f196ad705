"""hookax is invisible to code that does not use it: no leaks, no races, no cost.

* Leaks: a call site's frame and context form no reference cycle, so nothing the call touched
  (modules, variables, tracers) waits for the cycle collector; checked as Linen's own
  ``LeakTests::test_tracer_leaks`` does (``jax.checking_leaks()`` with ``gc.collect`` disabled).
* Install race: installing the Linen support while another thread is inside
  ``nn.intercept_methods`` keeps that thread's interceptors.
* Import order: the Linen support is installed whether hookax or ``flax.linen`` comes first.
* Cost: Linen's own interceptors stay out of the jit cache key unless the user opts in, so an
  interceptor closing over a fresh dict each step costs nothing and is not kept alive.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import module as linen_module

import hookax as hx
from hookax._engine import context as _context
from hookax.frameworks import _linen

ROOT = Path(__file__).resolve().parent.parent


def noop(next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: Any) -> Any:
    return next_fun(*args, **kwargs)


def noop_hook(module: Any, args: tuple, output: Any) -> None:
    return None


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """A no-op interceptor and a no-op scoped hook, both active: every dispatcher path runs."""
    with hx.intercept(noop), hx.hooks(forward=noop_hook):
        yield


def no_cycle_collector() -> Any:
    """As Linen's leak test: the leak checker's own gc.collect() does nothing."""
    return patch.object(gc, "collect", return_value=0)


# ---------------------------------------------------------------------------------------------
# 1. No reference cycle: nothing leaks past the call


def test_linen_tracer_leaks_with_a_scope_active() -> None:
    model = nn.Sequential([nn.Dense(8)])

    @jax.jit
    @functools.partial(jax.vmap, in_axes=(0, None))
    def sample_from_prior(rng: jax.Array, inp: np.ndarray) -> jax.Array:
        params = model.init(rng, np.zeros((3, 8), np.float32))
        return model.apply(params, inp)

    with scope(), no_cycle_collector(), jax.checking_leaks():
        for _ in range(2):
            rngs = jax.random.split(jax.random.key(23), 4)
            out = sample_from_prior(rngs, np.ones((2, 8), np.float32))
            out.block_until_ready()
            del out, rngs


def test_equinox_jit_vmap_no_leak_with_a_scope_active() -> None:
    @jax.jit
    @jax.vmap
    def f(key: jax.Array, x: jax.Array) -> jax.Array:
        return eqx.nn.MLP(4, 4, 4, 1, key=key)(x)

    with scope(), no_cycle_collector(), jax.checking_leaks():
        for _ in range(2):
            f(jax.random.split(jax.random.key(0), 3), jnp.ones((3, 4))).block_until_ready()


def test_nnx_jit_vmap_no_leak_with_a_scope_active() -> None:
    @jax.jit
    @jax.vmap
    def f(key: jax.Array, x: jax.Array) -> jax.Array:
        rngs = nnx.Rngs(key)
        return nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs))(x)

    with scope(), no_cycle_collector(), jax.checking_leaks():
        for _ in range(2):
            f(jax.random.split(jax.random.key(0), 3), jnp.ones((3, 4))).block_until_ready()


def test_call_site_frame_is_freed_without_the_cycle_collector() -> None:
    """A context kept by an interceptor is fine; the frame and module die with their refs."""
    kept: list[hx.Context] = []

    def keep(next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
        kept.append(ctx)
        return next_fun(*args, **kwargs)

    class Id(eqx.Module):
        def __call__(self, x: jax.Array) -> jax.Array:
            return x

    model = Id()
    gc.disable()
    try:
        with hx.intercept(keep):
            model(jnp.ones(2))
        assert kept[0].method == "__call__"  # still readable after the call
        module = weakref.ref(kept[0].module)
        del model
        kept.clear()
        assert module() is None  # freed by reference counting alone
    finally:
        gc.enable()


# ---------------------------------------------------------------------------------------------
# 2. Installing while another thread is inside nn.intercept_methods


@pytest.fixture
def uninstalled_linen_stack() -> Iterator[Any]:
    """Linen's interceptor stack as Linen made it; hookax's class restored afterwards."""
    stack = linen_module._global_interceptor_stack
    assert type(stack) is _linen._Stack
    stack.__class__ = linen_module.ThreadLocalStack
    try:
        yield stack
    finally:
        stack.__class__ = _linen._Stack


def test_install_keeps_other_threads_interceptors(uninstalled_linen_stack: Any) -> None:
    inside, installed = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def add_one(next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        return next_fun(*args, **kwargs) + 1

    model = nn.Dense(2, kernel_init=nn.initializers.ones)
    x = jnp.ones((1, 3))
    params = model.init(jax.random.key(0), x)

    def other() -> None:
        try:
            with nn.intercept_methods(add_one):
                inside.set()
                assert installed.wait(30)
                seen["out"] = model.apply(params, x)
                with hx.intercept(noop):  # hookax's dispatcher works in this thread too
                    seen["both"] = model.apply(params, x)
        except BaseException as e:  # an IndexError from pop() was the symptom
            seen["error"] = e

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(30)
    _linen.install()  # what `import hookax` or the first hookax call does
    installed.set()
    t.join(30)
    assert "error" not in seen, seen.get("error")
    np.testing.assert_array_equal(seen["out"], jnp.full((1, 2), 4.0))
    np.testing.assert_array_equal(seen["both"], jnp.full((1, 2), 4.0))
    assert type(linen_module._global_interceptor_stack) is _linen._Stack
    assert len(linen_module._global_interceptor_stack) == 0


# ---------------------------------------------------------------------------------------------
# 3. Import order


def run_python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


IMPORT_ORDER = """
    import sys, warnings
    {first}
    {second}
    import jax, jax.numpy as jnp
    from flax.linen import module as linen_module
    print(type(linen_module._global_interceptor_stack).__name__, "flax" in sys.modules)
    model = nn.Dense(2)
    x = jnp.ones((1, 3))
    params = model.init(jax.random.key(0), x)
    zero = lambda next_fun, args, kwargs, ctx: jnp.zeros((1, 2))

    def check():
        traces = []
        f = jax.jit(lambda p, x: (traces.append(1), model.apply(p, x))[1])
        f(params, x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with nn.intercept_methods(zero):
                out = f(params, x)
        keyed = hx.key_linen_interceptors()
        hx.key_linen_interceptors(keyed)
        print(keyed, len(traces), float(out.sum()) == 0.0, [w.category.__name__ for w in caught])

    check()
    hx.key_linen_interceptors(not hx.key_linen_interceptors())
    check()
"""


@pytest.mark.parametrize("hookax_first", [True, False], ids=["hookax-first", "flax-first"])
def test_import_order_does_not_matter(hookax_first: bool) -> None:
    """Installed either way; keyed (opted in before or after flax.linen) or as in Linen."""
    if hookax_first:  # opt in before flax.linen is imported, then opt out
        first = "import hookax as hx; hx.key_linen_interceptors()"
        second = "import flax.linen as nn"
    else:  # Linen's behaviour first, then opt in
        first, second = "import flax.linen as nn", "import hookax as hx"
    lines = run_python(IMPORT_ORDER.format(first=first, second=second)).splitlines()
    keyed = "True 2 True []"  # the block retraces, intercepted
    unkeyed = "False 1 False ['StaleTraceWarning']"  # Linen reuses the trace; hookax warns
    assert lines == ["_Stack True", *((keyed, unkeyed) if hookax_first else (unkeyed, keyed))]


# ---------------------------------------------------------------------------------------------
# 4. Unmodified Linen code: an interceptor over a fresh dict each step costs nothing


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(3):
            x = jax.nn.relu(nn.Dense(4)(x))
        return x


@pytest.fixture
def linen_mlp() -> tuple[Any, Any, jax.Array]:
    model, x = MLP(), jnp.ones((2, 4))
    return model, model.init(jax.random.key(0), x), x


class Acts(dict):
    """One step's activations (a dict that can be weakly referenced)."""


def collector(acts: dict) -> Callable[..., Any]:
    """The common Linen pattern: record each call's output into this step's dict."""

    def record(next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        out = next_fun(*args, **kwargs)
        acts.setdefault(ctx.module.path, []).append(out)
        return out

    return record


class Compiles:
    """Counts XLA compilations (eager operations and jitted functions alike)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1


@pytest.fixture
def compiles() -> Iterator[Compiles]:
    c = Compiles()
    jax.monitoring.register_event_duration_secs_listener(c)
    try:
        yield c
    finally:
        jax.monitoring.unregister_event_duration_listener(c)


def test_fresh_dict_interceptor_eager_costs_no_compile_and_is_freed(
    linen_mlp: Any, compiles: Compiles
) -> None:
    model, params, x = linen_mlp
    refs = []
    for step in range(4):
        if step == 1:
            n = compiles.n  # step 0 compiled what a plain forward compiles
        acts = Acts()
        with nn.intercept_methods(collector(acts)):
            assert _context.active_entries() == ()  # the jit cache key is untouched
            model.apply(params, x)
        assert len(acts) == 4  # the root and its 3 Dense layers, every step
        refs.append(weakref.ref(acts))
        del acts
    assert compiles.n == n  # no recompile per step
    assert all(r() is None for r in refs)  # nothing kept the steps' dicts alive


def test_fresh_dict_interceptor_under_jit_traces_once_and_is_freed(
    linen_mlp: Any, traces: Any, fresh_warnings: None
) -> None:
    model, params, x = linen_mlp
    forward = jax.jit(lambda p, x: (traces(), model.apply(p, x))[1])
    refs = []
    with pytest.warns(hx.StaleTraceWarning):  # steps 2 and 3 reuse step 1's trace
        for _ in range(3):
            acts = Acts()
            with nn.intercept_methods(collector(acts)):
                forward(params, x)
            refs.append(weakref.ref(acts))
            del acts
    assert traces.n == 1  # as in Linen: one trace, reused
    assert all(r() is None for r in refs)


def test_fresh_dict_collected_inside_jit_works_as_in_linen(linen_mlp: Any, traces: Any) -> None:
    """The block entered inside the jitted step: the idiomatic form, no warning, one trace."""
    model, params, x = linen_mlp

    @jax.jit
    def step(p: Any, x: jax.Array) -> tuple[jax.Array, dict]:
        traces()
        acts = Acts()
        with nn.intercept_methods(collector(acts)):
            y = model.apply(p, x)
        return y, {"/".join(k): v for k, v in acts.items()}

    for _ in range(3):
        _, acts = step(params, x)
    assert traces.n == 1
    assert sorted(acts) == ["", "Dense_0", "Dense_1", "Dense_2"]


# ---------------------------------------------------------------------------------------------
# The stale-reuse warning, and the opt-in to cache keys


@pytest.fixture
def fresh_warnings() -> Iterator[None]:
    saved = set(_linen._WARNED)
    _linen._WARNED.clear()
    try:
        yield
    finally:
        _linen._WARNED.clear()
        _linen._WARNED.update(saved)


def test_stale_reuse_warns_once_naming_the_fix(linen_mlp: Any, fresh_warnings: None) -> None:
    model, params, x = linen_mlp
    forward = jax.jit(model.apply)
    forward(params, x)
    stale = r"collector.<locals>.record.*key_linen_inter"
    with pytest.warns(hx.StaleTraceWarning, match=stale) as caught:  # noqa: SIM117
        with nn.intercept_methods(collector({})):
            forward(params, x)  # the trace made without the interceptor is reused
    assert caught[0].filename == __file__  # points at the user's `with` block
    with nn.intercept_methods(collector({})):  # once per interceptor function
        forward(params, x)


def test_no_warning_when_the_interceptor_ran_or_the_block_raised(
    linen_mlp: Any, fresh_warnings: None
) -> None:
    model, params, x = linen_mlp
    with nn.intercept_methods(noop):
        model.apply(params, x)
    with pytest.raises(ZeroDivisionError), nn.intercept_methods(noop):
        1 / 0  # noqa: B018
    assert not _linen._WARNED


@pytest.fixture
def keyed() -> Iterator[None]:
    previous = hx.key_linen_interceptors(True)
    try:
        yield
    finally:
        hx.key_linen_interceptors(previous)


def test_opt_in_makes_linen_interceptors_cache_keyed(
    linen_mlp: Any, keyed: None, traces: Any
) -> None:
    model, params, x = linen_mlp
    forward = jax.jit(lambda p, x: (traces(), model.apply(p, x))[1])
    plain = forward(params, x)

    def zero(next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        return jnp.zeros_like(next_fun(*args, **kwargs))

    with nn.intercept_methods(zero):
        np.testing.assert_array_equal(forward(params, x), jnp.zeros((2, 4)))
    np.testing.assert_array_equal(forward(params, x), plain)
    with nn.intercept_methods(zero):  # the same interceptor: the cached trace
        forward(params, x)
    assert traces.n == 2
    # The documented cost of opting in: a fresh dict each step is a new key, a new trace.
    for _ in range(2):
        acts = Acts()
        with nn.intercept_methods(collector(acts)):
            forward(params, x)
        assert len(acts) == 4
    assert traces.n == 4
    assert _context.active_entries() == ()
