"""One layer of a scanned stack (``"blocks/mlp[3]"``): edits, capture and activation gradients of
one iteration of ``nnx.scan``, Linen's ``nn.scan`` with ``nn.remat``, and ``lax.scan`` over
Equinox layers, each against the same layers unrolled by hand with only that layer edited."""

import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

N = 5
X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.mlp = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.mlp(x))


class Scanned(nnx.Module):
    def __init__(self, remat: bool = False) -> None:
        @nnx.split_rngs(splits=N)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.blocks = make(nnx.Rngs(0))
        self.remat = remat

    def __call__(self, x: jax.Array) -> jax.Array:
        def step(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        if self.remat:
            step = nnx.remat(step)
        return nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)


def _kernels(model: Scanned) -> tuple[jax.Array, jax.Array]:
    return model.blocks.mlp.kernel[...], model.blocks.mlp.bias[...]


def unrolled(w: jax.Array, b: jax.Array, x: jax.Array, edit=None, pre=None) -> jax.Array:
    """The stack by hand; ``edit``/``pre`` ``(i, value) -> value`` change layer ``i``'s output
    or input."""
    h = x
    for i in range(w.shape[0]):
        a = h if pre is None else pre(i, h)
        o = a @ w[i] + b[i]
        if edit is not None:
            o = edit(i, o)
        h = h + jnp.tanh(o)
    return h


def _steer(next_fun, args, kwargs, ctx):
    return next_fun(*args, **kwargs) + 1.5


def _on(layers, delta=1.5):
    return lambda i, o: o + delta if i in layers else o


def _run(mode, fn, *args):
    if mode == "eager":
        return fn(*args)
    if mode == "jax.jit":
        return jax.jit(fn)(*args)
    return nnx.jit(fn)(*args)


MODES = ["eager", "jax.jit", "nnx.jit"]


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_interceptor_edits_one_layer_of_nnx_scan(mode, remat, traces):
    model = Scanned(remat)
    w, b = _kernels(model)

    def f(m, x):
        traces()
        return m(x)

    f = {"eager": f, "jax.jit": jax.jit(f), "nnx.jit": nnx.jit(f)}[mode]
    for _ in range(2):
        with hx.intercept(_steer, where="blocks/mlp[3]"):
            y = f(model, X)
        np.testing.assert_allclose(y, unrolled(w, b, X, _on({3})), rtol=1e-5, atol=1e-6)
    with hx.intercept(_steer, where="blocks/mlp[1,3]"):
        y = f(model, X)
    np.testing.assert_allclose(y, unrolled(w, b, X, _on({1, 3})), rtol=1e-5, atol=1e-6)
    # Without the block: the plain stack (the edit is part of the cache key).
    np.testing.assert_allclose(f(model, X), unrolled(w, b, X), rtol=1e-5, atol=1e-6)
    if mode != "eager":
        assert traces.n == 3  # one per distinct block, none for the repeat


def test_an_interceptor_that_edits_the_input_of_one_layer():
    model = Scanned()
    w, b = _kernels(model)

    def pre(next_fun, args, kwargs, ctx):
        return next_fun(args[0] * 0.5)

    with hx.intercept(pre, where="blocks/mlp[2]"):
        y = jax.jit(lambda m, x: m(x))(model, X)
    want = unrolled(w, b, X, pre=lambda i, h: h * 0.5 if i == 2 else h)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_context_layer_is_the_traced_index_inside_a_scan_and_none_outside():
    model = Scanned()
    w, b = _kernels(model)
    seen = []

    def scale_by_layer(next_fun, args, kwargs, ctx):
        seen.append(ctx.layer)
        out = next_fun(*args, **kwargs)
        return out if ctx.layer is None else out * (1.0 + ctx.layer.astype(out.dtype))

    with hx.intercept(scale_by_layer, where="blocks/mlp"):
        y = jax.jit(lambda m, x: m(x))(model, X)
    np.testing.assert_allclose(
        y, unrolled(w, b, X, lambda i, o: o * (1.0 + i)), rtol=1e-5, atol=1e-6
    )
    assert isinstance(seen[0], jax.core.Tracer)
    lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with hx.intercept(scale_by_layer):
        lin(X)
    assert seen[-1] is None


@pytest.mark.parametrize("mode", MODES)
def test_capture_of_one_layer_equals_that_layer_of_the_stack(mode):
    model = Scanned()
    w, b = _kernels(model)
    _, every = hx.capture(lambda m, x: m(x), where="blocks/mlp")(model, X)
    two = hx.Select(paths=("blocks/mlp[3]", "blocks/mlp[0]"))
    forward = hx.capture(lambda m, x: m(x), where=two)
    _, acts = _run(mode, forward, model, X)
    assert list(acts) == ["blocks/mlp[0]", "blocks/mlp[3]"]
    for i in (0, 3):
        np.testing.assert_allclose(acts[f"blocks/mlp[{i}]"][0], every["blocks/mlp"][0][i])
    # The hand-unrolled layer 3 output.
    h = X
    for i in range(3):
        h = h + jnp.tanh(h @ w[i] + b[i])
    np.testing.assert_allclose(acts["blocks/mlp[3]"][0], h @ w[3] + b[3], rtol=1e-5, atol=1e-6)
    # Inside an intercept of that layer, capture records the edited value.
    with hx.intercept(_steer, where="blocks/mlp[3]"):
        _, edited = _run(mode, forward, model, X)
    np.testing.assert_allclose(edited["blocks/mlp[3]"][0], acts["blocks/mlp[3]"][0] + 1.5)
    np.testing.assert_allclose(edited["blocks/mlp[0]"][0], acts["blocks/mlp[0]"][0])


def test_activation_gradient_of_one_layer_equals_finite_differences():
    model = Scanned(remat=True)
    w, b = _kernels(model)

    def loss(m, x):
        return jnp.sum(jnp.sin(m(x)))

    _, _, act_grads = hx.value_and_grad(loss, where="blocks/mlp[3]")(model, X)
    (g,) = act_grads["blocks/mlp[3]"]
    assert g.shape == (2, 4)

    def perturbed(d):
        return jnp.sum(jnp.sin(unrolled(w, b, X, lambda i, o: o + d if i == 3 else o)))

    eps = 1e-3
    fd = np.zeros((2, 4))
    for r in range(2):
        for c in range(4):
            e = jnp.zeros((2, 4)).at[r, c].set(eps)
            fd[r, c] = (perturbed(e) - perturbed(-e)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=2e-3, atol=2e-4)
    # and equals the stacked gradient's layer 3
    _, _, every = hx.value_and_grad(loss, where="blocks/mlp")(model, X)
    np.testing.assert_allclose(g, every["blocks/mlp"][0][3], rtol=1e-6)


def test_gradients_through_a_one_layer_edit_equal_the_hand_edited_stack():
    model = Scanned(remat=True)
    w, b = _kernels(model)

    def loss(m, x):
        with hx.intercept(_steer, where="blocks/mlp[2]"):
            return jnp.sum(m(x) ** 2)

    grads = nnx.grad(loss)(model, X)
    want = jax.grad(lambda w, b: jnp.sum(unrolled(w, b, X, _on({2})) ** 2), argnums=(0, 1))(w, b)
    np.testing.assert_allclose(grads.blocks.mlp.kernel[...], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads.blocks.mlp.bias[...], want[1], rtol=1e-5, atol=1e-6)


def test_vmap_around_a_one_layer_edit():
    model = Scanned()
    w, b = _kernels(model)
    xs = jnp.stack([X, X * 2])
    with hx.intercept(_steer, where="blocks/mlp[4]"):
        y = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(model, xs)
    want = jnp.stack([unrolled(w, b, x, _on({4})) for x in xs])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


class LBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + jnp.tanh(nn.Dense(4, name="mlp")(x)), None


class LScanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            nn.remat(LBlock), variable_axes={"params": 0}, split_rngs={"params": True}, length=N
        )
        x, _ = stack(name="blocks")(x, None)
        return x


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_linen_scan_with_remat(mode):
    model = LScanned()
    params = model.init(jax.random.key(0), X)
    p = params["params"]["blocks"]["mlp"]
    w, b = p["kernel"], p["bias"]
    apply = model.apply if mode == "eager" else jax.jit(model.apply)
    with hx.intercept(_steer, where="blocks/mlp[3]"):
        y = apply(params, X)
    np.testing.assert_allclose(y, unrolled(w, b, X, _on({3})), rtol=1e-5, atol=1e-6)
    _, acts = hx.capture(apply, where="blocks/mlp[1]")(params, X)
    h = X
    h = h + jnp.tanh(h @ w[0] + b[0])
    np.testing.assert_allclose(acts["blocks/mlp[1]"][0], h @ w[1] + b[1], rtol=1e-5, atol=1e-6)


class EBlock(eqx.Module):
    mlp: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        self.mlp = eqx.nn.Linear(4, 4, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.mlp(x))


class EScanned(eqx.Module):
    blocks: EBlock

    def __init__(self) -> None:
        self.blocks = eqx.filter_vmap(EBlock)(jax.random.split(jax.random.key(1), N))

    def __call__(self, x: jax.Array) -> jax.Array:
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def body(h, p):
            return eqx.combine(p, static)(h), None

        return jax.lax.scan(body, x, params)[0]


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
def test_lax_scan_over_equinox_layers(mode):
    model = EScanned()
    x = jnp.linspace(-1.0, 1.0, 4)
    w = jnp.swapaxes(model.blocks.mlp.weight, 1, 2)
    b = model.blocks.mlp.bias
    run = model if mode == "eager" else eqx.filter_jit(lambda m, x: m(x))
    args = (x,) if mode == "eager" else (model, x)
    # The layers are combined from stacked arrays inside the body: they keep the stack's path.
    with hx.intercept(_steer, where="blocks/mlp[2]"):
        y = run(*args)
    np.testing.assert_allclose(y, unrolled(w, b, x, _on({2})), rtol=1e-5, atol=1e-6)


def test_nested_scans_select_the_inner_iteration():
    """A scan over groups of a scan over layers: the suffix is the inner scan's iteration."""
    model = Scanned()
    w, b = _kernels(model)

    def twice(state, x):
        def outer(carry, _):
            h, st = carry
            return (nnx.merge(graphdef, st)(h), st), None

        return jax.lax.scan(outer, (x, state), None, length=2)[0][0]

    graphdef, state = nnx.split(model)
    with hx.intercept(_steer, where="blocks/mlp[1]"):
        y = jax.jit(twice)(state, X)
    want = unrolled(w, b, unrolled(w, b, X, _on({1})), _on({1}))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_errors_name_the_call_site_and_the_fix():
    model = Scanned()
    with (
        pytest.raises(hx.HookaxError, match=r"layer 7 .* has 5 layers"),
        hx.intercept(_steer, where="blocks/mlp[7]"),
    ):
        jax.jit(lambda m, x: m(x))(model, X)
    with pytest.raises(hx.HookaxError, match=r"selects layer 9.*has 5 layers"):
        hx.capture(lambda m, x: m(x), where="blocks/mlp[9]")(model, X)
    seq = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    with (
        pytest.raises(hx.SelectorError, match="not run inside a scan"),
        hx.intercept(_steer, where="layers/0[0]"),
    ):
        seq(X)
    with pytest.raises(hx.SelectorError, match="malformed layer suffix"):
        hx.Select(paths="blocks/mlp[1:x]")
    with pytest.raises(hx.SelectorError, match="cannot be negated"):
        _ = ~hx.Select(paths="blocks/mlp[1]")

    def twice(next_fun, args, kwargs, ctx):
        return next_fun(*args) + next_fun(*args)

    with (
        pytest.raises(hx.HookaxError, match="called next_fun twice"),
        hx.intercept(twice, where="blocks/mlp[1]"),
    ):
        model(X)
    from hookax._engine import context

    assert context.active_entries() == ()


def test_harvest_of_one_layer_stores_that_layer(tmp_path):
    model = Scanned()
    batches = [X, X * 2]
    one = hx.harvest(model, batches, where="blocks/mlp[2]", store=tmp_path / "one.zarr")
    assert one.names == ("blocks/mlp[2]",)
    hx.harvest(model, batches, where="blocks/mlp", store=tmp_path / "all.zarr")
    every = hx.open_store(tmp_path / "all.zarr")
    assert every.names == tuple(f"blocks/mlp[{i}]" for i in range(N))
    got = hx.open_store(tmp_path / "one.zarr").read("blocks/mlp[2]")
    np.testing.assert_array_equal(got, every.read("blocks/mlp[2]"))
    assert got.shape == (4, 4)


@pytest.mark.parametrize("mode", MODES)
def test_forward_hooks_on_one_layer(mode):
    model = Scanned()
    w, b = _kernels(model)
    f = {"eager": lambda m, x: m(x), "jax.jit": jax.jit(lambda m, x: m(x))}.get(mode) or nnx.jit(
        lambda m, x: m(x)
    )
    post = hx.register_forward_hook(model, lambda m, a, out: out + 1.5, where="blocks/mlp[3]")
    pre = hx.register_forward_pre_hook(model, lambda m, a: (a[0] * 0.5,), where="blocks/mlp[1]")
    with post, pre:
        y = f(model, X)
    want = unrolled(w, b, X, _on({3}), pre=lambda i, h: h * 0.5 if i == 1 else h)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f(model, X), unrolled(w, b, X), rtol=1e-5, atol=1e-6)
    # The scoped form.
    with hx.hooks(forward=lambda m, a, out: out + 1.5, where="blocks/mlp[0,4]"):
        y = f(model, X)
    np.testing.assert_allclose(y, unrolled(w, b, X, _on({0, 4})), rtol=1e-5, atol=1e-6)


def test_backward_hooks_of_one_layer_are_refused():
    model = Scanned()
    with pytest.raises(hx.SelectorError, match="backward hooks of one layer"):
        hx.register_full_backward_hook(model, lambda m, gi, go: None, where="blocks/mlp[3]")


class Attn(nnx.Module):
    """Scaled dot-product self-attention over the rows of ``x`` (one head)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.qk = nnx.Linear(4, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k = jnp.split(self.qk(x), 2, axis=-1)
        p = jax.nn.softmax(q @ k.T / 2.0, axis=-1)
        return x + p @ x


class AttnStack(nnx.Module):
    def __init__(self) -> None:
        @nnx.split_rngs(splits=N)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Attn:
            return Attn(rngs)

        self.blocks = make(nnx.Rngs(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.scan(lambda h, blk: blk(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
            x, self.blocks
        )


def _attn_by_hand(model: AttnStack, x: jax.Array, edit=None) -> tuple[jax.Array, list]:
    w, b = model.blocks.qk.kernel[...], model.blocks.qk.bias[...]
    probs = []
    for i in range(N):
        q, k = jnp.split(x @ w[i] + b[i], 2, axis=-1)
        p = jax.nn.softmax(q @ k.T / 2.0, axis=-1)
        if edit is not None:
            p = edit(i, p)
        probs.append(p)
        x = x + p @ x
    return x, probs


@pytest.mark.parametrize("mode", MODES)
def test_intercept_op_and_op_capture_of_one_layer(mode):
    model = AttnStack()
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    f = {"eager": lambda m, x: m(x), "jax.jit": jax.jit(lambda m, x: m(x))}.get(mode) or nnx.jit(
        lambda m, x: m(x)
    )

    def uniform(p, op):
        return jnp.full_like(p, 1.0 / p.shape[-1])

    with hx.intercept_op(uniform, ops="blocks:softmax"):
        all_layers = f(model, x)
    np.testing.assert_allclose(
        all_layers, _attn_by_hand(model, x, lambda i, p: uniform(p, None))[0], rtol=1e-5
    )
    with hx.intercept_op(uniform, ops="blocks[2]:softmax"):
        y = f(model, x)
    want, _ = _attn_by_hand(model, x, lambda i, p: uniform(p, None) if i == 2 else p)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    _, vals = hx.capture(f, ops="blocks[1]:softmax")(model, x)
    assert list(vals) == ["blocks[1]:softmax"]
    np.testing.assert_allclose(
        vals["blocks[1]:softmax"][0], _attn_by_hand(model, x)[1][1], rtol=1e-5
    )


def test_harvest_names_each_layer_of_an_operation_and_an_input_as_one_layer_selects_it(tmp_path):
    # The whole stack's arrays are named as the one-layer selections name them (the layer after
    # the call site's path, not after the operation: "blocks[1]:softmax", "blocks[1]:in"), so a
    # stored name is an address that ops=/where= take back.
    model = AttnStack()
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    kw = {"inputs": True, "progress": False}
    every = hx.harvest(model, [x], where="blocks", ops="blocks:softmax", store=tmp_path / "a", **kw)
    assert sorted(every.names) == sorted(
        f"blocks[{i}]{tail}" for i in range(N) for tail in ("", ":in", ":softmax")
    )
    one = hx.harvest(
        model, [x], where="blocks[1]", ops="blocks[1]:softmax", store=tmp_path / "1", **kw
    )
    assert sorted(one.names) == ["blocks[1]", "blocks[1]:in", "blocks[1]:softmax"]
    for name in one.names:
        np.testing.assert_array_equal(one.read(name), every.read(name))
    _, probs = _attn_by_hand(model, x)
    for i in range(N):
        np.testing.assert_allclose(every.read(f"blocks[{i}]:softmax"), probs[i], rtol=1e-5)
    h0 = x
    h1 = h0 + probs[0] @ h0
    np.testing.assert_array_equal(every.read("blocks[0]:in"), h0)
    np.testing.assert_allclose(every.read("blocks[1]:in"), h1, rtol=1e-5, atol=1e-6)
    _, vals = hx.capture(model, ops="blocks[3]:softmax")(x)  # the stored name selects it back
    np.testing.assert_array_equal(vals["blocks[3]:softmax"][0], every.read("blocks[3]:softmax"))


def _trip_counts(lowered) -> list[int]:
    return [
        int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', lowered.compile().as_text())
    ]


def test_harvest_of_one_layer_runs_the_scan_up_to_that_layer():
    """``"blocks/mlp[2]"`` of a 5-layer ``nnx.scan``: the step runs 3 iterations and has the FLOPs
    of the same 3 layers scanned by hand; the whole stack's harvest runs 5."""
    from hookax._harvest.step import Step

    model = Scanned()
    f = model
    one = Step(f, "blocks/mlp[2]", (), None, None, 1, (X,))
    every = Step(f, "blocks/mlp", (), None, None, 1, (X,))
    assert _trip_counts(one.lower(X)) == [3]
    assert _trip_counts(every.lower(X)) == [N]
    w, b = _kernels(model)

    def by_hand(w, b, x):
        def body(h, wb):
            pre = h @ wb[0] + wb[1]
            return h + jnp.tanh(pre), pre

        return jax.lax.scan(body, x, (w[:3], b[:3]))[1][2]

    hand = jax.jit(by_hand).lower(w, b, X)
    assert _trip_counts(hand) == [3]
    flops = one.lower(X).compile().cost_analysis()["flops"]
    assert flops == hand.compile().cost_analysis()["flops"]
    values, _ = one(X)
    np.testing.assert_allclose(values["blocks/mlp[2]"], by_hand(w, b, X), rtol=1e-6)
    np.testing.assert_array_equal(values["blocks/mlp[2]"], every(X)[0]["blocks/mlp"][2])


@pytest.mark.parametrize("jitted", [False, True])
def test_harvest_of_one_layer_of_an_equinox_scan_is_cut(tmp_path, jitted):
    """A vmapped ``lax.scan`` over Equinox layers, through the user's own ``jax.jit`` too (its
    call is inlined to find the scan; the harvest's trace then hits that function's jit cache,
    and the record must still be split by layer)."""
    from hookax._harvest.step import Step

    model = EScanned()
    f = jax.jit(jax.vmap(model)) if jitted else jax.vmap(model)
    one = Step(f, "blocks/mlp[1]", (), None, None, 1, (X,))
    assert _trip_counts(one.lower(X)) == [2]
    got = hx.harvest(f, [X], where="blocks/mlp[1]", store=tmp_path / "one.zarr")
    every = hx.capture(f, where="blocks/mlp")(X)[1]["blocks/mlp"][0]
    np.testing.assert_array_equal(got.read("blocks/mlp[1]"), every[1])


def test_scans_that_must_run_whole_are_not_cut():
    """A scan whose final carry is used, a reverse scan, and stacked outputs read whole keep
    their length; a cut scan computes the same values."""
    from hookax._transforms.cutscan import cut_scans

    xs = jnp.arange(6.0)

    def body(c, x):
        return c + x, c * x

    cases = {
        "carry used": (lambda xs: (lambda c, ys: c + ys[1])(*jax.lax.scan(body, 1.0, xs)), 6),
        "read whole": (lambda xs: jax.lax.scan(body, 1.0, xs)[1].sum(), 6),
        "cut": (lambda xs: jax.lax.scan(body, 1.0, xs)[1][1:3], 3),
    }
    for name, (f, length) in cases.items():
        assert _trip_counts(jax.jit(cut_scans(f)).lower(xs)) == [length] * len(
            _trip_counts(jax.jit(f).lower(xs))
        ), name
        np.testing.assert_array_equal(jax.jit(cut_scans(f))(xs), jax.jit(f)(xs), err_msg=name)
    # a scan with effects runs whole: every callback happens
    seen = []

    def logged(c, x):
        jax.debug.callback(lambda x: seen.append(float(x)), x)
        return body(c, x)

    jax.block_until_ready(jax.jit(cut_scans(lambda xs: jax.lax.scan(logged, 1.0, xs)[1][1]))(xs))
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_harvest_of_one_layer_of_a_linen_scan_is_cut():
    from hookax._harvest.step import Step

    model = LScanned()
    params = model.init(jax.random.key(0), X)
    f = jax.jit(model.apply)
    one = Step(lambda x: f(params, x), "blocks/mlp[1]", (), None, None, 1, (X,))
    assert _trip_counts(one.lower(X)) == [2]
    every = hx.capture(f, where="blocks/mlp")(params, X)[1]["blocks/mlp"][0]
    np.testing.assert_array_equal(one(X)[0]["blocks/mlp[1]"], every[1])


def test_a_cut_keeps_the_jit_calls_that_hold_no_scan():
    """The jit call around the scan is inlined to cut it; another keeps its own settings."""
    from hookax._transforms.cutscan import cut_scans

    xs = jnp.arange(6.0)
    double = jax.jit(lambda y: y * 2)

    def f(xs):
        ys = jax.jit(lambda xs: jax.lax.scan(lambda c, x: (c + x, c * x), 1.0, xs)[1])(xs)
        return double(xs) + ys[1]

    jaxpr = jax.make_jaxpr(cut_scans(f))(xs).jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.count("pjit") + names.count("jit") == 1  # `double`, kept as a call
    assert [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"] == [2]
    np.testing.assert_array_equal(jax.jit(cut_scans(f))(xs), jax.jit(f)(xs))
