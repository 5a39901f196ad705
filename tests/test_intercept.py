"""The interception engine: every NNX module is interceptable, under every transform."""

from __future__ import annotations

import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context

from .models import MLP, Scanned

jit_modes = pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])


def run(mode: str, model, *args):
    if mode == "eager":
        return model(*args)
    if mode == "jax.jit":
        return jax.jit(lambda m, *a: m(*a))(model, *args)
    return nnx.jit(lambda m, *a: m(*a))(model, *args)


class Recorder:
    """An interceptor that records the key of every call site it sees."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def __call__(self, next_fun, args, kwargs, context):
        self.keys.append(context.key)
        return next_fun(*args, **kwargs)


def test_issue_example_prints(capsys):
    class Foo(nnx.Module):
        def __call__(self, x):
            return x * 2

    def my_interceptor1(next_fun, args, kwargs, context):
        print("calling my_interceptor1")
        return next_fun(*args, **kwargs)

    foo = Foo()
    with hx.intercept(my_interceptor1):
        out = foo(jnp.ones([1]))
    assert capsys.readouterr().out == "calling my_interceptor1\n"
    np.testing.assert_array_equal(out, [2.0])
    assert _context.active_entries() == ()


@jit_modes
def test_library_and_user_modules_are_call_sites(mode):
    rec = Recorder()
    model = MLP()
    with hx.intercept(rec):
        run(mode, model, jnp.ones((2, 3)))
    assert rec.keys == ["", "layers/0", "layers/1", "layers/2"]


def test_class_defined_after_install_and_subclass_without_own_method():
    rec = Recorder()
    with hx.intercept(rec):
        pass  # the NNX adapter is installed by now

    class Late(nnx.Module):
        def __call__(self, x):
            return x + 1

        def encode(self, x):
            return x * 3

    class MyLinear(nnx.Linear):
        pass

    late, lin = Late(), MyLinear(2, 2, rngs=nnx.Rngs(0))
    with hx.intercept(rec):
        late(1.0)
        late.encode(1.0)
        lin(jnp.ones(2))
    assert rec.keys == ["", ":encode", ""]


def test_super_call_is_one_call_site():
    class Scaled(nnx.Linear):
        def __call__(self, x):
            return super().__call__(x) * 2

    rec = Recorder()
    m = Scaled(2, 2, rngs=nnx.Rngs(0))
    with hx.intercept(rec):
        y = m(jnp.ones(2))
    assert rec.keys == [""]
    np.testing.assert_allclose(y, 2 * (jnp.ones(2) @ m.kernel[...] + m.bias[...]))


def plain_function(x):
    return x - 1


def test_non_methods_left_alone_and_base_methods_are_not_call_sites():
    class Odd(nnx.Module):
        act = staticmethod(jax.nn.relu)
        fn_attr = plain_function  # a function-valued class attribute, not a method

        def __init__(self):
            self.items = nnx.List([])

        @staticmethod
        def s(x):
            return x + 10

        @classmethod
        def c(cls, x):
            return x + 20

        @property
        def p(self):
            return 30

        def __call__(self, x):
            self.eval()  # a method of nnx.Module itself
            self.items.append(nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
            return self.act(x) + self.s(x) + self.c(x) + self.p + Odd.fn_attr(x)

    assert "__wrapped__" not in vars(Odd.fn_attr)
    rec = Recorder()
    m = Odd()
    with hx.intercept(rec):
        out = m(jnp.float32(2.0))
    # sow, List.append, staticmethod, classmethod, property, fn_attr: none is a call site.
    assert rec.keys == [""]
    assert float(out) == 2 + 12 + 22 + 30 + 1


def test_context_fields_and_orig_method_skips_remaining_interceptors():
    seen = {}

    def outer(next_fun, args, kwargs, context):
        seen["ctx"] = context
        # orig_method skips `inner` below but still runs the method itself.
        return context.orig_method(*args, **kwargs) + 100

    def inner(next_fun, args, kwargs, context):  # pragma: no cover - must be skipped
        raise AssertionError("skipped by orig_method")

    model = MLP(depth=1)
    x = jnp.ones((1, 3))
    with hx.intercept(outer, where=nnx.Linear), hx.intercept(inner, where=nnx.Linear):
        y = model(x)
    ctx = seen["ctx"]
    assert (ctx.module, ctx.method, ctx.path, ctx.key) == (
        model.layers[0],
        "__call__",
        ("layers", 0),
        "layers/0",
    )
    with pytest.raises(AttributeError, match="immutable"):
        ctx.method = "other"
    np.testing.assert_allclose(y, model.layers[0](x) + 100)


def test_nesting_order_first_entered_is_outermost():
    order = []

    def make(name):
        def ic(next_fun, args, kwargs, context):
            order.append(f"{name}>")
            out = next_fun(*args, **kwargs)
            order.append(f"<{name}")
            return out

        return ic

    a, b = make("a"), make("b")
    with hx.intercept(a, where=nnx.Linear), hx.intercept(b, where=nnx.Linear):
        nnx.Linear(1, 1, rngs=nnx.Rngs(0))(jnp.ones(1))
    assert order == ["a>", "b>", "<b", "<a"]


class Enc(nnx.Module):
    def __init__(self):
        self.inner = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def encode(self, x):
        return self.inner(x)

    def __call__(self, x):
        return self.encode(x)


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (None, ["", ":encode", "inner"]),
        (nnx.Linear, ["inner"]),
        ((Enc, nnx.Linear), ["", ":encode", "inner"]),
        ("inner", ["inner"]),
        ("*", ["inner"]),
        ("**", ["", ":encode", "inner"]),
        (hx.Select(methods="encode"), [":encode"]),
        (hx.Select(methods="*"), ["", ":encode", "inner"]),
        (hx.Select(types=Enc, methods="__call__"), [""]),
        (hx.Select(types=Enc) & ~hx.Select(methods="encode"), [""]),
        (hx.Select(paths="inner") | hx.Select(methods="encode"), [":encode", "inner"]),
        (lambda ctx: ctx.method == "encode", [":encode"]),
    ],
)
def test_where_forms(where, expected):
    rec = Recorder()
    with hx.intercept(rec, where=where):
        Enc()(jnp.ones(2))
    assert rec.keys == expected


def test_glob_double_star_across_segments():
    rec = Recorder()
    model = Scanned()
    with hx.intercept(rec, where="**/lin"):
        model(jnp.ones((2, 3)))
    assert rec.keys == ["blocks/lin"]


@pytest.mark.parametrize("bad", [3, ["a", 3], object()])
def test_bad_selector_raises(bad):
    with pytest.raises(hx.SelectorError, match=r"where= must be None, a class.*got"):
        hx.intercept(Recorder(), where=bad)


def test_bad_select_fields_raise():
    with pytest.raises(hx.SelectorError, match=r"types=.*got 3"):
        hx.Select(types=3)
    with pytest.raises(hx.SelectorError, match=r"paths=.*got 3"):
        hx.Select(paths=3)


@jit_modes
def test_scan_and_remat_keep_outer_paths(mode):
    rec = Recorder()
    model = Scanned()
    x = jnp.ones((2, 3))
    with hx.intercept(rec):
        y = run(mode, model, x)
    assert rec.keys == ["", "blocks", "blocks/lin", "head"]
    np.testing.assert_allclose(y, model.unrolled(x), rtol=1e-6)


def double_linear(next_fun, args, kwargs, context):
    return next_fun(*args, **kwargs) * 2


@pytest.mark.parametrize("mode", ["jax.vmap", "nnx.vmap"])
def test_vmap(mode):
    model, x = MLP(depth=2), jnp.ones((5, 2, 3))
    ref = jax.vmap(lambda x: model(x))(x)
    with hx.intercept(double_linear, where=nnx.Linear):
        if mode == "jax.vmap":
            y = jax.vmap(lambda x: model(x))(x)
        else:
            y = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(model, x)
    w0, b0 = model.layers[0].kernel[...], model.layers[0].bias[...]
    w1, b1 = model.layers[1].kernel[...], model.layers[1].bias[...]
    manual = 2 * (jax.nn.relu(2 * (x @ w0 + b0)) @ w1 + b1)
    np.testing.assert_allclose(y, manual, rtol=1e-6)
    assert not np.allclose(y, ref)


@jit_modes
def test_interceptor_with_traced_gate_gets_its_gradient(mode):
    """A gate passed in from outside the model scales one layer; d loss / d gate is exact."""
    model, x = MLP(depth=2), jnp.ones((2, 3))

    def forward(m, x, gate):
        def gated(next_fun, args, kwargs, context):
            return next_fun(*args, **kwargs) * gate

        with hx.intercept(gated, where="layers/1"):
            return m(x).sum()

    if mode == "nnx.jit":  # NNX needs its own grad around nnx.jit
        g = nnx.grad(nnx.jit(forward), argnums=2)(model, x, jnp.float32(3.0))
    else:
        jit = jax.jit if mode == "jax.jit" else (lambda f: f)
        g = jax.grad(jit(forward), argnums=2)(model, x, jnp.float32(3.0))
    # The last layer is linear in the gate: d/dgate sum(gate * z) = sum(z).
    z = model(x)
    np.testing.assert_allclose(g, z.sum(), rtol=1e-5)


def test_grad_of_params_through_interceptor():
    model, x = Scanned(), jnp.ones((2, 3))

    def loss(m):
        return (m(x) ** 2).sum()

    with hx.intercept(double_linear, where="head"):
        grads = nnx.grad(loss)(model)
    # With the head doubled, d loss / d head.bias = 2 * 2 * sum over batch of the output.
    y = 2 * model.unrolled(x)  # the unrolled head output, doubled
    np.testing.assert_allclose(grads["head"]["bias"][...], (2 * 2 * y).sum(0), rtol=1e-5)


def test_jit_cache_is_keyed_by_active_interceptors(traces):
    model, x = MLP(), jnp.ones((2, 3))

    @nnx.jit
    def f(m, x):
        traces()
        return m(x)

    plain = f(model, x)
    assert traces.n == 1
    with hx.intercept(double_linear, where="layers/2"):
        hooked = f(model, x)
    assert traces.n == 2  # inside the block: a new trace, not the stale one
    np.testing.assert_allclose(hooked, 2 * plain, rtol=1e-6)
    np.testing.assert_allclose(f(model, x), plain)  # outside again: the first trace, reused
    with hx.intercept(double_linear, where="layers/2"):
        np.testing.assert_allclose(f(model, x), hooked)  # same object, equal where=: cache hit
    assert traces.n == 2
    with hx.intercept(double_linear, where="layers/1"):
        f(model, x)  # a different where= is a different program
    assert traces.n == 3


def scale_by(k):
    def ic(next_fun, args, kwargs, context):
        return next_fun(*args, **kwargs) * k

    return ic


def test_jax_jit_cache_key_is_value_stable_for_fresh_functions(traces):
    model, x = MLP(), jnp.ones((2, 3))

    @jax.jit
    def f(x):
        traces()
        return model(x)

    plain = model(x)
    for _ in range(3):
        with hx.intercept(double_linear):
            f(x)
    assert traces.n == 1
    for _ in range(3):  # a lambda re-created every step, over nothing new: same key, no retrace
        with hx.intercept(lambda n, a, k, c: n(*a, **k) * 2, where="layers/2"):
            np.testing.assert_allclose(f(x), 2 * plain, rtol=1e-6)
    assert traces.n == 2
    for _ in range(2):  # re-created with an equal constant: still the same program
        with hx.intercept(scale_by(3.0), where="layers/2"):
            np.testing.assert_allclose(f(x), 3 * plain, rtol=1e-6)
    assert traces.n == 3
    with hx.intercept(scale_by(4.0), where="layers/2"):  # a new constant: a new program
        np.testing.assert_allclose(f(x), 4 * plain, rtol=1e-6)
    assert traces.n == 4


def test_thread_local():
    model, x = MLP(), jnp.ones((2, 3))
    expected = model(x)
    inside, outside = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def other():
        inside.wait()
        rec = Recorder()
        with hx.intercept(rec):
            results["other_keys"] = (rec, model(x))
        results["plain"] = model(x)
        outside.set()

    rec = Recorder()
    t = threading.Thread(target=other)
    t.start()
    with hx.intercept(double_linear):
        inside.set()
        outside.wait()
        mine = model(x)
    t.join()
    other_rec, other_out = results["other_keys"]  # type: ignore[misc]
    assert other_rec.keys == ["", "layers/0", "layers/1", "layers/2"]
    np.testing.assert_allclose(other_out, expected)  # our doubling never reached the thread
    np.testing.assert_allclose(results["plain"], expected)
    assert not np.allclose(mine, expected)
    assert rec.keys == []


class Boom(Exception):
    pass


def test_exception_in_interceptor_propagates_with_note_and_cleans_up():
    err = Boom("bad interceptor")

    def raiser(next_fun, args, kwargs, context):
        raise err

    model = MLP()
    with pytest.raises(Boom) as info, hx.intercept(raiser, where="layers/1"):
        model(jnp.ones((2, 3)))
    assert info.value is err
    (note,) = info.value.__notes__
    assert "raiser" in note and "'layers/1'" in note and "Linear.__call__" in note
    assert _context.active_entries() == () and _context.call_stack() == []
    np.testing.assert_allclose(model(jnp.ones((2, 3))), MLP()(jnp.ones((2, 3))))


@pytest.mark.parametrize("mode", ["eager", "nnx.jit"])
def test_exception_in_model_names_call_site(mode):
    class Bad(nnx.Module):
        def __call__(self, x):
            raise Boom("model failed")

    class Outer(nnx.Module):
        def __init__(self):
            self.sub = nnx.List([Bad()])

        def __call__(self, x):
            return self.sub[0](x)

    with pytest.raises(Boom, match="model failed") as info, hx.intercept(Recorder()):
        run(mode, Outer(), jnp.ones(2))
    assert info.value.__notes__[0] == "hookax: raised in call site 'sub/0' (Bad.__call__)"
    assert _context.active_entries() == () and _context.call_stack() == []


def test_keyboard_interrupt_leaves_nothing_active():
    def interrupt(next_fun, args, kwargs, context):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), hx.intercept(interrupt):
        MLP()(jnp.ones((1, 3)))
    assert _context.active_entries() == () and _context.call_stack() == []


def test_idle_wrapper_calls_method_directly():
    rec = Recorder()
    with hx.intercept(rec):
        pass
    wrapped = nnx.Linear.__call__
    assert wrapped.__wrapped__ is not wrapped  # installed once, kept
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    assert _context.active_entries() == ()
    np.testing.assert_allclose(m(jnp.ones(2)), jnp.ones(2) @ m.kernel[...] + m.bias[...])
    assert rec.keys == []


def test_import_hookax_imports_no_framework():
    code = (
        "import sys, hookax; "
        "names = ('flax', 'equinox', 'haiku', 'rich', 'matplotlib'); "
        "bad = [m for m in names if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@jit_modes
def test_interceptor_changes_inputs_and_kwargs(mode):
    class Affine(nnx.Module):
        def __call__(self, x, *, shift=0.0):
            return x + shift

    class Outer(nnx.Module):
        def __init__(self):
            self.inner = Affine()

        def __call__(self, x):
            return self.inner(x, shift=1.0)

    def rewrite(next_fun, args, kwargs, context):
        (x,) = args
        return next_fun(x * 10, shift=kwargs["shift"] + 5)

    with hx.intercept(rewrite, where=Affine):
        y = run(mode, Outer(), jnp.arange(3.0))
    np.testing.assert_array_equal(y, jnp.arange(3.0) * 10 + 6)


def test_equal_blocks_share_one_entry_object():
    """JAX compares the active entries on every call: equal blocks reuse one (interned) object."""
    with hx.intercept(double_linear, where=nnx.Linear):
        (first,) = _context.active_entries()
    with hx.intercept(double_linear, where=nnx.Linear):
        (again,) = _context.active_entries()
    with hx.intercept(double_linear, where="layers/0"):
        (other,) = _context.active_entries()
    assert again is first and other is not first and other != first


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_one_context_per_call_site_for_interceptors_and_scoped_hooks(mode):
    seen: list[object] = []

    def record(next_fun, args, kwargs, context):
        seen.append(context)
        return next_fun(*args, **kwargs)

    def pick(ctx):
        seen.append(ctx)
        return True

    lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with hx.intercept(record), hx.hooks(where=pick, forward=lambda m, a, out: out * 2):
        y = run(mode, lin, jnp.ones(2))
    np.testing.assert_allclose(y, 2 * (jnp.ones(2) @ lin.kernel[...] + lin.bias[...]), rtol=1e-6)
    assert len(seen) == 2 and seen[0] is seen[1]  # built once, shared
