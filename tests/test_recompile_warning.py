"""The recompile warning: an interceptor or hook re-created over new closure values each call
(every eager operation recompiles) is named once, with the fix; normal use stays silent."""

import warnings

import jax.numpy as jnp
import pytest
from flax import nnx

import hookax as hx


def _model():
    return nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def make_steer(delta):
    def steer(next_fun, args, kwargs, ctx):
        return next_fun(*args, **kwargs) + delta

    return steer


def test_a_closure_over_a_new_array_each_call_warns_once_with_the_fix():
    model, x = _model(), jnp.ones((1, 2))
    match = r"steer.*closing over delta \(ArrayImpl\).*Fix: pass the changing value"
    with pytest.warns(hx.RecompileWarning, match=match):
        for i in range(10):
            with hx.intercept(make_steer(jnp.full((2,), float(i))), where="layers/0"):
                model(x)  # a new object every step: every operation recompiles
    # Once per function: the next steps do not warn again.
    with warnings.catch_warnings():
        warnings.simplefilter("error", hx.RecompileWarning)
        for i in range(10):
            with hx.intercept(make_steer(jnp.full((2,), float(i))), where="layers/0"):
                model(x)


def test_a_changing_value_passed_into_a_jitted_step_is_silent():
    model, x = _model(), jnp.ones((1, 2))

    @nnx.jit
    def step(model, x, delta):
        with hx.intercept(lambda nf, a, k, c: nf(*a, **k) + delta, where="layers/0"):
            return model(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error", hx.RecompileWarning)
        for i in range(12):
            step(model, x, jnp.full((2,), float(i)))


def test_normal_use_is_silent():
    model, x = _model(), jnp.ones((1, 2))
    delta = jnp.ones((2,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hx.RecompileWarning)
        for _ in range(20):
            # re-created each step over the same objects: an equal key, cached
            with hx.intercept(lambda nf, a, k, c: nf(*a, **k) + delta, where="layers/0"):
                model(x)
            with hx.hooks(forward=lambda m, a, out: out * 2.0, where="layers/0"):
                model(x)
            with hx.intercept_op(lambda v, op: v, ops="layers/0:dot_general"):
                model(x)


def test_scoped_hooks_over_new_objects_warn():
    model, x = _model(), jnp.ones((1, 2))
    with pytest.warns(hx.RecompileWarning, match="hx.hooks"):
        for i in range(10):
            scale = jnp.asarray(float(i))
            with hx.hooks(forward=(lambda s: lambda m, a, out: out * s)(scale), where="layers/0"):
                model(x)


def test_hooks_made_inside_each_trace_are_silent():
    """A hook created inside a jitted function over its traced arguments, traced again for
    each value of a static argument (one compile each, as docs/patching.md's old recipe did):
    each trace is a compile anyway, so nothing is reported."""
    model, x = _model(), jnp.ones((1, 2))

    def scale(s):  # its own code object: the warning is once per function
        def interceptor(next_fun, args, kwargs, ctx):
            return next_fun(*args, **kwargs) * s

        return interceptor

    @nnx.jit(static_argnames="k")
    def f(model, x, v, k):
        with hx.intercept(scale(v * k), where="layers/0"):
            return model(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error", hx.RecompileWarning)
        for k in range(12):
            f(model, x, jnp.ones((2,)), k=k)


def test_hooks_made_inside_each_trace_over_a_dict_of_tracers_are_silent():
    model, x = _model(), jnp.ones((1, 2))

    def scale(values):  # a dict of traced values, as a patching hook holds them
        def interceptor(next_fun, args, kwargs, ctx):
            return next_fun(*args, **kwargs) * values["s"]

        return interceptor

    @nnx.jit(static_argnames="k")
    def f(model, x, v, k):
        with hx.intercept(scale({"s": v * k}), where="layers/0"):
            return model(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error", hx.RecompileWarning)
        for k in range(12):
            f(model, x, jnp.ones((2,)), k=k)
