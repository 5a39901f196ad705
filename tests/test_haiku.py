"""Haiku: call sites keyed by Haiku's module names, through transform, jit, vmap, remat, scans.

Every value is compared with the same computation written by hand from the parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hookax as hx
from hookax._engine import context as _context

hk = pytest.importorskip("haiku")

from hookax.frameworks import _haiku  # noqa: E402  (after haiku: the adapter imports it)

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


def close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


class Block(hk.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(hk.Linear(4, name="lin")(x))

    def encode(self, x: jax.Array) -> jax.Array:
        return hk.Linear(4)(x) * 2


def nested(x: jax.Array) -> jax.Array:
    y = hk.nets.MLP([4, 4], name="mlp")(x)
    block = Block()
    with hk.name_scope("scope"):
        z = hk.Linear(4, name="inner")(y)
    return block(y) + block.encode(z)


def stacked(x: jax.Array) -> jax.Array:
    x = hk.Linear(4, name="embed")(x)
    return hk.layer_stack(3, name="layers")(lambda x: Block(name="block")(x))(x)


def lin(params: Any, name: str, x: jax.Array, i: int | None = None) -> jax.Array:
    p = params[name]
    w, b = (p["w"], p["b"]) if i is None else (p["w"][i], p["b"][i])
    return x @ w + b


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
        self.seen.append((ctx.key, type(ctx.module).__name__))
        return next_fun(*args, **kwargs)


def double(next_fun: Any, args: tuple, kwargs: dict, ctx: hx.Context) -> Any:
    return next_fun(*args, **kwargs) * 2


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Any:
    yield
    assert _context.active_entries() == ()
    assert _context.call_stack() == []
    assert _haiku._LOCAL.fresh == {} and _haiku._LOCAL.lifted == {}


def test_haiku_path() -> None:
    assert _haiku.haiku_path("mlp/~/linear_0") == ("mlp", "linear_0")
    assert _haiku.haiku_path("a/~/b/~/c") == ("a", "b", "c")
    assert _haiku.haiku_path("block/~encode/linear") == ("block", "~encode", "linear")


def test_keys_of_nested_modules_and_methods() -> None:
    t = hk.transform(nested)
    params = t.init(jax.random.key(0), X)
    rec = Recorder()
    with hx.intercept(rec):
        y = t.apply(params, None, X)
    assert rec.seen == [
        ("mlp", "MLP"),
        ("mlp/linear_0", "Linear"),
        ("mlp/linear_1", "Linear"),
        ("scope/inner", "Linear"),
        ("block", "Block"),
        ("block/lin", "Linear"),
        ("block:encode", "Block"),
        ("block/~encode/linear", "Linear"),
    ]
    # Haiku's parameter names map to the same keys
    assert {_context.path_str(_haiku.haiku_path(n)) for n in params} == {
        k for k, _ in rec.seen if ":" not in k and k not in ("mlp", "block")
    }
    # the values: hand-written from the parameters
    h = lin(params, "mlp/~/linear_1", jax.nn.relu(lin(params, "mlp/~/linear_0", X)))
    z = lin(params, "scope/inner", h)
    close(y, jnp.tanh(lin(params, "block/lin", h)) + 2 * lin(params, "block/~encode/linear", z))
    _, acts = hx.capture(t.apply, where=["mlp/*", "block:encode"])(params, None, X)
    assert list(acts) == ["mlp/linear_0", "mlp/linear_1", "block:encode"]
    close(acts["mlp/linear_1"][0], h)


def test_layer_stack_layers_by_suffix() -> None:
    t = hk.transform(stacked)
    params = t.init(jax.random.key(0), X)
    assert params["layers/block/lin"]["w"].shape == (3, 4, 4)
    h = [lin(params, "embed", X)]
    for i in range(3):
        h.append(jnp.tanh(lin(params, "layers/block/lin", h[-1], i)))
    apply = jax.jit(lambda p, x: hx.capture(t.apply, where="layers/**")(p, None, x))
    y, acts = apply(params, X)
    close(y, h[3])
    assert list(acts) == ["layers/block", "layers/block/lin"]
    close(acts["layers/block"][0], jnp.stack(h[1:]))  # one entry, the layers stacked
    # one layer by its suffix
    y, acts = hx.capture(t.apply, where="layers/block[2]")(params, None, X)
    close(acts["layers/block[2]"][0], h[3])
    # operations inside call sites, by the addresses hx.ops lists
    listed = [r.address for r in hx.ops(t.apply, params, None, X, where="layers/**")]
    assert listed[:2] == ["layers/block/lin:dot_general", "layers/block/lin:broadcast_in_dim"]
    _, vals = hx.capture(t.apply, ops="layers/block/lin:dot_general")(params, None, X)
    w = params["layers/block/lin"]["w"]
    close(vals["layers/block/lin:dot_general"][0], jnp.stack([h[i] @ w[i] for i in range(3)]))
    with hx.intercept(double, where="layers/block[1]"):
        y = t.apply(params, None, X)
    close(y, jnp.tanh(lin(params, "layers/block/lin", 2 * h[2], 2)))
    with hx.patching({"layers/block[0]": jnp.zeros((3, 4))}):
        y = t.apply(params, None, X)
    zero = jnp.zeros((3, 4))
    after = jnp.tanh(lin(params, "layers/block/lin", zero, 1))
    close(y, jnp.tanh(lin(params, "layers/block/lin", after, 2)))


def test_layer_stack_inside_a_module() -> None:
    class Tower(hk.Module):
        def __call__(self, x: jax.Array) -> jax.Array:
            return hk.layer_stack(2, name="layers")(lambda x: Block(name="block")(x))(x)

    t = hk.transform(lambda x: Tower()(x))
    params = t.init(jax.random.key(0), X)
    assert list(params) == ["tower/layers/block/lin"]
    rec = Recorder()
    with hx.intercept(rec):
        t.apply(params, None, X)
    assert rec.seen == [
        ("tower", "Tower"),
        ("tower/layers/block", "Block"),
        ("tower/layers/block/lin", "Linear"),
    ]


def test_scan_vmap_remat_and_state() -> None:
    def f(x: jax.Array) -> jax.Array:
        core = Block(name="core")
        if hk.running_init():
            core(x)
        x, _ = hk.scan(lambda c, _: (core(c), None), x, None, length=2)
        x = hk.vmap(lambda z: hk.Linear(4, name="vlin")(z), split_rng=False)(x)
        x = hk.remat(lambda z: Block(name="rblock")(z))(x)
        count = hk.get_state("count", [], init=jnp.zeros)
        hk.set_state("count", count + 1)
        return x

    t = hk.transform_with_state(f)
    params, state = t.init(jax.random.key(0), X)
    h1 = jnp.tanh(lin(params, "core/lin", X))
    h2 = jnp.tanh(lin(params, "core/lin", h1))
    v = lin(params, "vlin", h2)
    r = jnp.tanh(lin(params, "rblock/lin", v))
    forward = jax.jit(hx.capture(t.apply))
    (y, new_state), acts = forward(params, state, None, X)
    close(y, r)
    close(new_state["~"]["count"], 1.0)
    assert set(acts) == {"core", "core/lin", "vlin", "rblock", "rblock/lin"}
    close(acts["core"][0], jnp.stack([h1, h2]))  # hk.scan: the iterations stacked
    close(acts["vlin"][0], v)  # hk.vmap: the batch axis back
    close(acts["rblock"][0], r)
    _, acts = hx.capture(t.apply, where="core[1]")(params, state, None, X)
    close(acts["core[1]"][0], h2)
    # gradients of intermediates, through hk.remat and hk.scan
    loss = lambda p, x: jnp.sum(t.apply(p, state, None, x)[0] ** 2)  # noqa: E731
    _, _, act_grads = hx.value_and_grad(loss, where=["rblock", "vlin"])(params, X)
    close(act_grads["rblock"][0], 2 * r)
    close(act_grads["vlin"][0], (2 * r * (1 - r**2)) @ params["rblock/lin"]["w"].T)


def test_jit_retraces_for_an_interceptor_added_later(traces: Any) -> None:
    t = hk.transform(nested)
    params = t.init(jax.random.key(0), X)

    @jax.jit
    def f(p: Any, x: jax.Array) -> jax.Array:
        traces()
        return t.apply(p, None, x)

    plain = f(params, X)
    block = hx.Select(paths="block", methods="__call__")
    with hx.intercept(double, where=block):
        doubled = f(params, X)
    block_out = hx.capture(t.apply, where="block")(params, None, X)[1]["block"][0]
    close(doubled, plain + block_out)
    close(f(params, X), plain)
    with hx.intercept(double, where=block):
        close(f(params, X), doubled)
    assert traces.n == 2


def test_haiku_interceptors_still_work() -> None:
    t = hk.transform(nested)
    params = t.init(jax.random.key(0), X)
    seen: list[tuple[str, str]] = []

    def haiku_interceptor(next_f: Any, args: tuple, kwargs: dict, context: Any) -> Any:
        seen.append((getattr(context.module, "module_name", None), context.method_name))
        return next_f(*args, **kwargs)

    with hk.intercept_methods(haiku_interceptor):
        plain = t.apply(params, None, X)
    before = list(seen)
    seen.clear()
    rec = Recorder()
    with hk.intercept_methods(haiku_interceptor), hx.intercept(rec):
        close(t.apply(params, None, X), plain)
    assert seen == before  # Haiku's interceptor sees the same calls with hookax active
    assert ("mlp/~/linear_0", "__call__") in before and len(rec.seen) == 8


def test_nothing_left_after_an_exception() -> None:
    t = hk.transform(stacked)
    params = t.init(jax.random.key(0), X)

    class Boom(Exception):
        pass

    def bad(m: Any, args: tuple, output: Any) -> Any:
        raise Boom

    with pytest.raises(Boom) as info, hx.hooks(where="layers/block/lin", forward=bad):
        t.apply(params, None, X)
    assert any("layers/block/lin" in n for n in info.value.__notes__)
    close(t.apply(params, None, X), hx.capture(t.apply)(params, None, X)[0])


def test_summary_counts_params_and_state() -> None:
    class Mean(hk.Module):  # a running mean in Haiku state
        def __call__(self, x: jax.Array) -> jax.Array:
            mean = hk.get_state("mean", [4], init=jnp.zeros)
            hk.set_state("mean", 0.9 * mean + 0.1 * x.mean(0))
            return x - mean + hk.get_parameter("shift", [4], init=jnp.zeros)

    def f(x: jax.Array) -> jax.Array:
        return Mean(name="norm")(stacked(x))

    s = hx.summary(hk.transform_with_state(f), jax.ShapeDtypeStruct((3, 4), jnp.float32))
    assert [r.key for r in s.rows] == ["", "embed", "layers/block", "layers/block/lin", "norm"]
    assert [r.type for r in s.rows] == ["f", "Linear", "Block", "Linear", "Mean"]
    assert [r.params for r in s.rows] == [84, 20, 60, 60, 4]
    assert [r.depth for r in s.rows] == [0, 1, 1, 2, 1]
    assert s.totals.params == 84
    assert [(c, n) for c, n, _ in s.rows[-1].state] == [("state", 4)]
    assert [(c, n) for c, n, _ in s.rows[0].state] == [("state", 4)]
    assert [r.trips for r in s.rows] == [1, 1, 3, 3, 1]
    assert s.rows[1].flops == 2 * 3 * 4 * 4 + 12  # embed alone, not the whole function
    assert s.rows[0].flops == s.totals.flops
    # one layer lowered alone, times the layers (XLA counts tanh apart, as transcendentals)
    assert [r.flops for r in s.rows[2:4]] == [3 * (2 * 3 * 4 * 4 + 12)] * 2


def test_errors_name_the_fix() -> None:
    def f(x: jax.Array) -> jax.Array:
        return hk.Linear(2)(x)

    t = hk.transform(f)
    with pytest.raises(hx.HookaxError, match=r"hx.capture of a Haiku Transformed.*t\.apply"):
        hx.capture(t)
    with pytest.raises(ValueError, match=r"inside an `hk\.transform`") as info:
        hx.capture(f)(X)
    assert any("hx.capture(t.apply)(params, rng, x)" in n for n in info.value.__notes__)
    with pytest.raises(hx.HookaxError, match=r"Haiku modules are created anew.*hx\.hooks\("):
        hx.register_forward_hook(t, lambda m, a, o: None)
    with pytest.raises(hx.HookaxError, match=r"hx\.summary\(t, x\)"):
        hx.summary(t.apply, None, None, X)
    made: list[Any] = []
    hk.transform(lambda: made.append(hk.Linear(2))).init(None)
    with pytest.raises(hx.HookaxError, match=r"Haiku Linear module.*hx\.summary\(t, x\)"):
        hx.summary(made[0], X)
    params = t.init(jax.random.key(0), X)
    with pytest.raises(hx.SelectorError):
        hx.capture(t.apply, where="nothing/*")(params, None, X)


def test_cli_factory(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    from hookax._cli.main import main

    (tmp_path / "hk_models.py").write_text(
        "import haiku as hk\n\n"
        "def make():\n"
        "    return hk.transform(lambda x: hk.nets.MLP([16, 4], name='mlp')(x))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["summary", "hk_models:make", "--input", "f32[8,5]", "--json"]) in (0, None)
    out = capsys.readouterr().out
    import json

    rows = json.loads(out)["rows"]
    assert [(r["key"], r["params"]) for r in rows] == [
        ("", 164),
        ("mlp", 164),
        ("mlp/linear_0", 96),
        ("mlp/linear_1", 68),
    ]
    assert main(["ops", "hk_models:make", "--input", "f32[8,5]", "--where", "mlp/linear_1"]) in (
        0,
        None,
    )
    assert "mlp/linear_1:dot_general" in capsys.readouterr().out


def test_patching_grids_statistics_and_nonfinite() -> None:
    t = hk.transform(stacked)
    params = t.init(jax.random.key(0), X)
    apply = lambda p, x: t.apply(p, None, x)  # noqa: E731
    metric = lambda y: jnp.sum(y[:, 0])  # noqa: E731

    def layers(h: jax.Array, start: int) -> jax.Array:
        for i in range(start, 3):
            h = jnp.tanh(lin(params, "layers/block/lin", h, i))
        return h

    clean, corrupt = lin(params, "embed", X), lin(params, "embed", -X)
    clean1, corrupt1 = (jnp.tanh(lin(params, "layers/block/lin", e, 0)) for e in (clean, corrupt))
    clean2, corrupt2 = (jnp.tanh(lin(params, "layers/block/lin", h, 1)) for h in (clean1, corrupt1))
    cols = jnp.arange(4)[None, :]
    want = jnp.stack(
        [
            jnp.stack([metric(layers(jnp.where(cols == p, clean, corrupt), 0)) for p in range(4)]),
            jnp.stack(
                [metric(layers(jnp.where(cols == p, clean2, corrupt2), 2)) for p in range(4)]
            ),
        ]
    )
    where = ["embed", "layers/block[1]"]
    grid = hx.patch_grid(apply, (params, X), (params, -X), metric, where=where)
    close(grid, want)
    # attribution: the gradient at the corrupted run times (clean - corrupt), per position
    est = hx.attribution_patch(apply, (params, X), (params, -X), metric, where=where)
    g_embed = jax.grad(lambda e: metric(layers(e, 0)))(corrupt)
    g_two = jax.grad(lambda h: metric(layers(h, 2)))(corrupt2)
    close(
        est, jnp.stack([((clean - corrupt) * g_embed).sum(0), ((clean2 - corrupt2) * g_two).sum(0)])
    )

    def loss(p: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(apply(p, x) ** 2)

    _, _, stats = hx.value_grad_and_stats(loss, where="layers/block[2]")(params, X)
    y = layers(clean, 0)
    close(stats["layers/block[2]"]["act"]["norm"], jnp.linalg.norm(y))
    close(stats["layers/block[2]"]["grad"]["max_abs"], jnp.max(jnp.abs(2 * y)))
    assert hx.find_nonfinite(loss, params, X) is None
    stack = params["layers/block/lin"]
    bad = {**params, "layers/block/lin": {**stack, "b": stack["b"].at[1, 0].set(jnp.inf)}}
    nf = hx.find_nonfinite(loss, bad, X)
    assert nf is not None
    assert (nf.phase, nf.label, nf.count, nf.before) == (
        "forward",
        "layers/block/lin[1]",
        3,
        "layers/block[0]",
    )


def test_harvest_and_profile(tmp_path: Any) -> None:
    pytest.importorskip("tensorstore")
    t = hk.transform(stacked)
    params = t.init(jax.random.key(0), X)

    def forward(x: jax.Array) -> jax.Array:
        return t.apply(params, None, x)

    data = [X, 2 * X]
    where = ["embed", "layers/block"]
    h = hx.harvest(forward, data, where=where, store=str(tmp_path / "acts"))
    assert sorted(h.names) == [
        "embed",
        "layers/block[0]",
        "layers/block[1]",
        "layers/block[2]",
    ]
    embed = jnp.concatenate([lin(params, "embed", x) for x in data])
    close(h.read("embed"), embed)
    close(h.read("layers/block[0]"), jnp.tanh(lin(params, "layers/block/lin", embed, 0)))
    prof = hx.profile(forward, X, runs=1, warmup=1)
    assert {"embed", "layers/block", "layers/block/lin"} <= {r.key for r in prof.rows}


def test_no_op_scopes_compile_the_same_program() -> None:
    t = hk.transform(nested)
    params = t.init(jax.random.key(0), X)
    plain = jax.jit(t.apply).lower(params, None, X).as_text()
    with hx.intercept(lambda f, a, k, ctx: f(*a, **k)):
        intercepted = jax.jit(t.apply).lower(params, None, X).as_text()
    with hx.hooks(forward=lambda m, a, o: None):
        hooked = jax.jit(t.apply).lower(params, None, X).as_text()
    assert plain == intercepted == hooked


def test_a_haiku_function_is_no_program_without_modules(monkeypatch: Any) -> None:
    from hookax._transforms import program

    def no_discovery(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a Haiku function was traced as a program without modules")

    monkeypatch.setattr(program, "discover", no_discovery)
    t = hk.transform(nested)
    params = t.init(jax.random.key(0), X)
    _, acts = hx.capture(t.apply, where="mlp")(params, None, X)
    _, again = hx.capture(lambda p, x: t.apply(p, None, x), where="mlp")(params, X)
    close(acts["mlp"][0], again["mlp"][0])
