"""One ``where=`` grammar: a list of patterns (strings, ``"path:method"``, classes, callables,
``hx.Select``) is their union in every API, each entry with the API's default methods unless it
names its own; targets of a patching grid come in the list's order."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context


class Head(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.lin(x)


class Net(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.embed = nnx.Linear(2, 3, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs) for _ in range(2)])
        self.head = Head(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.encode(x)
        for layer in self.layers:
            h = jnp.tanh(layer(h))
        return self.head(h)

    def encode(self, x: jax.Array) -> jax.Array:
        return self.embed(x)


X = jnp.array([[[1.0, -1.0], [0.5, 2.0], [-1.5, 0.25]]])  # (batch 1, positions 3, features 2)
MODES = ["eager", "jax.jit", "nnx.jit"]


def first_layer(ctx: hx.Context) -> bool:
    return ctx.path == ("layers", 0)


# A list of every kind of entry, and the same selection written as one hx.Select expression.
LIST = ["embed", ":encode", Head, first_layer, hx.Select(paths="layers/1")]
SAME = (
    hx.Select(paths=("embed", "layers/*", "head"), methods="__call__")
    | hx.Select(paths="", methods="encode")
) & ~hx.Select(paths="head/lin")
KEYS = [":encode", "embed", "layers/0", "layers/1", "head"]  # in call order


def run(mode: str, f: Any, model: Net, *args: Any) -> Any:
    """``f(model, *args)`` eagerly, under ``jax.jit`` or ``nnx.jit`` (the model an argument)."""
    if mode == "eager":
        return f(model, *args)
    jit = jax.jit if mode == "jax.jit" else nnx.jit
    return jit(f)(model, *args)


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    yield
    assert _context.active_entries() == ()
    assert _context.call_stack() == []


def by_hand(model: Net, x: jax.Array, edit: Any = lambda key, v: v) -> dict[str, jax.Array]:
    """Every call site's output, computed eagerly without hookax, ``edit`` applied to each."""
    out = {"embed": edit("embed", model.embed(x))}
    out[":encode"] = h = edit(":encode", out["embed"])
    for i, layer in enumerate(model.layers):
        out[f"layers/{i}"] = edit(f"layers/{i}", layer(h))
        h = jnp.tanh(out[f"layers/{i}"])
    out["head"] = edit("head", model.head(h))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_capture_takes_a_list(mode):
    model = Net()
    y, acts = run(mode, lambda m, x: hx.capture(m, where=LIST)(x), model, X)
    _, same = run(mode, lambda m, x: hx.capture(m, where=SAME)(x), model, X)
    assert list(acts) == (KEYS if mode == "eager" else sorted(KEYS))  # jit sorts dicts
    for key in KEYS:
        np.testing.assert_array_equal(acts[key][0], same[key][0])
    if mode == "eager":
        hand = by_hand(model, X)
        for key in KEYS:
            np.testing.assert_array_equal(acts[key][0], hand[key])
        np.testing.assert_array_equal(y, hand["head"])


@pytest.mark.parametrize("mode", MODES)
def test_intercept_and_scoped_hooks_take_a_list(mode):
    model = Net()
    seen: list[str] = []

    def log(next_fun: Any, args: Any, kwargs: Any, ctx: hx.Context) -> Any:
        seen.append(ctx.key)
        return next_fun(*args, **kwargs)

    def twice(module: Any, args: Any, out: Any) -> Any:
        return out * 2

    def hooked(where: Any) -> Any:
        def f(m: Net, x: jax.Array) -> Any:
            with hx.hooks(where=where, forward=twice):
                return m(x)

        return f

    got = run(mode, hooked(["embed", Head]), model, X)
    np.testing.assert_array_equal(
        got, run(mode, hooked(hx.Select(paths=("embed", "head"))), model, X)
    )
    if mode == "eager":
        hand = by_hand(model, X, lambda key, v: v * 2 if key in ("embed", "head") else v)
        np.testing.assert_array_equal(got, hand["head"])
    seen.clear()
    with hx.intercept(log, where=["layers/*", ":encode"]):
        run(mode, lambda m, x: m(x), model, X)
    assert seen == [":encode", "layers/0", "layers/1"]


@pytest.mark.parametrize("mode", MODES)
def test_register_takes_a_list(mode):
    model = Net()

    def twice(module: Any, args: Any, out: Any) -> Any:
        return out * 2

    with hx.register_forward_hook(model, twice, where=["embed", Head]):  # one handle for both
        got = run(mode, lambda m, x: m(x), model, X)
    assert "_hookax_hooks" not in vars(model.embed) and "_hookax_hooks" not in vars(model.head)
    head = hx.register_forward_hook(model, twice, where=hx.Select(types=Head))
    with head, hx.register_forward_hook(model, twice, where="embed"):
        same = run(mode, lambda m, x: m(x), model, X)
    np.testing.assert_array_equal(got, same)
    if mode == "eager":
        hand = by_hand(model, X, lambda key, v: v * 2 if key in ("embed", "head") else v)
        np.testing.assert_array_equal(got, hand["head"])
    with pytest.raises(hx.SelectorError, match=r"matched no submodule"):
        hx.register_forward_hook(model, lambda m, a, out: None, where=["nope", "nada/*"])


def loss(m: Net, x: jax.Array) -> jax.Array:
    return jnp.sum(m(x) ** 2)


@pytest.mark.parametrize("mode", MODES)
def test_value_and_grad_takes_a_list(mode):
    model = Net()
    _, _, got = run(mode, lambda m, x: hx.value_and_grad(loss, where=LIST)(m, x), model, X)
    _, _, same = run(mode, lambda m, x: hx.value_and_grad(loss, where=SAME)(m, x), model, X)
    assert list(got) == (KEYS if mode == "eager" else sorted(KEYS))
    for key in KEYS:
        np.testing.assert_array_equal(got[key][0], same[key][0])
    np.testing.assert_array_equal(got["head"][0], 2 * model(X))  # d sum(y^2) / dy


def test_patch_grid_targets_come_in_the_lists_order():
    model = Net()
    clean, corrupt = X, X[:, ::-1]

    def metric(y: jax.Array) -> jax.Array:
        return y[0, -1, 0]

    grid = hx.patch_grid(model, (clean,), (corrupt,), metric, where=["layers/1", Head, "embed"])
    one = {
        key: hx.patch_grid(model, (clean,), (corrupt,), metric, where=key)[0]
        for key in ("layers/1", "head", "embed")
    }
    assert grid.shape == (3, 3)
    np.testing.assert_array_equal(grid, jnp.stack([one["layers/1"], one["head"], one["embed"]]))
    by_select = hx.patch_grid(
        model, (clean,), (corrupt,), metric, where=[first_layer, hx.Select(types=Head)]
    )
    first = hx.patch_grid(model, (clean,), (corrupt,), metric, where="layers/0")[0]
    np.testing.assert_array_equal(by_select, jnp.stack([first, one["head"]]))
    # Patching the whole output of the last call site restores the clean run there exactly.
    np.testing.assert_array_equal(one["head"][-1], metric(model(clean)))
    with pytest.raises(hx.SelectorError, match=r"where=<function .*> matched no call site"):
        hx.patch_grid(model, (clean,), (corrupt,), metric, where=[lambda ctx: False])


def test_harvest_takes_a_list(tmp_path):
    model = Net()
    batches = [X, 2 * X]
    h = hx.harvest(model, batches, where=["layers/1", Head], store=tmp_path / "acts.zarr")
    for key in ("layers/1", "head"):
        rows = np.concatenate([by_hand(model, b)[key] for b in batches])
        np.testing.assert_array_equal(h.read(key), rows)


def test_lists_everywhere_are_checked_alike():
    model = Net()
    for where in ([], ()):
        with pytest.raises(hx.SelectorError, match=r"is an empty list: it selects nothing"):
            hx.capture(model, where=where)
    with pytest.raises(hx.SelectorError, match=r"the path glob 'layrs/1' matched no call site"):
        hx.capture(model, where=["embed", "layrs/1"])(X)
    with pytest.raises(
        hx.SelectorError, match=r"got 3 of type int\. .* A list of any of these is their union"
    ):
        hx.capture(model, where=["embed", 3])


def test_a_capture_made_per_step_with_a_list_traces_once(traces):
    model = Net()

    @nnx.jit
    def step(m: Net, x: jax.Array) -> jax.Array:
        traces()
        return m(x)

    for _ in range(3):
        y, acts = hx.capture(step, where=["embed", Head])(model, X)
    assert traces.n == 1
    assert sorted(acts) == ["embed", "head"]
    np.testing.assert_array_equal(acts["head"][0], y)
