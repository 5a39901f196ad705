"""Programs without modules: call sites from the program's own functions and named scopes.

A small transformer-like program written as functions over a list of weight dicts (a Python loop
over layers, ``jax.named_scope`` blocks, a ``jnp.einsum`` whose own scope is JAX's) and its
scanned twin (``lax.scan`` over stacked weights). Every value is compared with the program
edited by hand; every behaviour runs eagerly and under ``jax.jit`` with the weights as an
argument, with trace counts where a cache is involved.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hookax as hx

D, T, L = 4, 5, 3


def attn(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    with jax.named_scope("attention"):
        s = jnp.einsum("td,sd->ts", x @ w["q"], x @ w["k"])
        p = jax.nn.softmax(s, axis=-1)
        return p @ x


def mlp(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    with jax.named_scope("ffn"):
        h = jnp.tanh(x @ w["up"])
    return h @ w["down"]


def block(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    x = x + attn(x, w)
    return x + mlp(x, w)


def forward(weights: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for w in weights:
        x = block(x, w)
    return x


def forward_scan(stacked: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    def body(x: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        return block(x, w), None

    return jax.lax.scan(body, x, stacked)[0]


def loss(weights: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    return jnp.mean(forward(weights, x) ** 2)


def _weights() -> list[dict[str, jax.Array]]:
    keys = iter(jax.random.split(jax.random.key(0), 4 * L))
    shapes = {"q": (D, D), "k": (D, D), "up": (D, 2 * D), "down": (2 * D, D)}
    return [
        {n: jax.random.normal(next(keys), s) / np.sqrt(s[0]) for n, s in shapes.items()}
        for _ in range(L)
    ]


W = _weights()
STACKED = jax.tree.map(lambda *a: jnp.stack(a), *W)
X = jax.random.normal(jax.random.key(1), (T, D))
X_CORRUPT = X[::-1]


def hand(x: jax.Array, edit: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The program unrolled by hand: its output and every call site's value by key;
    ``edit(key, value) -> value`` replaces a value where the program reads it."""
    edit = edit or (lambda k, v: v)
    vals: dict[str, jax.Array] = {}
    for i, w in enumerate(W):
        s = jnp.einsum("td,sd->ts", x @ w["q"], x @ w["k"])
        vals[f"block/{i}/attn/attention:softmax"] = p = jax.nn.softmax(s, axis=-1)
        a = edit(f"block/{i}/attn/attention", p @ x)
        vals[f"block/{i}/attn/attention"] = a
        a = edit(f"block/{i}/attn", a)
        vals[f"block/{i}/attn"] = a
        x = x + a
        h = edit(f"block/{i}/mlp/ffn", jnp.tanh(x @ w["up"]))
        vals[f"block/{i}/mlp/ffn"] = h
        m = edit(f"block/{i}/mlp", h @ w["down"])
        vals[f"block/{i}/mlp"] = m
        x = edit(f"block/{i}", x + m)
        vals[f"block/{i}"] = x
    return x, vals


def close(a: Any, b: Any, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


JIT = [pytest.param(False, id="eager"), pytest.param(True, id="jit")]


def _maybe_jit(f: Any, jit: bool) -> Any:
    return jax.jit(f) if jit else f


# ---------------------------------------------------------------------------------------------
# Keys


def test_keys_read_like_the_code() -> None:
    """Each function call and user scope is a call site; a name called more than once under one
    parent is numbered; JAX's own scopes (einsum's subscripts) are not call sites."""
    _, acts = hx.capture(forward)(W, X)
    want = [""]
    for i in range(L):
        want += [f"block/{i}/attn/attention", f"block/{i}/attn", f"block/{i}/mlp/ffn"]
        want += [f"block/{i}/mlp", f"block/{i}"]
    assert sorted(acts) == sorted(want)


@pytest.mark.parametrize("jit", JIT)
def test_capture_is_the_hand_unrolled_program(jit: bool) -> None:
    y, acts = _maybe_jit(hx.capture(forward), jit)(W, X)
    want_y, vals = hand(X)
    close(y, want_y)
    close(acts[""][0], want_y)
    for k, v in vals.items():
        if ":" not in k:
            close(acts[k][0], v)
            assert len(acts[k]) == 1


@pytest.mark.parametrize("jit", JIT)
def test_a_scanned_function_is_one_call_site_with_layers(jit: bool) -> None:
    """A function a ``lax.scan`` body calls (through a local function that only calls it) is
    one call site, its layers stacked and one of them by ``[i]``."""
    _, vals = hand(X)
    where = ["block", "block[1]", "block/attn/attention"]
    y, acts = _maybe_jit(hx.capture(forward_scan, where=where), jit)(STACKED, X)
    close(y, hand(X)[0])
    close(acts["block"][0], jnp.stack([vals[f"block/{i}"] for i in range(L)]))
    close(acts["block[1]"][0], vals["block/1"])
    close(acts["block/attn/attention"][0][2], vals["block/2/attn/attention"])


@pytest.mark.parametrize("jit", JIT)
def test_operations_inside_call_sites(jit: bool) -> None:
    _, vals = hand(X)
    _, acts = _maybe_jit(hx.capture(forward, ops="block/*/attn/attention:softmax"), jit)(W, X)
    assert sorted(acts) == [f"block/{i}/attn/attention:softmax" for i in range(L)]
    for k, v in acts.items():
        close(v[0], vals[k])
    _, acts = hx.capture(forward_scan, ops="block/attn/attention[2]:softmax")(STACKED, X)
    close(acts["block/attn/attention[2]:softmax"][0], vals["block/2/attn/attention:softmax"])


def test_ops_lists_the_programs_operations() -> None:
    table = hx.ops(forward, W, X)
    text = str(table)
    assert "block/1/attn/attention:dot_general" in text
    assert "block/2/mlp/ffn:tanh" in text
    assert f"in {4 * L} call sites" in text  # those with operations of their own


# ---------------------------------------------------------------------------------------------
# Edits


@pytest.mark.parametrize("jit", JIT)
def test_an_interceptor_steers_one_layer(jit: bool) -> None:
    """An interceptor's edit of a function's result is what the rest of the program reads;
    under ``jax.jit`` the plain trace is not reused inside the block, nor the edited one
    after it."""
    traces = []

    def prog(weights: Any, x: jax.Array) -> jax.Array:
        traces.append(1)
        return hx.program(forward)(weights, x)

    f = _maybe_jit(prog, jit)
    plain = f(W, X)
    v = jnp.arange(D, dtype=jnp.float32)

    def steer(next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
        return next_fun(*args, **kwargs) + v

    with hx.intercept(steer, where="block/1/mlp"):
        got = f(W, X)
    close(got, hand(X, lambda k, val: val + v if k == "block/1/mlp" else val)[0])
    close(f(W, X), plain)
    if jit:
        f(W, X)
        assert len(traces) == 2  # plain, steered; the plain trace reused after the block


def test_forward_hooks_and_pre_hooks_on_function_call_sites() -> None:
    """A forward pre-hook receives the function's arguments and may replace them; a forward
    hook receives its result."""
    seen: list[Any] = []

    def pre(site: Any, args: tuple) -> Any:
        seen.append(site)
        return (args[0] * 0, args[1])

    with hx.hooks(where="block/0/mlp", forward_pre=pre):
        got = hx.program(forward)(W, X)
    assert [s.path for s in seen] == [("block", 0, "mlp")]
    # mlp(0, w) = tanh(0) @ w["down"] = 0
    close(got, hand(X, lambda k, val: val * 0 if k == "block/0/mlp" else val)[0])


def test_a_named_scope_output_edited() -> None:
    def zero(next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
        return jnp.zeros_like(next_fun(*args, **kwargs))

    with hx.intercept(zero, where="block/2/attn/attention"):
        got = jax.jit(hx.program(forward))(W, X)
    close(got, hand(X, lambda k, v: v * 0 if k == "block/2/attn/attention" else v)[0])


def test_a_hook_that_changes_the_structure_is_an_error() -> None:
    def bad(next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
        return (next_fun(*args, **kwargs), 1.0)

    with pytest.raises(hx.HookError, match="block/1"), hx.intercept(bad, where="block/1"):
        hx.program(forward)(W, X)
    close(hx.program(forward)(W, X), hand(X)[0])  # nothing left behind


# ---------------------------------------------------------------------------------------------
# Gradients, patching, diagnostics


@pytest.mark.parametrize("jit", JIT)
def test_activation_gradients_are_the_perturbed_programs(jit: bool) -> None:
    value, grads, act = _maybe_jit(hx.value_and_grad(loss, where="forward/block/*"), jit)(W, X)

    def perturbed(d: jax.Array, i: int) -> jax.Array:
        y, _ = hand(X, lambda k, v: v + d if k == f"block/{i}" else v)
        return jnp.mean(y**2)

    close(value, loss(W, X))
    jax.tree.map(close, grads, jax.grad(loss)(W, X))
    for i in range(L):
        close(act[f"forward/block/{i}"][0], jax.grad(perturbed)(jnp.zeros((T, D)), i))


def test_patch_grid_is_the_hand_patched_grid() -> None:
    def metric(y: jax.Array) -> jax.Array:
        return y[-1].sum()

    grid = hx.patch_grid(forward, (W, X), (W, X_CORRUPT), metric, where="block/*", axis=0)
    _, clean = hand(X)
    want = np.zeros((L, T))
    for i in range(L):
        for t in range(T):
            y, _ = hand(
                X_CORRUPT,
                lambda k, v, i=i, t=t: v.at[t].set(clean[k][t]) if k == f"block/{i}" else v,
            )
            want[i, t] = metric(y)
    close(grid, want, 1e-4)
    est = hx.attribution_patch(forward, (W, X), (W, X_CORRUPT), metric, where="block/*", axis=0)
    assert np.shape(est) == (L, T)


def test_find_nonfinite_names_the_function_and_layer() -> None:
    bad = [dict(w) for w in W]
    bad[1]["up"] = bad[1]["up"].at[0, 0].set(jnp.nan)
    found = hx.find_nonfinite(loss, bad, X, where="forward/block/*")
    assert found is not None and found.key == "forward/block/1"
    assert hx.find_nonfinite(loss, W, X) is None


def test_statistics_in_a_jitted_step() -> None:
    step = jax.jit(hx.value_grad_and_stats(loss, where="forward/block/*/mlp"))
    value, grads, stats = step(W, X)
    close(value, loss(W, X))
    jax.tree.map(close, grads, jax.grad(loss)(W, X))
    _, vals = hand(X)
    assert set(stats) == {f"forward/block/{i}/mlp" for i in range(L)}
    for i in range(L):
        act = stats[f"forward/block/{i}/mlp"]["act"]
        close(act["norm"], jnp.linalg.norm(vals[f"block/{i}/mlp"]))
        close(act["max_abs"], jnp.abs(vals[f"block/{i}/mlp"]).max())


# ---------------------------------------------------------------------------------------------
# Never silent


def test_a_where_that_matches_nothing_names_what_ran() -> None:
    with pytest.raises(hx.SelectorError, match="block/0"):
        hx.capture(forward, where="layers/*")(W, X)


def test_ops_naming_a_call_site_without_operations_says_so() -> None:
    with pytest.raises(hx.SelectorError, match="no operation of their own"):
        hx.capture(forward, ops=":softmax")(W, X)


def test_a_program_is_idle_without_hookax() -> None:
    """``hx.program(f)`` outside hookax's blocks is ``f``: the same values, the same jaxpr."""
    p = hx.program(forward)
    assert str(jax.make_jaxpr(p)(W, X)) == str(jax.make_jaxpr(forward)(W, X))


# ---------------------------------------------------------------------------------------------
# Sharding idioms of jax-llm-examples: an Explicit mesh, a function decorated with auto_axes


def _explicit_mesh() -> Any:
    from jax.sharding import AxisType

    if jax.device_count() < 2:
        pytest.skip("needs 2 (CPU) devices")
    return jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])


def _auto_axes_program() -> Any:
    """``heads``, decorated with ``auto_axes`` (its body runs with the mesh's axes Auto, as
    jax-llm-examples' ``attention``), called by ``forward`` under an Explicit mesh; ``HEADS`` a
    hand edit of its output ``[B, H, T, E]``."""
    from functools import partial

    from jax.sharding import PartitionSpec as P
    from jax.sharding import auto_axes

    @partial(auto_axes, out_sharding=P("x", None, None, None))
    def heads(q: jax.Array) -> jax.Array:
        p = jax.nn.softmax(jnp.einsum("bhte,bhse->bhts", q, q), axis=-1)
        return jnp.einsum("bhts,bhse->bhte", p, q)

    def forward(w: dict[str, jax.Array], x: jax.Array, edit: Any = None) -> jax.Array:
        o = heads(jnp.einsum("btd,dhe->bhte", x, w["q"]))
        o = o if edit is None else edit(o)
        return jnp.einsum("bhte,hed->btd", o, w["o"])

    return forward


def _sharded_case(mesh: Any) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    w = {
        "q": jax.random.normal(jax.random.key(0), (D, 2, 3)),
        "o": jax.random.normal(jax.random.key(1), (2, 3, D)),
    }
    x = jax.random.normal(jax.random.key(2), (2, T, D))
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    return w, x, x[:, ::-1]


def _metric(y: jax.Array) -> jax.Array:
    from jax.sharding import PartitionSpec as P
    from jax.sharding import reshard

    return reshard(y, P())[0, -1].sum()


def test_hooks_stats_and_head_patching_inside_an_auto_axes_function() -> None:
    """Under an Explicit mesh, a function that ``auto_axes`` decorates computes with Auto
    axes: an interceptor on it, the statistics' probes (gradients) of its output and the
    patching of one head of it run in its context, and equal the same edits by hand."""
    mesh = _explicit_mesh()
    forward = _auto_axes_program()
    with jax.sharding.set_mesh(mesh):
        w, x, corrupt = _sharded_case(mesh)

        def double(next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
            return next_fun(*args, **kwargs) * 2

        with hx.intercept(double, where="heads"):
            got = jax.jit(hx.program(forward))(w, x)
        close(got, forward(w, x, edit=lambda o: o * 2))

        def loss(w: Any, x: jax.Array) -> jax.Array:
            return jnp.mean(forward(w, x) ** 2)

        _, _, stats = jax.jit(hx.value_grad_and_stats(loss, where="**", stats=("norm",)))(w, x)
        want_o: list[Any] = []
        forward(w, x, edit=lambda o: want_o.append(o) or o)
        d = jax.grad(lambda e: jnp.mean(forward(w, x, edit=lambda o: o + e) ** 2))(want_o[0] * 0)
        close(stats["forward/heads"]["act"]["norm"], jnp.linalg.norm(want_o[0]))
        close(stats["forward/heads"]["grad"]["norm"], jnp.linalg.norm(d))

        grid = hx.patch_grid(forward, (w, x), (w, corrupt), _metric, where="heads", heads=1, axis=2)
        clean: list[Any] = []
        forward(w, x, edit=lambda o: clean.append(o) or o)
        want = np.zeros((1, 2, T))
        for h in range(2):
            for t in range(T):

                def patch(o: jax.Array, h: int = h, t: int = t) -> jax.Array:
                    return o.at[:, h, t].set(clean[0][:, h, t])

                want[0, h, t] = _metric(forward(w, corrupt, edit=patch))
        close(grid, want, 1e-4)
