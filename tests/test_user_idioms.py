"""Idioms users write that the feature tests do not: operations of one layer of a scanned stack
named by a layer suffix on plain primitives, and patching grids over Equinox's
``jax.vmap(model)(tokens)``. Each against the same computation written by hand."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

N, B, T, H, DH = 3, 2, 3, 2, 2
D = H * DH


def close(a: Any, b: Any, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# --- a layer suffix on the plain primitives of a scanned stack ---------------------------------


class Attn(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return attention(self.qkv(x))


def attention(qkv: jax.Array, edit: Any = None) -> jax.Array:
    """Heads' attention of ``(batch, position, 3 * D)``; ``edit(out)`` rewrites the per-head
    outputs ``(batch, heads, position, features)`` (the second einsum, ``dot_general#1``)."""
    q, k, v = (t.reshape(*t.shape[:-1], H, DH) for t in jnp.split(qkv, 3, axis=-1))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    out = jnp.einsum("bhqk,bkhd->bhqd", jax.nn.softmax(s, axis=-1), v)
    if edit is not None:
        out = edit(out)
    return out.transpose(0, 2, 1, 3).reshape(*qkv.shape[:-1], D)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn = Attn(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.sin(x)
        return x + self.attn(h)  # an add after the child's call


class Stack(nnx.Module):
    def __init__(self, decorated: bool) -> None:
        @nnx.split_rngs(splits=N)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.blocks = make(nnx.Rngs(0))
        self.decorated = decorated

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.decorated:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x: jax.Array, block: Block) -> jax.Array:
                return block(x)

            return body(x, self.blocks)
        return nnx.scan(lambda x, b: b(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
            x, self.blocks
        )


def by_hand(model: Stack, x: jax.Array, edits: dict[tuple[int, str], Any] | None = None):
    """The stack unrolled; ``edits[(layer, "sin" | "dot" | "add")](value) -> value``; returns
    the output and every layer's values of the three operations."""
    edits = edits or {}
    w, b = model.blocks.attn.qkv.kernel[...], model.blocks.attn.qkv.bias[...]
    seen: dict[tuple[int, str], jax.Array] = {}

    def at(i: int, name: str, value: jax.Array) -> jax.Array:
        value = edits.get((i, name), lambda v: v)(value)
        seen[(i, name)] = value
        return value

    for i in range(N):
        h = at(i, "sin", jnp.sin(x))
        y = attention(h @ w[i] + b[i], lambda out, i=i: at(i, "dot", out))
        x = at(i, "add", x + y)
    return x, seen


X = jax.random.normal(jax.random.key(3), (B, T, D))
OPS = {"sin": "blocks[1]:sin", "dot": "blocks/attn[2]:dot_general#1", "add": "blocks[0]:add"}
LAYER = {"sin": 1, "dot": 2, "add": 0}


def _run(mode: str, fn: Any, *args: Any) -> Any:
    if mode == "eager":
        return fn(*args)
    return {"jax.jit": jax.jit, "nnx.jit": nnx.jit}[mode](fn)(*args)


@pytest.mark.parametrize("decorated", [False, True])
@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
def test_layer_suffix_on_plain_primitives_of_a_scanned_stack(mode: str, decorated: bool) -> None:
    """``blocks[1]:sin``, ``blocks/attn[2]:dot_general#1`` (an einsum after a child call) and
    ``blocks[0]:add`` captured and edited in one layer of an ``nnx.scan`` stack (a lambda body
    and a decorated ``@nnx.scan`` one)."""
    model = Stack(decorated)
    want, seen = by_hand(model, X)
    close(model(X), want)

    y, vals = _run(mode, lambda m, x: hx.capture(m, ops=list(OPS.values()))(x), model, X)
    close(y, want)
    assert sorted(vals) == sorted(OPS.values())
    for name, address in OPS.items():
        assert len(vals[address]) == 1
        close(vals[address][0], seen[(LAYER[name], name)])

    def off(value: jax.Array, op: hx.OpContext) -> jax.Array:
        return value * 0.5

    for name, address in OPS.items():

        def edited(m: Stack, x: jax.Array, address: str = address) -> jax.Array:
            with hx.intercept_op(off, ops=address):
                return m(x)

        got = _run(mode, edited, model, X)
        hand, _ = by_hand(model, X, {(LAYER[name], name): lambda v: v * 0.5})
        close(got, hand)
        assert float(jnp.abs(hand - want).max()) > 1e-3  # the edit changes the output


def test_patch_grid_of_one_layer_of_a_scanned_stack_per_head() -> None:
    """``ops="blocks/attn[0:3]:dot_general#1", heads=1``: one row per layer, each cell one head
    at one position patched from the clean run, against the stack unrolled by hand."""
    model = Stack(decorated=True)
    clean, corrupt = X, X[::-1] * 0.5
    _, clean_seen = by_hand(model, clean)

    def metric(y: jax.Array) -> jax.Array:
        return y[:, -1].sum()

    grid = hx.patch_grid(
        model, (clean,), (corrupt,), metric, ops="blocks/attn[0:3]:dot_general#1", heads=1, axis=2
    )
    assert grid.shape == (N, H, T)  # (layer, head, position)

    @jax.jit
    def hand(layer: jax.Array, head: jax.Array, pos: jax.Array) -> jax.Array:
        mask = (jnp.arange(H) == head)[:, None, None] & (jnp.arange(T) == pos)[:, None]
        edits = {
            (i, "dot"): lambda v, i=i: jnp.where(mask & (layer == i), clean_seen[(i, "dot")], v)
            for i in range(N)
        }
        return metric(by_hand(model, corrupt, edits)[0])

    for i in range(N):
        for h in range(H):
            for p in range(T):
                close(grid[i, h, p], hand(jnp.int32(i), jnp.int32(h), jnp.int32(p)))


def test_a_layer_suffix_outside_a_scan_names_the_grid_in_its_error() -> None:
    class Unrolled(nnx.Module):
        def __init__(self) -> None:
            self.blocks = nnx.List([Block(nnx.Rngs(i)) for i in range(2)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for b in self.blocks:
                x = b(x)
            return x

    with pytest.raises(
        hx.SelectorError,
        match=r"^hx\.patch_grid: a layer suffix selects iteration\(s\) 0 of call site "
        r"'blocks/0/attn', but it does not run inside a scan",
    ):
        hx.patch_grid(
            Unrolled(), (X,), (X * 0,), jnp.sum, ops="blocks/0/attn[0]:dot_general#1", axis=2
        )


# --- patching grids over Equinox's jax.vmap(model)(tokens) -------------------------------------

_KE = jax.random.split(jax.random.key(5), 3)
W_E = [jax.random.normal(k, (D, D)) / 2 for k in _KE]


class EBlock(eqx.Module):
    lin: eqx.nn.Linear

    def __init__(self, w: jax.Array) -> None:
        self.lin = eqx.nn.Linear(D, D, use_bias=False, key=jax.random.key(0))
        self.lin = eqx.tree_at(lambda m: m.weight, self.lin, w.T)

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (position, features), one example
        return x + jnp.tanh(jax.vmap(self.lin)(x))


class EModel(eqx.Module):
    blocks: list[EBlock]

    def __init__(self) -> None:
        self.blocks = [EBlock(w) for w in W_E]

    def __call__(self, x: jax.Array) -> jax.Array:
        for b in self.blocks:
            x = b(x)
        return x


def e_hand(x: jax.Array, edit: Any = None) -> tuple[jax.Array, list[jax.Array]]:
    """The model over a batch by hand; ``edit(i, out) -> out`` on block ``i``'s batched output."""
    outs = []
    for i, w in enumerate(W_E):
        x = x + jnp.tanh(x @ w)
        if edit is not None:
            x = edit(i, x)
        outs.append(x)
    return x, outs


XE = jax.random.normal(jax.random.key(6), (B, T, D))
XE_CORRUPT = XE[::-1] * 0.5


def e_metric(y: jax.Array) -> jax.Array:
    return (y[:, -1, 0] * jnp.array([1.0, -2.0])).sum()


def e_grid_by_hand() -> jax.Array:
    _, clean = e_hand(XE)
    rows = []
    for i in range(len(W_E)):
        row = []
        for p in range(T):
            mask = (jnp.arange(T) == p)[:, None]
            y, _ = e_hand(
                XE_CORRUPT, lambda j, o, i=i, m=mask: jnp.where(m, clean[i], o) if j == i else o
            )
            row.append(e_metric(y))
        rows.append(row)
    return jnp.array(rows)


def test_the_equinox_model_is_its_reference() -> None:
    close(jax.vmap(EModel())(XE), e_hand(XE)[0])


@pytest.mark.parametrize("mode", ["eager", "eqx.filter_jit", "jax.jit"])
def test_patch_grid_over_jax_vmap_of_an_equinox_model(mode: str) -> None:
    """Positions index the per-example value (``axis=0``); each example gets its own clean
    value."""

    def fn(model: EModel, tokens: jax.Array) -> jax.Array:
        return jax.vmap(model)(tokens)

    def grid(model: EModel, clean: jax.Array, corrupt: jax.Array) -> jax.Array:
        return hx.patch_grid(
            fn, (model, clean), (model, corrupt), e_metric, where="blocks/*", axis=0
        )

    run = {"eager": grid, "eqx.filter_jit": eqx.filter_jit(grid), "jax.jit": jax.jit(grid)}[mode]
    got = run(EModel(), XE, XE_CORRUPT)
    want = e_grid_by_hand()
    assert got.shape == (len(W_E), T)
    close(got, want)
    assert float(jnp.abs(want - e_metric(e_hand(XE_CORRUPT)[0])).max()) > 1e-2


@pytest.mark.parametrize("mode", ["eager", "eqx.filter_jit"])
def test_operations_and_attribution_over_jax_vmap_of_an_equinox_model(mode: str) -> None:
    """An operation target (the block's residual ``add``) inside the vmap, and attribution in
    the same layout: (clean - corrupted) . d metric / d output, by jax.grad of a hand
    perturbation."""

    def fn(model: EModel, tokens: jax.Array) -> jax.Array:
        return jax.vmap(model)(tokens)

    def both(model: EModel, clean: jax.Array, corrupt: jax.Array) -> tuple[jax.Array, ...]:
        args = (fn, (model, clean), (model, corrupt), e_metric)
        return (
            hx.patch_grid(*args, ops="blocks/*:add", axis=0),
            hx.attribution_patch(*args, where="blocks/*", axis=0),
            hx.patch_grid(*args, where="blocks/2:in", axis=0),  # block 1's output
            hx.attribution_patch(*args, where="blocks/2:in", axis=0),
        )

    run = both if mode == "eager" else eqx.filter_jit(both)
    grid, est, in_grid, in_est = run(EModel(), XE, XE_CORRUPT)
    close(grid, e_grid_by_hand())
    close(in_grid, e_grid_by_hand()[1:2])
    close(in_est, est[1:2])

    def perturbed(d: jax.Array) -> jax.Array:
        return e_metric(e_hand(XE_CORRUPT, lambda i, o: o + d[i])[0])

    g = jax.grad(perturbed)(jnp.zeros((len(W_E), B, T, D)))
    diff = jnp.stack(e_hand(XE)[1]) - jnp.stack(e_hand(XE_CORRUPT)[1])
    close(est, (diff * g).sum(axis=(1, 3)))


@pytest.mark.parametrize("mode", ["eager", "eqx.filter_jit"])
def test_patching_inside_jax_vmap_gives_each_example_its_value(mode: str) -> None:
    _, clean = e_hand(XE)

    def run(model: EModel, x: jax.Array, value: jax.Array) -> jax.Array:
        with hx.patching({"blocks/1": value}, positions=2, axis=0):
            return jax.vmap(model)(x)

    run = run if mode == "eager" else eqx.filter_jit(run)
    got = run(EModel(), XE_CORRUPT, clean[1])
    mask = (jnp.arange(T) == 2)[:, None]
    want, _ = e_hand(XE_CORRUPT, lambda i, o: jnp.where(mask, clean[1], o) if i == 1 else o)
    close(got, want)


# --- a call site's input ("blocks/1:in", as hx.capture names it) as a patch target ----------

_KR = jax.random.split(jax.random.key(7), 6)
W_R = [
    (jax.random.normal(a, (D, D)) / 2, jax.random.normal(b, (D,)) / 4)
    for a, b in zip(_KR[::2], _KR[1::2])
]
XR = jax.random.normal(jax.random.key(8), (1, T, D))
XR_CORRUPT = XR[:, ::-1] * 0.5


class RBlock(nnx.Module):
    def __init__(self, i: int) -> None:
        self.lin = nnx.Linear(D, D, rngs=nnx.Rngs(0))
        self.lin.kernel.set_value(W_R[i][0])
        self.lin.bias.set_value(W_R[i][1])

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.lin(x))


class RModel(nnx.Module):
    def __init__(self) -> None:
        self.blocks = nnx.List([RBlock(i) for i in range(len(W_R))])

    def __call__(self, x: jax.Array) -> jax.Array:
        for b in self.blocks:
            x = b(x)
        return x


def r_hand(x: jax.Array, pre: Any = None) -> tuple[jax.Array, list[jax.Array]]:
    """The residual stack by hand; ``pre(i, x) -> x`` rewrites block ``i``'s input (the
    residual stream before it); returns the output and each block's input."""
    ins = []
    for i, (w, b) in enumerate(W_R):
        if pre is not None:
            x = pre(i, x)
        ins.append(x)
        x = x + jnp.tanh(x @ w + b)
    return x, ins


def r_metric(y: jax.Array) -> jax.Array:
    return y[0, -1, 0] - y[0, -1, 1]


R_CLEAN_IN = r_hand(XR)[1]


def r_patched(i: int, p: int | None) -> jax.Array:
    mask = jnp.ones((T, 1), bool) if p is None else (jnp.arange(T) == p)[:, None]
    pre = lambda j, x: jnp.where(mask, R_CLEAN_IN[i], x) if j == i else x  # noqa: E731
    return r_metric(r_hand(XR_CORRUPT, pre)[0])


def test_the_residual_model_is_its_reference() -> None:
    close(RModel()(XR), r_hand(XR)[0])


@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
def test_the_input_of_a_call_site_is_a_patch_target(mode: str) -> None:
    """``"blocks/1:in"`` in hx.patching, patch_grid (``"blocks/*:in"``: one row per block) and
    attribution_patch, against the residual stream before each block edited by hand."""
    model = RModel()
    _, acts = hx.capture(model, where="blocks/1", inputs=True)(XR)
    assert "blocks/1:in" in acts

    def patched(m: RModel, x: jax.Array, value: jax.Array) -> jax.Array:
        with hx.patching({"blocks/1:in": value}, positions=2):
            return r_metric(m(x))

    def grid(m: RModel, clean: jax.Array, corrupt: jax.Array) -> tuple[jax.Array, jax.Array]:
        args = (m, (clean,), (corrupt,), r_metric)
        return (
            hx.patch_grid(*args, where="blocks/*:in"),
            hx.attribution_patch(*args, where=["blocks/0:in", "blocks/2:in"]),
        )

    wrap = {"eager": lambda f: f, "jax.jit": jax.jit, "nnx.jit": nnx.jit}[mode]
    close(wrap(patched)(model, XR_CORRUPT, acts["blocks/1:in"][0]), r_patched(1, 2))
    got, est = wrap(grid)(model, XR, XR_CORRUPT)
    want = jnp.array([[r_patched(i, p) for p in range(T)] for i in range(len(W_R))])
    assert got.shape == (len(W_R), T)
    close(got, want)

    def perturbed(d: jax.Array) -> jax.Array:
        return r_metric(r_hand(XR_CORRUPT, lambda i, x: x + d[i])[0])

    g = jax.grad(perturbed)(jnp.zeros((len(W_R), 1, T, D)))
    diff = jnp.stack(R_CLEAN_IN) - jnp.stack(r_hand(XR_CORRUPT)[1])
    close(est, (diff * g).sum(axis=(1, 3))[jnp.array([0, 2])])


def test_the_input_of_one_layer_of_a_scanned_stack_is_a_patch_target() -> None:
    """``"blocks/mlp[1,3]:in"``: one row per layer, the input of that layer's ``mlp``."""
    from tests.test_scan_layers import Scanned, X, _kernels, unrolled

    model = Scanned()
    w, b = _kernels(model)
    clean, corrupt = X, X[::-1] * 0.5
    ins: dict[int, jax.Array] = {}
    unrolled(w, b, clean, pre=lambda i, h: ins.setdefault(i, h))
    got = hx.patch_grid(model, (clean,), (corrupt,), jnp.sum, where="blocks/mlp[1,3]:in", axis=0)
    assert got.shape == (2, 2)  # (layer, batch row)
    for r, layer in enumerate((1, 3)):
        for row in range(2):
            mask = (jnp.arange(2) == row)[:, None]
            pre = lambda i, h, m=mask, at=layer: jnp.where(m, ins[i], h) if i == at else h  # noqa: E731
            close(got[r, row], unrolled(w, b, corrupt, pre=pre).sum())


def test_input_targets_that_do_not_fit_raise_naming_them() -> None:
    model = RModel()
    args = (model, (XR,), (XR_CORRUPT,), r_metric)
    with pytest.raises(
        hx.SelectorError, match=r"where='blockz/1:in' matched no call site.*'blocks/1:in'"
    ):
        hx.patch_grid(*args, where="blockz/1:in")

    class Two(nnx.Module):
        def __init__(self) -> None:
            self.lin = nnx.Linear(D, D, rngs=nnx.Rngs(0))

        def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array:
            return self.lin(x) + y

    class Outer(nnx.Module):
        def __init__(self) -> None:
            self.two = Two()

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.two(x, x)

    with pytest.raises(hx.PatchError, match=r"the input of call site 'two' is \("):
        hx.patch_grid(Outer(), (XR,), (XR_CORRUPT,), r_metric, where="two:in")
    with (
        pytest.raises(hx.PatchError, match=r"'two:in' names the input of a call that takes 2"),
        hx.patching({"two:in": XR}),
    ):
        Outer()(XR)
    assert_clean()


def assert_clean() -> None:
    """Nothing of a failed call is left active."""
    from hookax._engine import context as _context
    from hookax._patching import patch as _patch
    from hookax._transforms import tags as _tags

    assert _context.active_entries() == ()
    assert _tags.depth() == 0
    assert _patch._LOCAL.blocks == []


# --- hx.find_nonfinite compiles once per loss function and argument shapes ---------------------


def test_find_nonfinite_compiles_once_per_loss_function_and_shapes() -> None:
    """Three calls on new values of the same shapes trace the loss twice in all (once to find
    the call sites, once compiled), and still see each call's values; a re-created lambda over
    the same objects is the same loss; new shapes compile again."""
    from tests.test_nonfinite import MLP, mse

    traces = []

    def loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        traces.append(1)
        return mse(model, x, y)

    model = MLP(nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(4), 3)
    for k in keys:
        x, y = jax.random.normal(k, (6, 4)), jax.random.normal(k, (6, 2))
        assert hx.find_nonfinite(loss, model, x, y) is None
    assert len(traces) == 2
    model.layers[1].lin.kernel[0, 0] = jnp.nan  # new values: the cached program sees them
    for _ in range(2):  # a lambda made afresh each time, over the same function
        found = hx.find_nonfinite(lambda m, a, b: loss(m, a, b), model, x, y)
        assert found is not None and found.key == "layers/1/lin"
    assert len(traces) == 4  # the lambda: a loss function of its own, compiled once
    assert hx.find_nonfinite(loss, model, x[:3], y[:3]) is not None
    assert len(traces) == 6


def test_find_nonfinite_compiles_once_on_equinox_and_linen() -> None:
    from tests.test_conformance import X, _make

    for name in ("equinox", "linen"):
        fw = _make(name)
        traces: list[int] = []

        def loss(state: Any, x: jax.Array, fw: Any = fw, traces: list[int] = traces) -> jax.Array:
            traces.append(1)
            return fw.loss(state, x)

        for i in range(3):
            assert hx.find_nonfinite(loss, fw.state, X * (i + 1)) is None
        assert len(traces) == 2, name


def test_find_nonfinite_after_a_failing_loss_function() -> None:
    from tests.test_nonfinite import MLP, mse

    model = MLP(nnx.Rngs(0))
    x, y = jnp.ones((6, 4)), jnp.ones((6, 2))

    def bad(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        raise ValueError("the loss failed")

    with pytest.raises(ValueError, match="the loss failed"):
        hx.find_nonfinite(bad, model, x, y)
    assert_clean()
    assert hx.find_nonfinite(mse, model, x, y) is None
    close(model(x), MLP(nnx.Rngs(0))(x))  # the model is as it was


# --- statistics of call sites inside a vmap in the model: over the batch ----------------------

STATS_ALL = ("norm", "rms", "mean", "std", "max_abs", "frac_zero", "nonfinite")


@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
def test_statistics_inside_a_vmap_in_the_model_are_over_the_batch(mode: str) -> None:
    """One value per call site (not per example), equal to numpy's over the whole batch of the
    captured values and gradients; ``std`` alone (without ``mean``) pooled exactly too."""
    from tests.test_stats import VmapInside, assert_stats_match, mse

    x = jax.random.normal(jax.random.key(1), (6, 4))
    y = jax.random.normal(jax.random.key(2), (6, 2))
    model = VmapInside()
    wrap = {"eager": lambda f: f, "jax.jit": jax.jit, "nnx.jit": nnx.jit}[mode]
    _, _, stats = wrap(lambda m, x, y: hx.value_grad_and_stats(mse, stats=STATS_ALL)(m, x, y))(
        model, x, y
    )
    _, acts = hx.capture(model)(x)
    _, _, act_grads = hx.value_and_grad(mse)(model, x, y)
    assert stats["lin"]["act"]["norm"].shape == ()
    assert_stats_match(stats, acts, act_grads, {})
    _, _, std = wrap(lambda m, x, y: hx.value_grad_and_stats(mse, stats=("std",))(m, x, y))(
        model, x, y
    )
    assert list(std["lin"]["act"]) == ["std"]
    close(std["lin"]["act"]["std"], np.std(np.asarray(acts["lin"][0])))
    close(std["lin"]["grad"]["std"], np.std(np.asarray(act_grads["lin"][0])))


@pytest.mark.parametrize("mode", ["eager", "eqx.filter_jit"])
def test_statistics_of_an_equinox_model_under_jax_vmap_are_over_the_batch(mode: str) -> None:
    """The Equinox idiom: the loss runs ``jax.vmap(model)(x)``; every statistic is the whole
    batch's (per layer), and ``per_example=True`` keeps one per example."""

    def loss(model: EModel, x: jax.Array) -> jax.Array:
        return jnp.mean(jax.vmap(model)(x) ** 2)

    def step(model: EModel, x: jax.Array, per_example: bool = False) -> Any:
        return hx.value_grad_and_stats(loss, stats=STATS_ALL, per_example=per_example)(model, x)

    run = step if mode == "eager" else eqx.filter_jit(step)
    _, _, stats = run(EModel(), XE)
    assert stats.to_dict().keys() >= {"blocks/0", "blocks/0/lin"}

    def per_block(x: jax.Array, d: jax.Array) -> jax.Array:
        return jnp.mean(e_hand(x, lambda i, o: o + d[i])[0] ** 2)

    outs = e_hand(XE)[1]
    grads = jax.grad(per_block, argnums=1)(XE, jnp.zeros((len(W_E), B, T, D)))
    for i in range(len(W_E)):
        for kind, ref in (("act", outs[i]), ("grad", grads[i])):
            got = stats[f"blocks/{i}"][kind]
            ref = np.asarray(ref, np.float64)
            close(got["norm"], np.linalg.norm(ref))
            close(got["rms"], np.sqrt(np.mean(ref**2)))
            close(got["mean"], ref.mean())
            close(got["std"], ref.std())
            close(got["max_abs"], np.abs(ref).max())
            close(got["frac_zero"], np.mean(ref == 0))
            close(got["nonfinite"], 0.0)
    _, _, each = run(EModel(), XE, True)
    assert each["blocks/1"]["act"]["norm"].shape == (B,)
    close(
        each["blocks/1"]["act"]["norm"], np.linalg.norm(np.asarray(outs[1]).reshape(B, -1), axis=1)
    )
