"""Eager code compiles once, whatever hookax has active (:mod:`hookax._engine.eager`).

JAX compiles each operation run outside a trace, and each ``jax.jit`` function met there, once
per value of its trace context, which holds hookax's keys. These tests show that a new set of
entries (a new ``where=``, a registered hook, ``ops=``) compiles nothing the model already ran,
and that a ``jax.jit`` function that calls a module still gets its own program per set of
entries (hooked inside a block, plain after it).
"""

import subprocess
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import eager

from .parity.nnx_gpt import GPT, NAMES
from .test_first_call_numpy import _wait_for_background_compiles
from .test_new_data import compiles

X = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)), jnp.float32)


def _double(next_fun, args, kwargs, ctx):
    return next_fun(*args, **kwargs) * 2


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.softmax(nn.Dense(8, name="fc1")(x))
        return nn.Dense(6, name="fc2")(jnp.tanh(h))


def _nnx():
    m = nnx.Sequential(
        nnx.Linear(4, 8, rngs=nnx.Rngs(0)), jax.nn.softmax, nnx.Linear(8, 6, rngs=nnx.Rngs(1))
    )
    return m, ("layers/0", "layers/2"), lambda x: m.layers[0](x)


def _equinox():
    k1, k2 = jax.random.split(jax.random.key(0))
    fc1, fc2 = eqx.nn.Linear(4, 8, key=k1), eqx.nn.Linear(8, 6, key=k2)
    m = eqx.nn.Sequential([fc1, eqx.nn.Lambda(jax.nn.softmax), fc2])
    f = jax.vmap(jax.vmap(m))  # the usual way: the model maps one example
    return f, ("layers/0", "layers/2"), jax.vmap(jax.vmap(fc1))


def _linen():
    module = _LinenMLP()
    params = module.init(jax.random.key(0), X)
    f = lambda x: module.apply(params, x)  # noqa: E731
    fc1 = nn.Dense(8)
    return f, ("fc1", "fc2"), lambda x: fc1.apply({"params": params["params"]["fc1"]}, x)


@pytest.mark.parametrize("build", [_nnx, _equinox, _linen], ids=["nnx", "equinox", "linen"])
def test_a_new_where_compiles_nothing_the_model_ran(build):
    call, (first, second), first_alone = build()
    plain = jax.block_until_ready(call(X))
    expected = jax.block_until_ready(first_alone(X))
    hx.capture(call)(X)  # hookax's own operations on every site's shape (vmapped values moved)
    for where in (first, second, [first, second]):
        with compiles() as names:
            out, acts = hx.capture(call, where=where)(X)
            jax.block_until_ready((out, acts))
        assert names == [], f"where={where!r} compiled {names}"
        np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(hx.capture(call, where=first)(X)[1][first][0], expected)
    with compiles() as names, hx.intercept(_double, where=second):
        doubled = jax.block_until_ready(call(X))
    assert set(names) <= {"jit(multiply)"}  # the interceptor's own `* 2`, maybe never run
    np.testing.assert_allclose(doubled, 2 * plain, rtol=1e-6)
    with compiles() as names, hx.intercept(_double, where=[second]):  # another entry
        again = jax.block_until_ready(call(X))
    assert names == []
    np.testing.assert_array_equal(again, doubled)


def test_a_gpt_capture_of_every_site_compiles_nothing_new():
    m = GPT(vocab=50, n_ctx=8, d=32, heads=4, d_head=8, d_mlp=64, depth=2, rngs=nnx.Rngs(0))
    tokens = jnp.arange(8)[None] % 50
    plain = jax.block_until_ready(m(tokens))
    with compiles() as names:
        out, acts = hx.capture(m)(tokens)
        jax.block_until_ready((out, acts))
    assert names == []
    np.testing.assert_array_equal(out, plain)
    with jax.disable_jit():  # op by op, no jit function's trace reused
        _, reference = hx.capture(m)(tokens)
    assert acts.keys() == reference.keys()
    for k in acts:
        np.testing.assert_allclose(acts[k][0], reference[k][0], rtol=1e-5, atol=1e-6)
    # Names with parts: only what the plain forward never ran compiles: softmax as one
    # operation (a custom_jvp function under ops=), its traced body as one program where op
    # by op compiled each of its 8 operations, and that on a background thread (the first
    # calls run it with NumPy); a second new question compiles nothing.
    eager._BODIES.clear()
    with compiles() as names, hx.first_call("auto"):  # as a session runs it (tests: compile)
        _, named = NAMES.capture(m)(tokens)
        jax.block_until_ready(named)
        (body,) = eager._BODIES.values()
        assert body.interpreted >= 1  # the first softmax ran without waiting for XLA
        _wait_for_background_compiles()
    assert names == ["jit(softmax_body)"]
    with compiles() as names:
        pattern = NAMES.capture(m, "pattern")(tokens)[1]
        jax.block_until_ready(pattern)
    assert names == []
    with jax.disable_jit():
        expected = NAMES.capture(m, "pattern")(tokens)[1]
    for key in expected:  # XLA's softmax (now) and the op-by-op reference: float rounding
        np.testing.assert_allclose(pattern[key], expected[key], rtol=1e-6, atol=1e-7)
        # NumPy's (the first call: the softmax and operations before it new to JAX's caches)
        np.testing.assert_allclose(pattern[key], named[key], rtol=1e-5, atol=1e-6)


def test_a_registered_hook_compiles_nothing_the_model_ran():
    m, _, _ = _nnx()
    plain = jax.block_until_ready(m(X))
    seen = []
    handle = hx.register_forward_hook(m.layers[2], lambda mod, args, out: seen.append(out))
    try:
        with compiles() as names:
            out = jax.block_until_ready(m(X))
    finally:
        handle.remove()
    assert names == []
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(seen[0], plain)


def test_a_jit_function_that_calls_the_model_gets_its_own_program():
    m, _, _ = _nnx()
    traces = []

    @jax.jit
    def forward(x):
        traces.append(1)
        return m(x)

    plain = forward(X)
    with hx.intercept(_double, where="layers/2"):
        hooked = forward(X)
        again = forward(X)
    after = forward(X)
    np.testing.assert_allclose(hooked, 2 * plain, rtol=1e-6)
    np.testing.assert_allclose(again, 2 * plain, rtol=1e-6)
    np.testing.assert_array_equal(after, plain)
    assert len(traces) == 2  # plain, hooked: a function that calls a module is traced once

    @jax.jit
    def outer(x):  # calls no module itself: its inner function does
        return jnp.sin(forward(x))

    plain_outer = outer(X)
    with hx.intercept(_double, where="layers/2"):
        hooked_outer = outer(X)
        vmapped = jax.vmap(outer)(X)
    np.testing.assert_allclose(hooked_outer, jnp.sin(2 * plain), rtol=1e-6)
    np.testing.assert_allclose(vmapped, jnp.sin(2 * plain), rtol=1e-6)
    np.testing.assert_array_equal(outer(X), plain_outer)


def test_jax_numpy_reuses_its_programs_and_a_users_jit_function_is_traced_once_more():
    """``jax.numpy``'s jitted functions (and their vmapped forms) reuse the programs compiled
    with no entry active; a user's ``jax.jit`` function is traced and compiled once with the
    entries, as before (its Python may do things while traced: it is not traced twice)."""
    m, _, _ = _nnx()
    traces = []

    @jax.jit
    def scale(x):
        traces.append(1)
        return jnp.cos(x) * 3

    def numpy_side(x):
        return jnp.mean(x, axis=-1), jnp.take(x, jnp.array([0, 2]), axis=1)

    plain, mean = scale(X), numpy_side(X)
    mapped = jax.vmap(numpy_side)(X)
    unhooked = m(X)
    with hx.intercept(_double, where="layers/2"):
        m(X)  # the interceptor's own `* 2` compiles (maybe never run before)
    with compiles() as names, hx.intercept(_double, where=["layers/2"]):
        hooked = m(X)
        got_mean, got_mapped = numpy_side(X), jax.vmap(numpy_side)(X)
        out = scale(X)
    assert names == ["jit(scale)"]
    assert len(traces) == 2
    np.testing.assert_array_equal(out, plain)
    for got, want in zip(jax.tree.leaves((got_mean, got_mapped)), jax.tree.leaves((mean, mapped))):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(hooked, 2 * unhooked, rtol=1e-6)


def test_nothing_is_installed_until_hookax_is_used():
    code = (
        "import jax, jax.numpy as jnp\n"
        "from jax._src import dispatch, pjit\n"
        "def steps():\n"
        "    return (dispatch.xla_primitive_callable, pjit._infer_params,\n"
        "            pjit._pjit_call_impl_python)\n"
        "originals = steps()\n"
        "import hookax as hx\n"
        "from flax import nnx\n"
        "m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))\n"
        "m(jnp.ones(2))\n"
        "print(all(a is b for a, b in zip(originals, steps())))\n"
        "hx.capture(m)(jnp.ones(2))\n"
        "print(any(a is b for a, b in zip(originals, steps())))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split() == ["True", "False"]
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    hx.capture(m)(jnp.ones(2))  # this process uses hookax (whatever ran before in it)
    assert eager._INSTALLED


def test_stack_layers_of_eager_cpu_arrays_compiles_nothing():
    acts = {f"layers/{i}": (jnp.full((2, 5, 7), i, jnp.float32),) for i in range(3)}
    jax.block_until_ready(acts)
    with compiles() as names:
        stacked = jax.block_until_ready(hx.stack_layers(acts, "layers/*"))
    assert names == []
    np.testing.assert_array_equal(stacked, jnp.stack([acts[f"layers/{i}"][0] for i in range(3)]))
    assert stacked.sharding == acts["layers/0"][0].sharding and not stacked.weak_type
    weak = {k: (jnp.asarray(1.0),) for k in ("layers/0", "layers/1")}  # weakly typed: kept so
    assert hx.stack_layers(weak, "layers/*").weak_type
    traced = jax.jit(lambda a: hx.stack_layers(a, "layers/*"))(acts)
    np.testing.assert_array_equal(traced, stacked)
