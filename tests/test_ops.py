"""Operations inside call sites: addresses, values, edits and gradients (issue: ops=).

The attention probabilities of ``nnx.MultiHeadAttention`` (its default path runs
``jax.nn.dot_product_attention``, which computes them under a ``vmap`` over head groups) are
compared with what ``sow_weights=True`` records; zeroing one head with ``hx.intercept_op`` with
the same module given an ``attention_fn`` that zeroes it by hand; gradients with central finite
differences. Eagerly, under ``jax.jit`` with the model as an argument, ``nnx.jit``, in a decoder
scanned with ``nnx.scan``, and under ``vmap``.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import equinox as eqx
import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention_weights

import hookax as hx
from hookax._engine import context as _context
from hookax._transforms import tags as _tags

D, H, T, L, B = 8, 2, 4, 3, 2


def close(a: Any, b: Any, tol: float = 2e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def assert_clean() -> None:
    assert _context.active_entries() == ()
    assert _tags.depth() == 0


def mha(seed: int = 0) -> nnx.MultiHeadAttention:
    return nnx.MultiHeadAttention(
        num_heads=H, in_features=D, qkv_features=D, decode=False, rngs=nnx.Rngs(seed)
    )


def sowed_weights(attn: nnx.MultiHeadAttention, x: jax.Array) -> jax.Array:
    """What Flax itself records: ``sow_weights=True`` (its own attention path)."""
    with warnings.catch_warnings():  # Flax 0.12 deprecates sow outside nnx.capture
        warnings.simplefilter("ignore", DeprecationWarning)
        attn(x, sow_weights=True)
    (w,) = jax.tree.leaves(nnx.pop(attn, nnx.Intermediate))
    return w  # (batch, heads, q, k)


JITS = {
    "eager": lambda f: f,
    "jax.jit": jax.jit,
    "nnx.jit": nnx.jit,
}


# ---- addresses ----------------------------------------------------------------------------


class Two(nnx.Module):
    def __init__(self) -> None:
        self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        a = jnp.exp(x)
        b = self.lin(a)
        c = jnp.exp(b) * 2.0
        return jax.nn.relu(c)


def test_addresses_count_within_the_call_site_without_its_children() -> None:
    m, x = Two(), jnp.linspace(-1, 1, 6).reshape(2, 3)
    table = hx.ops(m, x)
    assert table.addresses[:2] == [":exp", "lin:dot_general"]
    root = [r for r in table.rows if r.key == ""]
    assert [r.address for r in root][:2] == [":exp", ":exp#1"] and ":mul" in table.addresses
    assert not any(r.name == "dot_general" for r in root)  # the child's, not the root's
    relu = next(r for r in root if r.address == ":relu")
    assert relu.primitive == "custom_jvp_call" and relu.outputs == ("f32[2,3]",)
    inside = [r for r in root if r.within == ":relu"]
    assert inside and all(r.key == "" for r in inside)
    assert re.search(r"test_ops\.py:\d+ \(Two\.__call__\)", next(r for r in root).source)
    text = str(table)
    assert "lin:dot_general" in text and text.splitlines()[-1].endswith("in 2 call sites")
    # values: the same addresses in capture, eagerly and under jax.jit with the model an argument
    for f in (lambda m, x: hx.capture(m, ops=[":exp#1", "lin:add", ":relu"])(x),):
        for jit in (lambda g: g, jax.jit):
            y, acts = jit(f)(m, x)
            # program order (a dict returned through jax.jit comes back with sorted keys)
            assert list(acts) == sorted(acts) if jit is jax.jit else ["lin:add", ":exp#1", ":relu"]
            close(acts[":exp#1"][0], jnp.exp(m.lin(jnp.exp(x))))
            close(acts["lin:add"][0], m.lin(jnp.exp(x)))
            close(acts[":relu"][0], y)
    assert_clean()


def test_where_limits_the_listing_and_selectors_that_match_nothing_raise() -> None:
    m, x = Two(), jnp.ones((2, 3))
    assert {r.key for r in hx.ops(m, x, where="lin")} == {"lin"}
    with pytest.raises(hx.SelectorError, match="'lin'"):
        hx.ops(m, x, where="lni")
    with pytest.raises(hx.SelectorError, match=r"ops='lni:add' names no call site.*'lin'"):
        hx.capture(m, ops="lni:add")(x)
    with pytest.raises(hx.SelectorError, match=r"ops='lin:ad' matched no operation.*'lin:add'"):
        hx.capture(m, ops="lin:ad")(x)
    with pytest.raises(hx.SelectorError, match="not an operation address"):
        hx.capture(m, ops="softmax")
    with (
        pytest.raises(hx.SelectorError, match="matched no operation"),
        hx.intercept_op(lambda v, op: v, ops=":exp#7"),
    ):
        m(x)
    assert_clean()


def test_globs_and_every_occurrence() -> None:
    m, x = Two(), jnp.linspace(-1, 1, 6).reshape(2, 3)
    for jit in (False, True):
        run = jax.jit if jit else (lambda f: f)
        _, every = run(lambda m, x: hx.capture(m, ops="**:exp#*")(x))(m, x)
        assert sorted(every) == [":exp", ":exp#1"]  # "lin" has no exp; "**" reaches the root
        _, first = run(lambda m, x: hx.capture(m, ops="**:e*")(x))(m, x)
        assert sorted(first) == [":exp"]  # no "#": the first of each name only
        close(every[":exp"][0], jnp.exp(x))
        close(every[":exp#1"][0], jnp.exp(m.lin(jnp.exp(x))))


# ---- nnx.MultiHeadAttention: probabilities, head ablation, gradients -----------------------


@pytest.mark.parametrize("mode", JITS)
def test_mha_probabilities_equal_sow_weights(mode: str) -> None:
    attn, x = mha(), jax.random.normal(jax.random.key(1), (B, T, D))
    y, acts = JITS[mode](lambda m, x: hx.capture(m, ops=":softmax")(x))(attn, x)
    (probs,) = acts[":softmax"]
    # jax.nn.dot_product_attention vmaps over head groups: (groups=1, batch, heads, q, k)
    assert probs.shape == (1, B, H, T, T)
    close(probs[0], sowed_weights(attn, x))
    close(y, attn(x))
    assert_clean()


def ablated_attention(head: int) -> Any:
    """An attention_fn that zeroes one head's probabilities: the edit made by hand."""

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, *args: Any, **kw: Any) -> jax.Array:
        w = dot_product_attention_weights(q, k)  # (batch, heads, q, k)
        w = w.at[:, head].set(0.0)
        return jnp.einsum("...hqk,...khd->...qhd", w, v)

    return attention


def zero_head(head: int) -> Any:
    def edit(probs: jax.Array, op: hx.OpContext) -> jax.Array:
        return probs.at[..., head, :, :].set(0.0)  # (..., heads, q, k)

    return edit


@pytest.mark.parametrize("mode", JITS)
def test_zeroing_a_head_equals_editing_the_module_by_hand(mode: str) -> None:
    attn, x = mha(), jax.random.normal(jax.random.key(1), (B, T, D))
    by_hand = nnx.clone(attn)
    by_hand.attention_fn = ablated_attention(1)
    f = JITS[mode](lambda m, x: m(x))
    with hx.intercept_op(zero_head(1), ops=":softmax"):
        got = f(attn, x)
    close(got, by_hand(x))
    assert not np.allclose(got, attn(x))  # outside the block the model is unchanged
    close(f(attn, x), attn(x))
    assert_clean()


def test_edits_are_part_of_the_jit_cache_key() -> None:
    attn, x = mha(), jax.random.normal(jax.random.key(1), (B, T, D))
    traces = []

    @jax.jit
    def f(m: Any, x: jax.Array) -> jax.Array:
        traces.append(1)
        return m(x)

    plain = f(attn, x)
    edit = zero_head(0)
    with hx.intercept_op(edit, ops=":softmax"):
        a = f(attn, x)
    with hx.intercept_op(edit, ops=":softmax"):
        b = f(attn, x)
    with hx.intercept_op(zero_head(1), ops=":softmax"):
        c = f(attn, x)
    close(f(attn, x), plain)
    assert len(traces) == 3  # plain, head 0 (entered twice: one trace), head 1
    close(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, plain)


def test_gradients_of_operations_equal_finite_differences() -> None:
    attn, x = mha(), jax.random.normal(jax.random.key(1), (B, T, D))

    def loss(m: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sin(m(x)))

    value, grads, act_grads = hx.value_and_grad(loss, ops=[":softmax", "query:dot_general"])(
        attn, x
    )
    close(value, loss(attn, x))
    want = nnx.grad(loss)(attn, x)
    jax.tree.map(lambda a, b: close(a, b, 1e-4), nnx.state(grads), nnx.state(want))
    eps = 1e-3
    jitted_loss = nnx.jit(loss)  # the active edit is part of its cache key
    for address, shape in ((":softmax", (1, B, H, T, T)), ("query:dot_general", (B, T, H, D // H))):
        (g,) = act_grads[address]
        assert g.shape == shape
        d = jax.random.normal(jax.random.key(3), shape)
        with hx.intercept_op(lambda v, op, d=d: v + eps * d, ops=address):
            up = jitted_loss(attn, x)
        with hx.intercept_op(lambda v, op, d=d: v - eps * d, ops=address):
            down = jitted_loss(attn, x)
        close((up - down) / (2 * eps), jnp.sum(g * d), 2e-3)
    # jitted with the model as an argument: the same
    _, _, jitted = jax.jit(lambda m, x: hx.value_and_grad(loss, ops=":softmax")(m, x))(attn, x)
    close(jitted[":softmax"][0], act_grads[":softmax"][0])
    assert_clean()


# ---- a decoder scanned over layers, and the same layers in a Python loop --------------------


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn = nnx.MultiHeadAttention(
            num_heads=H, in_features=D, qkv_features=D, decode=False, rngs=rngs
        )
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + self.attn(x)
        return h + jax.nn.gelu(self.mlp(h))


class Scanned(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Layer:
            return Layer(rngs)

        self.layers = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, layer: Layer) -> jax.Array:
            return layer(x)

        return body(x, self.layers)


class Looped(nnx.Module):
    def __init__(self, scanned: Scanned) -> None:
        graphdef, state = nnx.split(scanned.layers)
        self.layers = nnx.List(
            [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(L)]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("mode", JITS)
def test_scanned_decoder_probabilities_edits_and_gradients(mode: str) -> None:
    scanned = Scanned(nnx.Rngs(0))
    looped = Looped(scanned)
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    run = JITS[mode]
    _, got = run(lambda m, x: hx.capture(m, ops="layers/attn:softmax")(x))(scanned, x)
    _, want = hx.capture(looped, ops="layers/*/attn:softmax")(x)
    (stacked,) = got["layers/attn:softmax"]
    assert stacked.shape == (L, 1, B, H, T, T)  # the scan axis first
    for i in range(L):
        close(stacked[i], want[f"layers/{i}/attn:softmax"][0])
    # zeroing head 0 in every layer: scanned (one address) == looped (a glob) == by hand
    with hx.intercept_op(zero_head(0), ops="layers/attn:softmax"):
        edited = run(lambda m, x: m(x))(scanned, x)
    with hx.intercept_op(zero_head(0), ops="layers/*/attn:softmax"):
        edited_loop = looped(x)
    by_hand = nnx.clone(looped)
    for layer in by_hand.layers:
        layer.attn.attention_fn = ablated_attention(0)
    close(edited, by_hand(x))
    close(edited_loop, by_hand(x))
    if mode == "eager":  # eager gradients: test_gradients_of_operations_equal_finite_differences
        assert_clean()
        return
    # gradients with respect to the probabilities, per layer
    loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    _, _, g = run(lambda m, x: hx.value_and_grad(loss, ops="layers/attn:softmax")(m, x))(scanned, x)
    _, _, g2 = hx.value_and_grad(loss, ops="layers/*/attn:softmax")(looped, x)
    for i in range(L):
        close(g["layers/attn:softmax"][0][i], g2[f"layers/{i}/attn:softmax"][0], 1e-4)
    assert_clean()


def test_vmap_around_the_model_adds_the_batch_axis_in_front() -> None:
    attn = mha()
    xs = jax.random.normal(jax.random.key(1), (3, B, T, D))
    _, acts = hx.capture(lambda xs: jax.vmap(attn)(xs), ops=":softmax")(xs)
    (probs,) = acts[":softmax"]
    assert probs.shape == (3, 1, B, H, T, T)
    for i in range(3):
        close(probs[i, 0], sowed_weights(attn, xs[i]))
    _, inner = jax.vmap(lambda x: hx.capture(attn, ops=":softmax")(x))(xs)
    close(inner[":softmax"][0], probs)
    with hx.intercept_op(zero_head(1), ops=":softmax"):
        edited = jax.vmap(attn)(xs)
    by_hand = nnx.clone(attn)
    by_hand.attention_fn = ablated_attention(1)
    close(edited, jax.vmap(by_hand)(xs))
    assert_clean()


# ---- compiled programs ----------------------------------------------------------------------


def _optimized_hlo(f: Any, *args: Any) -> str:
    text = jax.jit(f).lower(*args).compile().as_text()
    text = text.split("\nFileNames")[0]  # debug metadata: source files and stack frames
    text = re.sub(r", metadata=\{[^}]*\}", "", text)  # op names and source lines
    return "\n".join(line for line in text.splitlines() if not line.startswith("HloModule"))


def test_a_noop_edit_compiles_to_the_same_optimized_hlo() -> None:
    scanned, x = Scanned(nnx.Rngs(0)), jnp.ones((B, T, D))
    f = lambda m, x: m(x)  # noqa: E731
    none = _optimized_hlo(f, scanned, x)
    with hx.intercept_op(lambda v, op: None, ops=["**:softmax", "**:dot_general#*"]):
        noop = _optimized_hlo(f, scanned, x)
    assert noop == none


# ---- errors ---------------------------------------------------------------------------------


def test_bad_edits_and_operations_without_a_gradient_raise_clearly() -> None:
    attn, x = mha(), jnp.ones((B, T, D))
    with (
        pytest.raises(hx.HookError, match=r"returned shape \(3,\).*':softmax'"),
        hx.intercept_op(lambda v, op: jnp.zeros(3), ops=":softmax"),
    ):
        attn(x)
    with (
        pytest.raises(hx.HookError, match=r"returned dtype int32.*float32"),
        hx.intercept_op(lambda v, op: jnp.zeros(v.shape, jnp.int32), ops=":softmax"),
    ):
        attn(x)
    with hx.intercept_op(lambda v, op: v * 0 + 1, ops=":softmax"):  # weak Python scalars: fine
        attn(x)
    with (
        pytest.raises(hx.HookaxError, match=r"inside the custom-derivative function ':softmax'"),
        hx.intercept_op(lambda v, op: v, ops=":exp"),
    ):
        attn(x)
    with pytest.raises(hx.HookaxError, match=r"operation ':exp'.*custom derivative"):
        hx.value_and_grad(lambda m, x: m(x).sum(), ops=":exp")(attn, x)
    with pytest.raises(hx.HookError, match="fn\\(value, op\\)"):
        hx.intercept_op(lambda v: v, ops=":softmax")
    assert_clean()
    close(attn(x), mha()(x))  # nothing left behind


# ---- Linen and Equinox ----------------------------------------------------------------------


def test_linen_and_equinox_operations() -> None:
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(nn.Dense(3, name="dense")(x))

    x = jnp.ones((2, 4))
    params = Net().init(jax.random.key(0), x)
    apply = lambda x: Net().apply(params, x)  # noqa: E731
    assert "dense:dot_general" in hx.ops(apply, x).addresses
    y, acts = jax.jit(hx.capture(apply, ops=[":tanh", "dense:dot_general"]))(x)
    close(acts[":tanh"][0], y)
    with hx.intercept_op(lambda v, op: -v, ops=":tanh"):
        close(apply(x), -y)

    mlp = eqx.nn.MLP(4, 2, 5, 2, key=jax.random.key(0))
    addresses = hx.ops(mlp, x[0]).addresses
    assert "layers/0:dot_general" in addresses and ":relu" in addresses
    y, acts = eqx.filter_jit(hx.capture(mlp, ops="layers/2:add"))(x[0])
    close(acts["layers/2:add"][0], y)
    assert_clean()


# ---- transforms written inside the call site ----------------------------------------------


@jax.jit
def helper(x: jax.Array) -> jax.Array:
    return jnp.cos(x) + 1.0


class Inside(nnx.Module):
    """Operations inside jax.checkpoint, lax.scan, lax.cond, while_loop and a jitted helper."""

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.checkpoint(lambda z: jnp.sin(z) * 2.0)(x)
        y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c), None), y, None, length=3)
        y = jax.lax.cond(y.sum() > -100.0, lambda z: jnp.exp(z), lambda z: z - 1.0, y)
        y = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.sqrt(c[1])), (0, y))[1]
        return helper(y)


def inside_by_hand(x: jax.Array, tanh_scale: float = 1.0) -> dict[str, Any]:
    sin = jnp.sin(x)
    y = sin * 2.0
    tanhs = []
    for _ in range(3):
        y = jnp.tanh(y) * tanh_scale
        tanhs.append(y)
    exp = jnp.exp(y)
    sqrt = jnp.sqrt(jnp.sqrt(exp))
    return {"sin": sin, "tanh": jnp.stack(tanhs), "exp": exp, "sqrt": sqrt, "out": helper(sqrt)}


@pytest.mark.parametrize("jit", [False, True])
def test_operations_inside_transforms_within_the_call_site(jit: bool) -> None:
    m, x = Inside(), jnp.linspace(0.1, 1.0, 6).reshape(2, 3)
    addresses = hx.ops(m, x).addresses
    for a in (":checkpoint", ":sin", ":scan", ":tanh", ":cond", ":exp", ":while", ":helper"):
        assert a in addresses
    want = inside_by_hand(x)
    run = jax.jit if jit else (lambda f: f)
    names = [":sin", ":tanh", ":exp", ":sqrt", ":helper", ":cos"]
    y, acts = run(lambda m, x: hx.capture(m, ops=names)(x))(m, x)
    close(y, want["out"])
    close(acts[":sin"][0], want["sin"])
    close(acts[":tanh"][0], want["tanh"])  # stacked on the scan's axis
    close(acts[":exp"][0], want["exp"])  # the branch taken
    close(acts[":sqrt"][0], want["sqrt"])  # the last iteration's value
    close(acts[":helper"][0], want["out"])
    close(acts[":cos"][0], jnp.cos(want["sqrt"]))
    # an edit inside the scan body
    with hx.intercept_op(lambda v, op: v * 0.5, ops=":tanh"):
        edited = run(lambda m, x: m(x))(m, x)
    close(edited, inside_by_hand(x, 0.5)["out"])
    assert_clean()


def test_repeated_capture_of_operations_reuses_the_trace() -> None:
    attn, x = mha(), jnp.ones((B, T, D))
    traces = []

    @jax.jit
    def f(m: Any, x: jax.Array) -> Any:
        traces.append(1)
        return m(x)

    forward = hx.capture(lambda m, x: f(m, x), ops=":softmax")
    _, a = forward(attn, x)
    _, b = forward(attn, x)
    _, c = hx.capture(lambda m, x: f(m, x), ops=":softmax")(attn, x)
    assert len(traces) == 1
    close(a[":softmax"][0], b[":softmax"][0])
    close(a[":softmax"][0], c[":softmax"][0])
    f(attn, x)
    assert len(traces) == 2  # outside the capture: traced again, without marks


def test_named_scopes_label_operations_by_module_path_only() -> None:
    scanned, x = Scanned(nnx.Rngs(0)), jnp.ones((B, T, D))
    f = lambda m, x: m(x)  # noqa: E731
    with hx.named_scopes():
        text = jax.jit(f).lower(scanned, x).compile().as_text()
        labelled = _optimized_hlo(f, scanned, x)
    names = set(re.findall(r'op_name="([^"]*)"', text))
    assert any(n.endswith("layers/attn/query/dot_general") for n in names), sorted(names)[:5]
    assert labelled == _optimized_hlo(f, scanned, x)
    assert_clean()


def test_linen_scan_and_equinox_vmap_inside_the_model() -> None:
    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c: jax.Array, x: Any) -> tuple[jax.Array, jax.Array]:
            h = jnp.tanh(nn.Dense(4, name="d")(c))
            return h, h

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            return scan(name="cell")(x, None)[0]

    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    params = Net().init(jax.random.key(0), x)
    f = lambda x: Net().apply(params, x)  # noqa: E731
    assert hx.ops(f, x).addresses == [
        "cell/d:dot_general",
        "cell/d:reshape",
        "cell/d:add",
        "cell:tanh",
        ":scan",
    ]
    _, acts = jax.jit(hx.capture(f, ops="cell:tanh"))(x)
    c, want = x, []
    for i in range(3):
        d = jax.tree.map(lambda a, i=i: a[i], params["params"]["cell"]["d"])
        c = jnp.tanh(c @ d["kernel"] + d["bias"])
        want.append(c)
    close(acts["cell:tanh"][0], jnp.stack(want))  # stacked on nn.scan's axis

    class M(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x: jax.Array) -> jax.Array:
            return jax.vmap(self.lin)(x)

    m = M(eqx.nn.Linear(4, 3, key=jax.random.key(0)))
    _, acts = hx.capture(m, ops="lin:dot_general")(x)
    close(acts["lin:dot_general"][0], x @ m.lin.weight.T)  # the batch axis in front
    assert_clean()


def test_operations_in_a_shard_map_body_are_stacked_per_shard() -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("data",))

    class M(nnx.Module):
        def __call__(self, x: jax.Array) -> jax.Array:
            body = lambda x: jnp.tanh(x) * 3.0  # noqa: E731
            return jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)

    x = jax.device_put(jnp.linspace(-1, 1, 32).reshape(8, 4), NamedSharding(mesh, P("data")))
    assert ":tanh" in hx.ops(M(), x).addresses
    for f in (lambda m, x: m(x), jax.jit(lambda m, x: m(x))):
        _, acts = hx.capture(f, ops=":tanh")(M(), x)
        (per_shard,) = acts[":tanh"]
        assert per_shard.shape == (4, 2, 4)
        close(per_shard.reshape(8, 4), jnp.tanh(x))
        with hx.intercept_op(lambda v, op: -v, ops=":tanh"):
            close(f(M(), x), -3.0 * jnp.tanh(x))
    assert_clean()


def test_a_noop_edit_of_every_operation_changes_nothing() -> None:
    scanned, x = Scanned(nnx.Rngs(0)), jax.random.normal(jax.random.key(2), (B, T, D))
    want = scanned(x)
    seen: list[str] = []

    def noop(v: Any, op: hx.OpContext) -> None:
        seen.append(op.address)

    with hx.intercept_op(noop, ops="**:*#*"):  # inside custom_jvp functions too: None is fine
        got = jax.jit(lambda m, x: m(x))(scanned, x)
    close(got, want)
    assert "layers/attn:softmax" in seen and "layers/attn:exp" in seen
    assert_clean()


def test_no_tracer_is_kept_alive_by_a_reference_cycle() -> None:
    """Linen's leak test, with every operation edited (a no-op): without the cycle collector."""
    import gc
    from unittest import mock

    model = nn.Sequential([nn.Dense(8)])

    @jax.jit
    @jax.vmap
    def sample(rng: jax.Array) -> jax.Array:
        params = model.init(rng, jnp.zeros((2, 8)))
        return model.apply(params, jnp.ones((2, 8)))

    with (
        hx.intercept_op(lambda v, op: None, ops="**:*#*"),
        mock.patch.object(gc, "collect", return_value=0),
        jax.checking_leaks(),
    ):
        for i in range(2):
            sample(jax.random.split(jax.random.key(i), 4)).block_until_ready()
    assert_clean()


@pytest.mark.skipif(
    not hasattr(nnx, "with_vars"), reason="hijax variables: newer Flax than the oldest supported"
)
def test_nnx_variables_as_inputs_of_operations() -> None:
    """Flax's mutable-array example (hijax variables reach primitives as inputs), edited."""
    import optax

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(2, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, use_running_average=False, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return nnx.relu(self.bn(self.linear(x)))

    with nnx.var_defaults(hijax=True):
        model = Model(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (4, 2))

    @jax.jit
    def train_step(x: jax.Array) -> jax.Array:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params: Any) -> jax.Array:
            return (nnx.merge(graphdef, params, rest)(x) ** 2).mean()

        loss, grads = jax.value_and_grad(loss_fn)(nnx.with_vars(params, hijax=False))
        optimizer.update(model, grads)
        return loss

    try:  # the example as Flax 0.12.8 wrote it; newer Flax wants ref=True variables, which
        # JAX 0.12's grad refuses: it does not run there even without hookax
        with jax.numpy_dtype_promotion("standard"):
            train_step(x)
    except (flax.errors.ImmutableVariableError, TypeError) as e:
        pytest.skip(f"Flax's mutable-array example does not run on this Flax and JAX: {e}")
    seen: list[hx.OpContext] = []
    with (
        jax.numpy_dtype_promotion("standard"),  # optax's adam mixes Python floats and int32
        hx.intercept_op(lambda v, op: seen.append(op), ops="bn:*#*"),
    ):
        train_step(x)
    assert seen and all(op.key == "bn" for op in seen)
    assert seen[0].name == "get_variable"  # reads a hijax variable: its input is no array
    assert_clean()
