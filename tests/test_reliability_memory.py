"""Memory: registering, removing and capturing in a loop does not grow memory, and a removed
hook's closure is freed.

Measured with ``tracemalloc`` (Python allocations) and ``sys.getallocatedblocks`` (every live
Python object block), after a warm-up that fills JAX's and hookax's caches. A jitted function's
cache keeps the hooks it was traced with (they are in its cache key): that is JAX's cache, and
``jax.clear_caches()`` frees them.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import hookax as hx
from hookax._engine import context as _context
from tests.models import MLP
from tests.reliability_helpers import assert_clean

X = jnp.ones((2, 3))


class Big:
    """Stands for what a hook's closure might hold (an activation buffer, a logger)."""


def closure() -> tuple[Callable[..., Any], weakref.ref[Big]]:
    big = Big()

    def hook(module, args, out):
        assert big is not None
        return None

    return hook, weakref.ref(big)


def growth(fn: Callable[[], None], warmup: Callable[[], None] | None = None) -> tuple[int, int]:
    """(tracemalloc bytes, allocated blocks) still held after ``fn()`` and a collection.

    With ``warmup``, tracemalloc runs from before it: bounded caches (JAX's, Flax's) that replace
    entries as they go are then traced on both sides, so their churn does not look like growth.
    Without it, only the live block count is measured (tracemalloc slows Python 5x).
    """
    if warmup is not None:
        tracemalloc.start()
        warmup()
    try:
        gc.collect()
        b0, m0 = sys.getallocatedblocks(), tracemalloc.get_traced_memory()[0]
        fn()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - m0, sys.getallocatedblocks() - b0
    finally:
        if warmup is not None:
            tracemalloc.stop()


def test_register_and_remove_10000_times_does_not_grow():
    model = MLP()
    layer = model.layers[0]

    def hook(module, args, out):
        return None

    def loop(n: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(n):
                h = hx.register_forward_hook(layer, hook, prepend=bool(i % 2))
                with hx.register_forward_pre_hook(layer, lambda m, a: None):
                    pass
                h.remove()

        return run

    loop(200)()
    # 10,000 rounds counted by live blocks, and 1,000 in bytes too.
    _, blocks = growth(loop(10_000))
    mem, blocks_traced = growth(loop(1_000), warmup=loop(100))
    assert blocks < 100, blocks
    assert blocks_traced < 100, blocks_traced
    assert mem < 16 * 1024, mem
    assert id(layer) not in _context.HOOKED
    assert_clean(model)


def loss(m: Any, x: jax.Array) -> jax.Array:
    return m(x).sum()


def test_capturing_in_a_loop_does_not_grow():
    model = MLP()
    fwd = jax.jit(hx.capture(model))
    vag = nnx.jit(hx.value_and_grad(loss))

    def loop(n: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                hx.capture(model)(X)
                fwd(X)
                vag(model, X)

        return run

    loop(50)()
    # Measured, in successive windows of 100 rounds after the warm-up (Python 3.12): 11, 5, 3, 2,
    # 1 KiB and 1655, 10989, 110, 60, 1 live blocks: bounded caches (Flax's graph caches, JAX's)
    # fill and settle at their own pace, so one window may exceed the bound. A leak grows in every
    # window: one leaked array per round adds over 200 live blocks and 140 KiB to each (measured).
    # So the bound must hold in one of up to five successive windows.
    windows = []
    tracemalloc.start()
    try:
        loop(150)()
        for _ in range(5):
            mem, blocks = growth(loop(100))
            windows.append((mem, blocks))
            if mem < 32 * 1024 and blocks < 100:
                break
        else:
            raise AssertionError(f"grew in every window of 100 rounds (bytes, blocks): {windows}")
    finally:
        tracemalloc.stop()
    assert_clean(model)


def test_a_removed_hooks_closure_is_freed_eagerly():
    model = MLP()
    hook, ref = closure()
    h = hx.register_forward_hook(model, hook, where="layers/0")
    model(X)
    h.remove()
    del hook, h
    gc.collect()
    assert ref() is None
    assert_clean(model)


def test_a_removed_hooks_closure_is_freed_once_jit_caches_are_cleared():
    model = MLP()
    hook, ref = closure()
    h = hx.register_forward_hook(model, hook, where="layers/0")
    jax.jit(lambda x: model(x))(X)
    nnx.jit(lambda m, x: m(x))(model, X)
    h.remove()
    del hook, h
    gc.collect()
    assert ref() is not None  # held by JAX's jit caches: the hooks are part of their keys
    jax.clear_caches()
    gc.collect()
    assert ref() is None
    assert_clean(model)


def test_an_interceptors_closure_is_freed_after_its_block():
    """Scoped entries are in the jit and eager-dispatch cache keys: freed with those caches."""
    model = MLP()
    hook, ref = closure()

    def interceptor(next_fun, args, kwargs, ctx, hook=hook):
        return next_fun(*args, **kwargs)

    with hx.intercept(interceptor), hx.hooks(forward=hook):
        model(X)
        jax.jit(lambda x: model(x))(X)
    del hook, interceptor
    jax.clear_caches()
    gc.collect()
    assert ref() is None
    assert_clean(model)
