"""Threads: interceptors, scoped hooks and captures are per thread, even through one jit cache.

Sixteen threads run the same model at once, through one shared ``jax.jit`` function and eagerly:
half with their own interceptor or scoped hook (each scaling a different layer by a factor of its
own), half unhooked. Every thread gets its own correct result, every interceptor only ever runs on
its own thread, and afterwards nothing is registered or active anywhere.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import hookax as hx
from tests.models import MLP
from tests.reliability_helpers import assert_clean

X = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)
THREADS = 16
ROUNDS = 4


def scaler(k: float, log: list[int]) -> Any:
    def interceptor(next_fun, args, kwargs, ctx):
        log.append(threading.get_ident())
        return next_fun(*args, **kwargs) * k

    return interceptor


def test_threads_see_only_their_own_interceptors_and_hooks():
    model = MLP()
    fwd = jax.jit(lambda x: model(x))  # one jit cache shared by every thread

    def expected(i: int) -> jax.Array:
        """What thread ``i`` must get, computed layer by layer on the main thread."""
        h = X
        for j, layer in enumerate(model.layers):
            h = layer(h)
            if i % 4 != 3 and j == i % 3:
                h = h * float(i + 2)
            if j < 2:
                h = jax.nn.relu(h)
        return h

    want = [expected(i) for i in range(THREADS)]
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []
    logs: list[list[int]] = [[] for _ in range(THREADS)]
    results: list[list[jax.Array]] = [[] for _ in range(THREADS)]
    idents = [0] * THREADS

    def work(i: int) -> None:
        try:
            idents[i] = threading.get_ident()
            barrier.wait()
            for r in range(ROUNDS):
                f = fwd if r % 2 else model
                where = f"layers/{i % 3}"
                k = float(i + 2)
                if i % 4 == 3:  # unhooked
                    results[i].append(f(X))
                elif i % 4 == 0:  # scoped hook
                    log = logs[i]

                    def hook(m, a, out, k=k, log=log):
                        log.append(threading.get_ident())
                        return out * k

                    with hx.hooks(where=where, forward=hook):
                        results[i].append(f(X))
                else:  # interceptor
                    with hx.intercept(scaler(k, logs[i]), where=where):
                        results[i].append(f(X))
                assert_clean()
        except BaseException as e:  # reported on the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(THREADS):
        assert len(results[i]) == ROUNDS
        for r, y in enumerate(results[i]):
            np.testing.assert_allclose(y, want[i], rtol=1e-6, err_msg=f"thread {i} round {r}")
        # Its hook ran on its own thread only: eagerly every round, and while tracing its jit.
        assert set(logs[i]) <= {idents[i]}
        if i % 4 != 3:
            assert len(logs[i]) >= ROUNDS // 2
    assert_clean(model)
    np.testing.assert_array_equal(fwd(X), model(X))


def test_hooks_registered_from_many_threads_on_one_module_are_all_kept():
    from flax import nnx

    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    per_thread, threads = 50, 8
    handles: list[Any] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def work() -> None:
        start.wait()
        mine = [hx.register_forward_hook(model, lambda m, a, o: o + 1.0) for _ in range(per_thread)]
        with lock:
            handles.extend(mine)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    # Threads switch as often as possible, so races show: without the lock in hookax._hooks.hooks
    # this test fails every time.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    x = jnp.zeros((1, 3))
    np.testing.assert_allclose(
        model(x) - nnx.Linear(3, 3, rngs=nnx.Rngs(0))(x), threads * per_thread
    )
    half = handles[::2]
    removers = [
        threading.Thread(target=lambda hs=hs: [h.remove() for h in hs])
        for hs in (half[:100], half[100:])
    ]
    for w in removers:
        w.start()
    for w in removers:
        w.join()
    np.testing.assert_allclose(
        model(x) - nnx.Linear(3, 3, rngs=nnx.Rngs(0))(x), threads * per_thread / 2
    )
    hx.remove_hooks(model)
    assert_clean()
