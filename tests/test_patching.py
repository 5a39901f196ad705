"""Activation patching: ``hx.patching``, ``hx.patch_grid``, ``hx.attribution_patch`` and the
cache helpers, against a forward written out by hand.

Every framework builds the same small decoder-like stack (``L`` residual blocks
``x + tanh(causal_mean(x) @ W + b)``, then a readout) from its library layers with the same
weights, and the scanned NNX model runs the same blocks stacked under ``nnx.scan``. ``reference``
is that forward in plain JAX with an explicit edit after each block: the hand-patched model every
patched value is compared with.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

L, B, T, D, V = 3, 2, 5, 4, 3
_k = jax.random.split(jax.random.key(7), 4)
W = jax.random.normal(_k[0], (L, D, D)) / 2
BIAS = jax.random.normal(_k[1], (L, D)) / 4
W_OUT = jax.random.normal(_k[2], (D, V))
CLEAN = jax.random.normal(_k[3], (B, T, D))
CORRUPT = CLEAN.at[:, 1].set(-CLEAN[:, 1] + 1.0)


def causal_mean(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]


def metric(y: jax.Array) -> jax.Array:
    return (y[:, -1, 0] - y[:, -1, 1]).sum()


Edit = Callable[[int, jax.Array], jax.Array]


def reference(x: jax.Array, edit: Edit | None = None) -> jax.Array:
    """The model by hand; ``edit(layer, h)`` rewrites each block's output (the hand patch)."""
    for layer in range(L):
        x = x + jnp.tanh(causal_mean(x) @ W[layer] + BIAS[layer])
        if edit is not None:
            x = edit(layer, x)
    return x @ W_OUT


def reference_acts(x: jax.Array) -> list[jax.Array]:
    acts: list[jax.Array] = []
    reference(x, lambda layer, h: acts.append(h) or h)
    return acts


def mask_of(pos: Any) -> jax.Array:
    """A position (or mask) as a mask broadcasting over (batch, position, features)."""
    p = jnp.asarray(pos)
    m = p if p.dtype == jnp.bool_ else (jnp.arange(T) == p)
    return m[:, None]


def hand_patch(target: int, value: jax.Array, pos: Any) -> Edit:
    m = mask_of(pos) if pos is not None else True
    return lambda layer, h: jnp.where(m, value, h) if layer == target else h


# --- the models -------------------------------------------------------------------------------


class NBlock(nnx.Module):
    def __init__(self, layer: int) -> None:
        self.lin = nnx.Linear(D, D, rngs=nnx.Rngs(0))
        self.lin.kernel.set_value(W[layer])
        self.lin.bias.set_value(BIAS[layer])

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.lin(causal_mean(x)))


class NModel(nnx.Module):
    def __init__(self) -> None:
        self.layers = nnx.List([NBlock(i) for i in range(L)])
        self.out = nnx.Linear(D, V, use_bias=False, rngs=nnx.Rngs(0))
        self.out.kernel.set_value(W_OUT)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class LBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(nn.Dense(D, name="lin")(causal_mean(x)))


class LModel(nn.Module):
    def setup(self) -> None:
        self.layers = [LBlock() for _ in range(L)]
        self.out = nn.Dense(V, use_bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


LINEN_PARAMS = {
    "params": {
        **{f"layers_{i}": {"lin": {"kernel": W[i], "bias": BIAS[i]}} for i in range(L)},
        "out": {"kernel": W_OUT},
    }
}


def _eqx_linear(w: jax.Array, b: jax.Array | None) -> eqx.nn.Linear:
    lin = eqx.nn.Linear(w.shape[0], w.shape[1], use_bias=b is not None, key=jax.random.key(0))
    lin = eqx.tree_at(lambda m: m.weight, lin, w.T)
    return lin if b is None else eqx.tree_at(lambda m: m.bias, lin, b)


class EBlock(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(jax.vmap(jax.vmap(self.lin))(causal_mean(x)))


class EModel(eqx.Module):
    layers: list[EBlock]
    out: eqx.nn.Linear

    def __init__(self) -> None:
        self.layers = [EBlock(_eqx_linear(W[i], BIAS[i])) for i in range(L)]
        self.out = _eqx_linear(W_OUT, None)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return jax.vmap(jax.vmap(self.out))(x)


class Scanned(nnx.Module):
    """The same blocks stacked and run under ``nnx.scan``: one call site, ``"blocks"``."""

    def __init__(self) -> None:
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(layer: jax.Array) -> NBlock:
            return NBlock(0)

        self.blocks = make(jnp.arange(L))
        self.blocks.lin.kernel.set_value(W)
        self.blocks.lin.bias.set_value(BIAS)
        self.out = nnx.Linear(D, V, use_bias=False, rngs=nnx.Rngs(0))
        self.out.kernel.set_value(W_OUT)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, block: NBlock) -> jax.Array:
            return block(x)

        return self.out(body(x, self.blocks))


@dataclasses.dataclass
class Framework:
    name: str
    fn: Any  # what patch_grid takes: the model, or Linen's apply
    pre: tuple[Any, ...]  # arguments before the input (Linen: the variables)
    keys: list[str]  # the blocks' call-site keys
    jit: Callable[[Callable[..., Any]], Callable[..., Any]]
    state: Any  # what a jitted function takes: the model, or Linen's variables

    def args(self, x: jax.Array) -> tuple[Any, ...]:
        return (*self.pre, x)

    def apply(self, state: Any, x: jax.Array) -> jax.Array:
        return self.fn(state, x) if self.name == "linen" else state(x)


def make(name: str) -> Framework:
    if name == "nnx":
        m = NModel()
        return Framework(name, m, (), [f"layers/{i}" for i in range(L)], nnx.jit, m)
    if name == "linen":
        keys = [f"layers_{i}" for i in range(L)]
        return Framework(name, LModel().apply, (LINEN_PARAMS,), keys, jax.jit, LINEN_PARAMS)
    e = EModel()
    return Framework(name, e, (), [f"layers/{i}" for i in range(L)], eqx.filter_jit, e)


@pytest.fixture(params=["nnx", "linen", "equinox"])
def fw(request: Any) -> Framework:
    return make(request.param)


def close(a: Any, b: Any, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


CLEAN_ACTS = reference_acts(CLEAN)
CORRUPT_ACTS = reference_acts(CORRUPT)
M_CORRUPT = metric(reference(CORRUPT))


def test_the_models_are_the_reference(fw: Framework) -> None:
    close(fw.fn(*fw.args(CLEAN)), reference(CLEAN))
    close(Scanned()(CLEAN), reference(CLEAN))


# --- hx.patching ------------------------------------------------------------------------------


def as_mask(pos: Any) -> Any:
    """``positions=`` as the boolean mask over positions it stands for (None: everywhere)."""
    if pos is None:
        return None
    p = jnp.asarray(pos)
    if p.dtype == jnp.bool_:
        return p
    return (jnp.arange(T)[:, None] == jnp.atleast_1d(p)[None, :]).any(-1)


POSITIONS = [jnp.int32(0), jnp.int32(3), jnp.arange(T) >= 2, jnp.array([1, 4]), None]


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_patching_equals_the_hand_patched_model(fw: Framework, mode: str, traces: Any) -> None:
    def run(state: Any, x: jax.Array, value: jax.Array, pos: Any, key: str) -> Any:
        traces()
        with hx.patching({key: value}, positions=pos):
            return fw.apply(state, x)

    # Eagerly each block with new values recompiles every operation: one layer is enough.
    for layer, key in enumerate(fw.keys) if mode == "jit" else [(1, fw.keys[1])]:
        f = run if mode == "eager" else fw.jit(lambda s, x, v, p, key=key: run(s, x, v, p, key))
        for pos in POSITIONS:
            args = (fw.state, CORRUPT, CLEAN_ACTS[layer], pos)
            got = run(*args, key) if mode == "eager" else f(*args)
            close(got, reference(CORRUPT, hand_patch(layer, CLEAN_ACTS[layer], as_mask(pos))))
    if mode == "jit":  # one trace per key and kind of positions (index, mask, indices, None)
        assert traces.n == L * 4


def test_patching_under_jax_jit_with_the_model_as_argument_and_vmap(traces: Any) -> None:
    model = NModel()

    @jax.jit
    def row(model: NModel, x: jax.Array, value: jax.Array, masks: jax.Array) -> jax.Array:
        traces()

        def one(mask: jax.Array) -> jax.Array:
            with hx.patching({"layers/1": value}, positions=mask):
                return metric(model(x))

        return jax.vmap(one)(masks)

    masks = jnp.eye(T, dtype=bool)
    for value in (CLEAN_ACTS[1], CLEAN_ACTS[1] + 1.0):
        want = [metric(reference(CORRUPT, hand_patch(1, value, masks[p]))) for p in range(T)]
        close(row(model, CORRUPT, value, masks), jnp.stack(want))
    assert traces.n == 1


def test_a_block_around_a_jitted_function_keys_its_cache_by_the_values() -> None:
    model = NModel()
    forward = nnx.jit(lambda m, x: m(x))
    plain = forward(model, CORRUPT)
    for value in (CLEAN_ACTS[0], CLEAN_ACTS[0] * 2):
        with hx.patching({"layers/0": value}, positions=2):
            got = forward(model, CORRUPT)
        close(got, reference(CORRUPT, hand_patch(0, value, jnp.arange(T) == 2)))
    close(forward(model, CORRUPT), plain)


class Twice(nnx.Module):
    """One block called twice: one call site with two calls."""

    def __init__(self) -> None:
        self.block = NBlock(0)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.block(self.block(x))


def test_a_tuple_gives_each_call_its_value() -> None:
    model = Twice()
    _, acts = hx.capture(model, where="block")(CLEAN)
    assert len(acts["block"]) == 2

    @nnx.jit
    def run(model: Twice, x: jax.Array, values: tuple, pos: jax.Array) -> jax.Array:
        with hx.patching({"block": values}, positions=pos):
            return model(x)

    def by_hand(x: jax.Array, pos: int) -> jax.Array:
        m = (jnp.arange(T) == pos)[:, None]
        for value in acts["block"]:
            x = jnp.where(m, value, model.block(x))
        return x

    for pos in (0, 3):
        close(run(model, CORRUPT, acts["block"], jnp.int32(pos)), by_hand(CORRUPT, pos))
        close(run(model, CORRUPT, acts["block"], jnp.int32(pos)), by_hand(CORRUPT, pos))


def all_layers_patch(clean: list[jax.Array], pos: Any) -> Edit:
    """The scanned stack's unsuffixed key by hand: every layer patched with its clean value."""
    m = True if pos is None else as_mask(pos)[:, None]
    return lambda layer, h: jnp.where(m, clean[layer], h)


@pytest.mark.parametrize("mode", ["eager", "jit", "vmap"])
def test_scanned_stack_every_layer_gets_its_own_value(mode: str) -> None:
    model = Scanned()
    _, acts = hx.capture(model, where="blocks")(CLEAN)
    stacked = acts["blocks"][0]
    assert stacked.shape == (L, B, T, D)
    close(stacked, jnp.stack(CLEAN_ACTS))

    def run(model: Scanned, x: jax.Array, value: jax.Array, pos: Any) -> jax.Array:
        with hx.patching({"blocks": value}, positions=pos):
            return model(x)

    if mode == "vmap":
        masks = jnp.eye(T, dtype=bool)
        leaves, treedef = jax.tree.flatten(model)
        one = lambda lv, m: run(jax.tree.unflatten(treedef, lv), CORRUPT, stacked, m)  # noqa: E731
        got = jax.jit(jax.vmap(one, in_axes=(None, 0)))(leaves, masks)
        want = [reference(CORRUPT, all_layers_patch(CLEAN_ACTS, masks[p])) for p in range(T)]
        close(got, jnp.stack(want))
        return
    f = run if mode == "eager" else nnx.jit(run)
    for pos in (jnp.int32(1), jnp.int32(4), None):
        got = f(model, CORRUPT, acts["blocks"], pos)
        close(got, reference(CORRUPT, all_layers_patch(CLEAN_ACTS, pos)))


def test_a_key_that_matches_nothing_raises_naming_it() -> None:
    model = NModel()
    with pytest.raises(hx.SelectorError, match=r"'layers/9' matched no call site.*'layers/0'"):
        _patched(model, {"layers/0": CLEAN_ACTS[0], "layers/9": CLEAN_ACTS[0]})
    with pytest.raises(hx.SelectorError, match="'layer/1' matched no call site"):
        nnx.jit(lambda m, v: _patched(m, {"layer/1": v}))(model, CLEAN_ACTS[1])


def _patched(model: Any, values: dict, **kwargs: Any) -> Any:
    with hx.patching(values, **kwargs):
        return model(CORRUPT)


def test_values_and_positions_of_the_wrong_shape_raise_naming_them() -> None:
    model = NModel()
    with pytest.raises(
        hx.PatchError,
        match=r"call site 'layers/1' has shape \(2, 4, 4\), but its output has shape "
        r"\(2, 5, 4\)\. Expected \(2, 5, 4\), or \(n, 2, 5, 4\)",
    ):
        _patched(model, {"layers/1": CLEAN_ACTS[1][:, :4]})
    with pytest.raises(hx.PatchError, match=r"mask has shape \(4,\), but call site 'layers/0'"):
        _patched(model, {"layers/0": CLEAN_ACTS[0]}, positions=jnp.ones(4, bool))
    with pytest.raises(hx.PatchError, match=r"axis=3 is out of range for call site 'layers/0'"):
        _patched(model, {"layers/0": CLEAN_ACTS[0]}, positions=1, axis=3)
    with pytest.raises(hx.PatchError, match="positions= takes an index, indices or a boolean"):
        hx.patching({"layers/0": CLEAN_ACTS[0]}, positions=1.5)
    with pytest.raises(hx.PatchError, match="must be an array"):
        hx.patching({"layers/0": "clean"})
    with pytest.raises(hx.PatchError, match="non-empty dict"):
        hx.patching({})


# --- hx.patch_grid ----------------------------------------------------------------------------


def hand_grid(edit_for: Callable[[int, Any], Edit], rows: int) -> jax.Array:
    """Every (row, position) cell by hand: one separately run, hand-patched forward each."""
    return jnp.array(
        [
            [metric(reference(CORRUPT, edit_for(r, jnp.arange(T) == p))) for p in range(T)]
            for r in range(rows)
        ]
    )


LAYER_GRID = hand_grid(lambda layer, m: hand_patch(layer, CLEAN_ACTS[layer], m), L)


def test_grid_equals_hand_patched_forwards(fw: Framework) -> None:
    grid = hx.patch_grid(fw.fn, fw.args(CLEAN), fw.args(CORRUPT), metric, where=fw.keys)
    assert grid.shape == (L, T)
    close(grid, LAYER_GRID)
    glob = "layers_*" if fw.name == "linen" else "layers/*"
    close(hx.patch_grid(fw.fn, fw.args(CLEAN), fw.args(CORRUPT), metric, where=glob), grid)
    whole = hx.patch_grid(
        fw.fn, fw.args(CLEAN), fw.args(CORRUPT), metric, where=fw.keys, positions=None
    )
    assert whole.shape == (L,)
    want = [metric(reference(CORRUPT, hand_patch(i, CLEAN_ACTS[i], None))) for i in range(L)]
    close(whole, jnp.stack(want))


def test_positions_masks_indices_and_chunks_give_the_same_grid() -> None:
    model = NModel()
    args = ((CLEAN,), (CORRUPT,), metric)
    keys = ["layers/2", "layers/0"]  # rows in the order given
    want = LAYER_GRID[jnp.array([2, 0])]
    for kwargs in (
        {},
        {"chunk_size": 2},
        {"chunk_size": 3},
        {"chunk_size": 64},
        {"positions": jnp.arange(T)},
        {"positions": jnp.eye(T, dtype=bool), "chunk_size": 4},
        {"positions": jnp.eye(T, dtype=bool)[:, None, :].repeat(B, 1)},  # (batch, position) masks
    ):
        close(hx.patch_grid(model, *args, where=keys, **kwargs), want)
    two = hx.patch_grid(model, *args, where=keys, positions=jnp.array([[0, 3], [1, 4]]))
    pairs = [jnp.isin(jnp.arange(T), jnp.array(p)) for p in ([0, 3], [1, 4])]
    for r, layer in enumerate((2, 0)):
        for c, m in enumerate(pairs):
            close(two[r, c], metric(reference(CORRUPT, hand_patch(layer, CLEAN_ACTS[layer], m))))


def test_the_default_chunk_on_cpu_cuts_rows_evenly(monkeypatch: Any) -> None:
    """On CPU a row is cut into even chunks of at most CPU_CHUNK_BYTES of target values; the
    grid is the same."""
    from hookax._patching import grid as grid_module

    assert jax.default_backend() == "cpu"
    monkeypatch.setattr(grid_module, "CPU_MIN_CHUNK", 1)
    monkeypatch.setattr(grid_module, "CPU_CHUNK_BYTES", 4 * B * T * D * 4)  # 4 patches' values
    plan = grid_module.Plan("t", NModel(), (CLEAN,), (CORRUPT,), metric, "layers/*", "each", 1)
    assert [used for _, used in plan.chunks(None)] == [3, 2]  # two calls of 3, not 4 and 1
    assert [used for _, used in plan.chunks(4)] == [4, 1]  # an explicit size is kept
    close(plan.grid(None), LAYER_GRID)


def test_scanned_stack_row_patches_every_layer() -> None:
    model = Scanned()
    grid = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="blocks", chunk_size=2)
    want = hand_grid(lambda _, m: all_layers_patch(CLEAN_ACTS, m), 1)
    close(grid, want)


def test_grid_programs_are_reused_and_read_the_model_afresh(traces: Any) -> None:
    model = NModel()

    def counted(y: jax.Array) -> jax.Array:
        traces()
        return metric(y)

    grid = hx.patch_grid(model, (CLEAN,), (CORRUPT,), counted, where="layers/*")
    assert traces.n == L  # one program per row
    close(hx.patch_grid(model, (CLEAN,), (CORRUPT,), counted, where="layers/*"), grid)
    assert traces.n == L
    model.out.kernel.set_value(-W_OUT)  # changed in place: the next grid sees it
    close(hx.patch_grid(model, (CLEAN,), (CORRUPT,), counted, where="layers/*"), -grid)
    assert traces.n == L


def test_grid_targets_that_match_nothing_raise_naming_them() -> None:
    model = NModel()
    with pytest.raises(hx.SelectorError, match=r"where='layers/7' matched no call site.*'layers/"):
        hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where=["layers/0", "layers/7"])
    with pytest.raises(hx.SelectorError, match=r"where='mlp/\*' matched no call site"):
        hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="mlp/*")
    with pytest.raises(hx.PatchError, match=r"mask has shape \(4,\), but call site 'layers/0'"):
        hx.patch_grid(
            model, (CLEAN,), (CORRUPT,), metric, where="layers/0", positions=jnp.ones((2, 4), bool)
        )
    with pytest.raises(hx.HookaxError, match="clean_args is the tuple of fn's positional"):
        hx.patch_grid(model, CLEAN, (CORRUPT,), metric, where="layers/0")
    with pytest.raises(hx.PatchError, match="chunk_size= takes a positive int"):
        hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers/0", chunk_size=0)


def test_grid_target_that_returns_a_tuple_is_refused_showing_what_it_returns() -> None:
    # A decoder block returning (cache, x), as Gemma's does with no cache: not one array.
    class CacheBlock(nnx.Module):
        def __init__(self) -> None:
            self.lin = nnx.Linear(D, D, rngs=nnx.Rngs(0))

        def __call__(self, x: jax.Array) -> tuple[None, jax.Array]:
            return None, x + self.lin(x)

    class Model(nnx.Module):
        def __init__(self) -> None:
            self.block = CacheBlock()

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.block(x)[1]

    want = (
        rf"hx.patch_grid: call site 'block' returns \(None, f32\[{B},{T},{D}\]\), not one "
        r"array; .* Fix: name the array inside it: 'block.1' \(f32\[2,5,4\]\); or target a "
        r"call site inside it that returns one array, or an operation with ops="
    )
    with pytest.raises(hx.PatchError, match=want):
        hx.patch_grid(Model(), (CLEAN,), (CORRUPT,), metric, where="block")
    with pytest.raises(hx.PatchError, match=want.replace("patch_grid", "attribution_patch")):
        hx.attribution_patch(Model(), (CLEAN,), (CORRUPT,), metric, where="block")
    model = Model()
    grid = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="block/lin", positions=None)
    assert grid.shape == (1,)  # the array inside it is a target
    close(grid[0], metric(CORRUPT + model.block.lin(CLEAN)))
    grid = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="block.1", positions=None)
    close(grid[0], metric(CLEAN + model.block.lin(CLEAN)))  # the block's array, by name


# --- hx.attribution_patch ---------------------------------------------------------------------


def hand_attribution() -> jax.Array:
    """(clean - corrupted) . d metric / d (block output), d/d... by jax.grad of perturbations
    added by hand after each block of the corrupted run; summed per (layer, position)."""

    def perturbed(deltas: jax.Array) -> jax.Array:
        return metric(reference(CORRUPT, lambda layer, h: h + deltas[layer]))

    grads = jax.grad(perturbed)(jnp.zeros((L, B, T, D)))
    diff = jnp.stack(CLEAN_ACTS) - jnp.stack(CORRUPT_ACTS)
    return (diff * grads).sum(axis=(1, 3))  # (layer, position)


ATTRIBUTION = hand_attribution()


def test_attribution_equals_its_formula(fw: Framework) -> None:
    args = (fw.fn, fw.args(CLEAN), fw.args(CORRUPT), metric)
    got = hx.attribution_patch(*args, where=fw.keys)
    assert got.shape == (L, T)
    close(got, ATTRIBUTION)
    close(hx.attribution_patch(*args, where=fw.keys, positions=None), ATTRIBUTION.sum(1))
    grid = hx.patch_grid(*args, where=fw.keys)
    # The first-order estimate of grid - metric(corrupt): close here, not equal.
    corr = np.corrcoef(np.ravel(got), np.ravel(grid - M_CORRUPT))[0, 1]
    assert corr > 0.9, corr


@pytest.mark.parametrize("name", ["nnx", "linen", "equinox"])
def test_attribution_runs_the_forward_its_targets_were_found_in(
    name: str, traces: Any, monkeypatch: Any
) -> None:
    """Clean values, corrupted values and gradients come from the one traced forward that
    found the targets (run on the clean inputs, then differentiated): the model is traced once
    for any number of estimates over it, outputs or inputs (``":in"``); under an interceptor
    (another trace context) it is traced again, and intercepted. The same estimate as the
    program that traces the model for each."""
    from hookax._patching import attribution

    fw = make(name)

    def forward(*args: Any) -> jax.Array:
        traces()
        return fw.fn(*args)

    args = (forward, fw.args(CLEAN), fw.args(CORRUPT), metric)
    got = hx.attribution_patch(*args, where=fw.keys)
    close(got, ATTRIBUTION)
    inputs = hx.attribution_patch(*args, where=[k + ":in" for k in fw.keys[1:]])
    close(inputs, ATTRIBUTION[:-1])  # layer i's input is layer i - 1's output
    assert traces.n == 1
    used = []
    from_forward = attribution._from_forward

    def spy(*a: Any) -> Any:
        used.append(from_forward(*a) is not None)
        return used[-1] and from_forward(*a)

    monkeypatch.setattr(attribution, "_from_forward", spy)

    def estimate(state: Any, clean: jax.Array, corrupt: jax.Array) -> Any:
        fn, pre = (fw.fn, (state,)) if name == "linen" else (state, ())
        new = lambda y: metric(y)  # noqa: E731 (a program no other test traced)
        return hx.attribution_patch(fn, (*pre, clean), (*pre, corrupt), new, where=fw.keys)

    close(fw.jit(estimate)(fw.state, CLEAN, CORRUPT), got)  # the model as an argument
    assert used == [True]
    monkeypatch.setattr(attribution, "_from_forward", from_forward)
    with hx.intercept(lambda nf, a, k, c: nf(*a, **k) * 0, where=fw.keys[-1]):
        zeroed = hx.attribution_patch(*args, where=fw.keys)
    close(zeroed, jnp.zeros_like(ATTRIBUTION))  # the logits no longer depend on anything
    assert traces.n > 1
    monkeypatch.setattr(attribution, "_from_forward", lambda *a: None)
    again = lambda y: metric(y)  # noqa: E731 (a new program)
    close(hx.attribution_patch(forward, *args[1:3], again, where=fw.keys), got)


_POSITIONS = jnp.arange(T)  # a constant array: concrete while the model is traced


class _Window(nnx.Module):
    """A call site given a constant array, which it reads with NumPy (concrete only)."""

    def __call__(self, idx: jax.Array) -> jax.Array:
        return jnp.ones((int(np.asarray(idx)[-1]) + 1,))


class _Windowed(nnx.Module):
    def __init__(self) -> None:
        self.window = _Window()
        self.model = NModel()

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.model(x * self.window(_POSITIONS)[:, None])


def test_finding_targets_leaves_a_constant_input_concrete() -> None:
    """Finding the targets marks the values of call sites traced with the forward, not a
    constant a call site reads with NumPy; the grid and estimate are the model's."""
    model = _Windowed()
    keys = [f"model/layers/{i}" for i in range(L)]
    args = (model, (CLEAN,), (CORRUPT,), metric)
    close(hx.patch_grid(*args, where=keys), LAYER_GRID)
    close(hx.attribution_patch(*args, where=keys), ATTRIBUTION)


class _JaxInside(nnx.Module):
    """A model that calls JAX's own jitted functions (``jnp.where``, ``jnp.cumsum``) and a
    function of the user's under ``jax.jit`` that calls a module."""

    def __init__(self) -> None:
        self.inner = nnx.Linear(V, V, rngs=nnx.Rngs(3))
        self.model = NModel()

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.model(jnp.where(x > 0, x, 0.5 * x))

        @jax.jit
        def mine(y: jax.Array) -> jax.Array:
            return self.inner(jax.nn.gelu(y))

        return mine(y)


def _jit_programs(closed: Any) -> dict[str, Any]:
    """``{name: program}`` of the ``jax.jit`` calls in ``closed``, inner ones too."""
    out: dict[str, Any] = {}

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if "jaxpr" in eqn.params and "name" in eqn.params:
                out.setdefault(eqn.params["name"], eqn.params["jaxpr"])
            inner = eqn.params.get("jaxpr")
            if inner is not None:
                walk(getattr(inner, "jaxpr", inner))

    walk(closed.jaxpr)
    return out


def test_finding_targets_reuses_the_traces_of_jax_own_functions() -> None:
    """Finding a model's call sites traces JAX's own jitted functions as its plain trace did
    (JAX's trace cache), not again under the finder's own key; a function of the user's is
    traced with it, and the call site inside it is found. In a fresh interpreter: JAX's trace
    cache and hookax's keys as a session has them, not as earlier tests left them."""
    import pathlib
    import subprocess
    import sys

    code = "from tests.test_patching import _reuse_check; _reuse_check()"
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _reuse_check() -> None:
    from hookax._patching import compiled, targets

    model = _JaxInside()
    x = CLEAN
    jax.make_jaxpr(model)(x)  # what a plain run traces (and JAX caches)
    dyn, rest = compiled.split((model, (x,)))
    found = targets.discover(dyn, rest)
    assert found.forward is not None
    plain, mine = _jit_programs(jax.make_jaxpr(model)(x)), _jit_programs(found.forward[0])
    assert {"_where", "mine"} <= set(plain) and set(plain) <= set(mine)
    for name in set(plain) - {"mine"}:  # JAX's own: the program the plain trace made
        assert mine[name] is plain[name], name
    assert mine["mine"] is not plain["mine"]  # the user's: traced with the finder's key
    assert "inner" in found and "inner" in found.nested  # found inside the user's jit
    assert {f"model/layers/{i}" for i in range(L)} <= set(found) - found.nested


def test_attribution_positions_and_masks_give_the_same_layout() -> None:
    model = NModel()
    args = (model, (CLEAN,), (CORRUPT,), metric)
    keys = ["layers/1", "layers/2"]
    want = ATTRIBUTION[1:]
    close(hx.attribution_patch(*args, where=keys, positions=jnp.arange(T)), want)
    close(hx.attribution_patch(*args, where=keys, positions=jnp.eye(T, dtype=bool)), want)
    pairs = hx.attribution_patch(*args, where=keys, positions=jnp.array([[0, 3], [1, 4]]))
    close(pairs, jnp.stack([want[:, [0, 3]].sum(1), want[:, [1, 4]].sum(1)], axis=1))


def test_attribution_of_a_scanned_stack_sums_its_layers() -> None:
    got = hx.attribution_patch(Scanned(), (CLEAN,), (CORRUPT,), metric, where="blocks")
    close(got, ATTRIBUTION.sum(0, keepdims=True))


def test_attribution_of_each_layer_of_a_scanned_stack() -> None:
    # One row per layer of the one call site: every layer's gradient, not only the first's.
    got = hx.attribution_patch(Scanned(), (CLEAN,), (CORRUPT,), metric, where=f"blocks[0:{L}]")
    close(got, ATTRIBUTION)


def test_attribution_needs_a_scalar_metric() -> None:
    with pytest.raises(hx.PatchError, match="the metric must return a scalar"):
        hx.attribution_patch(NModel(), (CLEAN,), (CORRUPT,), lambda y: y[:, -1], where="layers/0")


# --- cache helpers ----------------------------------------------------------------------------


def test_stack_layers_is_one_layout_for_unrolled_and_scanned_stacks() -> None:
    want = jnp.stack(CLEAN_ACTS)
    _, unrolled = hx.capture(NModel(), where="layers/*")(CLEAN)
    _, scanned = hx.capture(Scanned(), where="blocks")(CLEAN)
    close(hx.stack_layers(unrolled, "layers/*"), want)
    close(hx.stack_layers(scanned, "blocks"), want)
    _, twice = hx.capture(Twice(), where="block")(CLEAN)
    assert hx.stack_layers(twice, "block").shape == (2, B, T, D)  # one key, its calls
    with pytest.raises(hx.SelectorError, match=r"where='layer/\*' matched no captured key"):
        hx.stack_layers(unrolled, "layer/*")
    with pytest.raises(hx.PatchError, match="'block' ran 2 times"):
        hx.stack_layers(twice, "*")


def test_logit_lens_reads_out_every_layer() -> None:
    model = Scanned()
    _, acts = hx.capture(model, where="blocks")(CLEAN)
    lens = hx.logit_lens(model.out, acts, "blocks")
    assert lens.shape == (L, B, T, V)
    close(lens, jnp.stack([h @ W_OUT for h in CLEAN_ACTS]))
    close(lens[-1], reference(CLEAN))  # the last layer's readout is the model's output


def test_split_heads() -> None:
    x = jnp.arange(2 * 3 * 8.0).reshape(2, 3, 8)
    heads = hx.split_heads(x, 4)
    assert heads.shape == (2, 3, 4, 2)
    close(heads[:, :, 1], x[:, :, 2:4])
    assert hx.split_heads(x.transpose(0, 2, 1), 2, axis=1).shape == (2, 2, 4, 3)
    with pytest.raises(hx.PatchError, match="axis -1 has size 8, which 3 heads do not divide"):
        hx.split_heads(x, 3)


def test_patching_under_jax_grad_equals_the_hand_gradient() -> None:
    model = NModel()
    mask = jnp.arange(T) == 3

    def patched(value: jax.Array) -> jax.Array:
        with hx.patching({"layers/1": value}, positions=mask):
            return metric(model(CORRUPT))

    def by_hand(value: jax.Array) -> jax.Array:
        return metric(reference(CORRUPT, hand_patch(1, value, mask)))

    close(jax.jit(jax.grad(patched))(CLEAN_ACTS[1]), jax.grad(by_hand)(CLEAN_ACTS[1]))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_two_layers_of_a_scanned_stack_in_one_block(mode: str) -> None:
    """Two layer keys of one call site in one ``hx.patching``: each layer gets its own value."""

    def run(model: Scanned, x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        with hx.patching({"blocks[0]": a, "blocks[2]": b}):
            return model(x)

    f = run if mode == "eager" else nnx.jit(run)
    got = f(Scanned(), CORRUPT, CLEAN_ACTS[0], CLEAN_ACTS[2])
    want = reference(CORRUPT, lambda layer, h: CLEAN_ACTS[layer] if layer in (0, 2) else h)
    close(got, want)


def test_one_layer_of_a_scanned_stack_by_suffix():
    """``"blocks/mlp[3]"`` patches layer 3 only; a grid over the layers of a scan, one row per
    layer, equals the layers unrolled by hand with that layer's output replaced."""
    from tests.test_scan_layers import Scanned, X, _kernels, unrolled

    model = Scanned()
    w, b = _kernels(model)
    value = jnp.ones((2, 4))

    @jax.jit
    def run(model, x, value):
        with hx.patching({"blocks/mlp[3]": value}):
            return model(x)

    want = unrolled(w, b, X, lambda i, o: value if i == 3 else o)
    np.testing.assert_allclose(run(model, X, value), want, rtol=1e-6)
    clean, corrupt = X, X[::-1] * 0.5
    metric = lambda y: y.sum()  # noqa: E731
    grid = hx.patch_grid(
        model, (clean,), (corrupt,), metric, where="blocks/mlp[0:5]", positions=None
    )
    _, acts = hx.capture(model, where="blocks/mlp")(clean)
    for i in range(5):
        by_hand = unrolled(
            w, b, corrupt, lambda j, o, i=i: acts["blocks/mlp"][0][i] if j == i else o
        )
        np.testing.assert_allclose(grid[i], metric(by_hand), rtol=1e-5)


# --- heads: operations as targets, one row per head --------------------------------------------

H, DH = 2, D // 2  # heads, features per head
_kh = jax.random.split(jax.random.key(11), 3 * 2)
WQKV = [[jax.random.normal(_kh[3 * i + j], (D, D)) / 2 for j in range(3)] for i in range(2)]
HEAD_OP = "layers/*/attn:dot_general#1"  # the einsum over the probabilities: (b, h, q, d)


def head_attention(x: jax.Array, wq: Any, wk: Any, wv: Any, patch: Any = None) -> jax.Array:
    """Causal attention by hand; ``patch(out) -> out`` rewrites the per-head outputs
    ``(batch, heads, position, features)``: the hand patch."""
    split = lambda t: t.reshape(*t.shape[:-1], H, DH)  # noqa: E731
    q, k, v = split(x @ wq), split(x @ wk), split(x @ wv)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    out = jnp.einsum("bhqk,bkhd->bhqd", jax.nn.softmax(s, axis=-1), v)
    if patch is not None:
        out = patch(out)
    return out.transpose(0, 2, 1, 3).reshape(*x.shape)


def head_reference(x: jax.Array, patch: Callable[[int, jax.Array], jax.Array] | None = None):
    """Two residual attention blocks and a readout, by hand; ``patch(layer, out)``."""
    for layer, (wq, wk, wv) in enumerate(WQKV):
        edit = None if patch is None else (lambda out, layer=layer: patch(layer, out))
        x = x + head_attention(x, wq, wk, wv, edit)
    return x @ W_OUT


def head_outputs(x: jax.Array) -> list[jax.Array]:
    outs: list[jax.Array] = []
    head_reference(x, lambda layer, out: outs.append(out) or out)
    return outs


class NAttn(nnx.Module):
    def __init__(self, layer: int) -> None:
        self.q, self.k, self.v = (nnx.Linear(D, D, use_bias=False, rngs=nnx.Rngs(0)) for _ in "qkv")
        for lin, w in zip((self.q, self.k, self.v), WQKV[layer]):
            lin.kernel.set_value(w)

    def __call__(self, x: jax.Array) -> jax.Array:
        split = lambda t: t.reshape(*t.shape[:-1], H, DH)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
        out = jnp.einsum("bhqk,bkhd->bhqd", jax.nn.softmax(s, axis=-1), v)
        return out.transpose(0, 2, 1, 3).reshape(*x.shape)


class NHeadBlock(nnx.Module):
    def __init__(self, layer: int) -> None:
        self.attn = NAttn(layer)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.attn(x)


class NHeadModel(nnx.Module):
    def __init__(self) -> None:
        self.layers = nnx.List([NHeadBlock(i) for i in range(2)])
        self.out = nnx.Linear(D, V, use_bias=False, rngs=nnx.Rngs(0))
        self.out.kernel.set_value(W_OUT)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


CLEAN_HEADS = head_outputs(CLEAN)


def head_patch(layer: int, head: int, pos: Any) -> Callable[[int, jax.Array], jax.Array]:
    """Head ``head`` of block ``layer`` replaced by the clean run's at ``pos`` (None: all)."""
    m = jnp.ones(T, bool) if pos is None else jnp.arange(T) == pos
    mask = (jnp.arange(H) == head)[:, None, None] & m[:, None]  # over (heads, position, features)
    return lambda at, out: jnp.where(mask, CLEAN_HEADS[layer], out) if at == layer else out


HEAD_GRID = jnp.array(
    [
        [[metric(head_reference(CORRUPT, head_patch(i, h, p))) for p in range(T)] for h in range(H)]
        for i in range(2)
    ]
)


def test_the_head_model_is_its_reference() -> None:
    model = NHeadModel()
    close(model(CLEAN), head_reference(CLEAN))
    rows = {r.address: r for r in hx.ops(model, CLEAN).rows}
    assert rows["layers/0/attn:dot_general#1"].outputs == (f"f32[{B},{H},{T},{DH}]",)


@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
def test_head_grid_equals_hand_patched_forwards(mode: str) -> None:
    """Every (layer, head, position) cell: that head's output at that position replaced by the
    clean run's, the attention edited by hand."""

    def grid(model: NHeadModel, clean: jax.Array, corrupt: jax.Array, **kw: Any) -> Any:
        return hx.patch_grid(model, (clean,), (corrupt,), metric, ops=HEAD_OP, heads=1, **kw)

    static = ("axis", "positions")
    run = {"eager": grid, "jax.jit": jax.jit(grid, static_argnames=static)}.get(mode)
    run = run or nnx.jit(grid, static_argnames=static)
    got = run(NHeadModel(), CLEAN, CORRUPT, axis=2)
    assert got.shape == (2, H, T)  # (target, head, position)
    close(got, HEAD_GRID)
    assert float(jnp.abs(HEAD_GRID - M_HEAD_CORRUPT).max()) > 1e-2  # the patches change it
    if mode != "jax.jit":  # the same code path in every mode: once is enough
        return
    whole = run(NHeadModel(), CLEAN, CORRUPT, axis=2, positions=None)
    assert whole.shape == (2, H)
    want = [
        [metric(head_reference(CORRUPT, head_patch(i, h, None))) for h in range(H)] for i in (0, 1)
    ]
    close(whole, jnp.array(want))


M_HEAD_CORRUPT = metric(head_reference(CORRUPT))


def test_head_grid_chunks_and_position_arrays_give_the_same_grid() -> None:
    model = NHeadModel()
    args = (model, (CLEAN,), (CORRUPT,), metric)
    close(hx.patch_grid(*args, ops=HEAD_OP, heads=1, axis=2, chunk_size=3), HEAD_GRID)
    masks = jnp.eye(T, dtype=bool)[jnp.array([4, 1])]
    got = hx.patch_grid(
        *args, ops="layers/1/attn:dot_general#1", heads=-3, axis=-2, positions=masks
    )
    close(got, HEAD_GRID[1:, :, jnp.array([4, 1])])


def block_patched(mask: jax.Array) -> jax.Array:
    """The metric with block 0's output replaced by the clean run's under ``mask``, by hand."""
    x = CORRUPT + head_attention(CORRUPT, *WQKV[0])
    x = jnp.where(mask, CLEAN + head_attention(CLEAN, *WQKV[0]), x)
    return metric((x + head_attention(x, *WQKV[1])) @ W_OUT)


def test_heads_of_a_call_site() -> None:
    """``heads=`` on a call site's output: here the block's features stand for heads."""
    model = NHeadModel()
    got = hx.patch_grid(
        model, (CLEAN,), (CORRUPT,), metric, where="layers/0", heads=-1, positions=jnp.array([3])
    )
    assert got.shape == (1, D, 1)
    at3 = (jnp.arange(T) == 3)[:, None]
    close(got[0, :, 0], jnp.stack([block_patched(at3 & (jnp.arange(D) == f)) for f in range(D)]))


def test_a_call_site_and_an_operation_in_one_grid() -> None:
    """The call site's row first, then the operation's; one position axis (``-2``) for both."""
    model = NHeadModel()
    args = (model, (CLEAN,), (CORRUPT,), metric)
    both = hx.patch_grid(*args, where="layers/0", ops="layers/1/attn:dot_general#1", axis=-2)
    assert both.shape == (2, T)
    for p in range(T):
        mask = (jnp.arange(T) == p)[:, None]
        close(both[0, p], block_patched(mask))

        def edit(at: int, out: jax.Array, mask: jax.Array = mask) -> jax.Array:
            return jnp.where(mask, CLEAN_HEADS[1], out) if at == 1 else out

        close(both[1, p], metric(head_reference(CORRUPT, edit)))


def hand_head_attribution() -> jax.Array:
    """(clean - corrupted) . d metric / d (per-head output), by jax.grad of a perturbation
    added by hand to each block's per-head outputs; summed per (layer, head, position)."""

    def perturbed(deltas: jax.Array) -> jax.Array:
        return metric(head_reference(CORRUPT, lambda layer, out: out + deltas[layer]))

    grads = jax.grad(perturbed)(jnp.zeros((2, B, H, T, DH)))
    diff = jnp.stack(CLEAN_HEADS) - jnp.stack(head_outputs(CORRUPT))
    return (diff * grads).sum(axis=(1, 4))  # (layer, head, position)


HEAD_ATTRIBUTION = hand_head_attribution()


def test_head_attribution_equals_its_formula() -> None:
    model = NHeadModel()
    args = (model, (CLEAN,), (CORRUPT,), metric)
    want = HEAD_ATTRIBUTION
    got = hx.attribution_patch(*args, ops=HEAD_OP, heads=1, axis=2)
    assert got.shape == (2, H, T)
    close(got, want)
    close(hx.attribution_patch(*args, ops=HEAD_OP, heads=1, axis=2, positions=None), want.sum(2))


def test_head_attribution_under_jax_jit_with_the_model_as_argument() -> None:
    want = HEAD_ATTRIBUTION
    got = jax.jit(
        lambda m, c, x: hx.attribution_patch(m, (c,), (x,), metric, ops=HEAD_OP, heads=1, axis=2)
    )(NHeadModel(), CLEAN, CORRUPT)
    close(got, want)


def test_head_targets_that_do_not_fit_raise_naming_them() -> None:
    model = NHeadModel()
    args = (model, (CLEAN,), (CORRUPT,), metric)
    with pytest.raises(
        hx.SelectorError,
        match=r"hx.patch_grid: ops='layers/\*/attn:softmx' matched no operation.*'layers/",
    ):
        hx.patch_grid(*args, ops="layers/*/attn:softmx", heads=1, axis=2)
    with pytest.raises(hx.SelectorError, match=r"hx.attribution_patch: ops='mlp:dot_general'"):
        hx.attribution_patch(*args, ops="mlp:dot_general", heads=1, axis=2)
    with pytest.raises(
        hx.HookaxError,
        match=r"heads=4 is out of range for target 'layers/0/attn:dot_general#1', whose value "
        r"has shape \(2, 2, 5, 2\)",
    ):
        hx.patch_grid(*args, ops=HEAD_OP, heads=4, axis=2)
    with pytest.raises(hx.PatchError, match="heads=2 and axis=2 are the same axis"):
        hx.attribution_patch(*args, ops=HEAD_OP, heads=2, axis=2)
    with pytest.raises(hx.PatchError, match="heads= takes the head axis"):
        hx.patch_grid(*args, ops=HEAD_OP, heads="1")
    with pytest.raises(hx.HookaxError, match="no targets: pass where="):
        hx.patch_grid(*args)


def scanned_mlp() -> tuple[Any, Any, Any, dict[int, jax.Array], dict[int, jax.Array]]:
    """tests/test_scan_layers.py's scanned stack, its weights, and each layer's product
    ``h @ w[i]`` in the clean and the corrupted run, by hand."""
    from tests.test_scan_layers import Scanned as ScannedMLP
    from tests.test_scan_layers import X, _kernels, unrolled

    model = ScannedMLP()
    w, b = _kernels(model)
    dots: list[dict[int, jax.Array]] = [{}, {}]
    for x, out in zip((X, X[::-1] * 0.5), dots):

        def record(i: int, h: jax.Array, out: dict[int, jax.Array] = out) -> jax.Array:
            out[i] = h @ w[i]
            return h

        unrolled(w, b, x, pre=record)
    return model, w, b, dots[0], dots[1]


def test_an_operation_in_one_layer_of_a_scanned_stack_per_head() -> None:
    """``ops="blocks/mlp[1,3]:dot_general"``: one row per layer, each cell one feature (as a
    head) of one batch row of that layer's product patched, against the layers unrolled by
    hand."""
    from tests.test_scan_layers import X, unrolled

    model, w, b, clean_dots, _ = scanned_mlp()
    clean, corrupt = X, X[::-1] * 0.5
    got = hx.patch_grid(
        model, (clean,), (corrupt,), jnp.sum, ops="blocks/mlp[1,3]:dot_general", heads=1, axis=0
    )
    assert got.shape == (2, 4, 2)  # (layer, feature, batch row)

    @functools.partial(jax.jit, static_argnums=0)
    def by_hand(layer: int, f: jax.Array, row: jax.Array) -> jax.Array:
        mask = (jnp.arange(2) == row)[:, None] & (jnp.arange(4) == f)
        value = clean_dots[layer] + b[layer]
        return unrolled(w, b, corrupt, lambda i, o: jnp.where(mask, value, o) if i == layer else o)

    for r, layer in enumerate((1, 3)):
        for f in range(4):
            for row in range(2):
                close(got[r, f, row], by_hand(layer, f, row).sum())


def test_attribution_of_an_operation_in_one_layer_of_a_scanned_stack() -> None:
    """Attribution in the same layout: (clean - corrupted) . d sum / d product, by jax.grad of a
    perturbation of each layer's product added by hand; without a layer suffix, an error."""
    from tests.test_scan_layers import X, unrolled

    model, w, b, clean_dots, corrupt_dots = scanned_mlp()
    clean, corrupt = X, X[::-1] * 0.5

    def perturbed(d: jax.Array) -> jax.Array:
        edit = lambda i, o: o + d[(1, 3).index(i)] if i in (1, 3) else o  # noqa: E731
        return unrolled(w, b, corrupt, edit).sum()

    g = jax.grad(perturbed)(jnp.zeros((2, 2, 4)))
    want = jnp.stack([((clean_dots[i] - corrupt_dots[i]) * g[r]).T for r, i in enumerate((1, 3))])
    est = hx.attribution_patch(
        model, (clean,), (corrupt,), jnp.sum, ops="blocks/mlp[1,3]:dot_general", heads=1, axis=0
    )
    close(est, want)
    with pytest.raises(
        hx.PatchError, match=r"'blocks/mlp:dot_general' runs inside a scan.*'blocks/mlp\[0:5\]"
    ):
        hx.patch_grid(model, (clean,), (corrupt,), jnp.sum, ops="blocks/mlp:dot_general")


@pytest.mark.parametrize("name", ["nnx", "linen", "equinox"])
def test_grid_rows_are_suffixes_of_one_traced_forward(name: str, traces: Any) -> None:
    """The grid traces the forward once for all its rows (each row runs only what follows its
    target), as a hand-written grid does, and reads the clean values from the same traced
    forward run on the clean inputs: the forward is traced once in all (finding the targets;
    the grid's program is built from that trace), not once per row; the same grid. Under an
    interceptor (another trace context) that trace is not reused: the intercepted grid."""
    fw = make(name)

    def forward(*args: Any) -> jax.Array:
        traces()
        return fw.fn(*args)

    grid = hx.patch_grid(forward, fw.args(CLEAN), fw.args(CORRUPT), metric, where=fw.keys)
    close(grid, LAYER_GRID)
    assert traces.n == 1
    again = lambda y: metric(y)  # noqa: E731 (a new program)
    with hx.intercept(lambda nf, a, k, c: nf(*a, **k) * 0, where=fw.keys[-1]):
        zeroed = hx.patch_grid(forward, fw.args(CLEAN), fw.args(CORRUPT), again, where=fw.keys)
    assert traces.n == 2  # the grid's own trace, in the new context
    close(zeroed, jnp.zeros_like(LAYER_GRID))  # the last layer's output zeroed: logits 0
    close(hx.patch_grid(forward, fw.args(CLEAN), fw.args(CORRUPT), again, where=fw.keys), grid)
    assert traces.n == 2  # back in the first context: its trace again


def test_head_grid_of_operations_traces_the_forward_once_for_its_rows(traces: Any) -> None:
    """Operation targets with ``heads=``: the same one traced forward, each row after its
    operation (two traces in all, not one per row); the hand-patched grid."""
    model = NHeadModel()

    def forward(x: jax.Array) -> jax.Array:
        traces()
        return model(x)

    got = hx.patch_grid(forward, (CLEAN,), (CORRUPT,), metric, ops=HEAD_OP, heads=1, axis=2)
    close(got, HEAD_GRID)
    assert traces.n == 2


def _reference_patching_input(target: int, m: Any) -> jax.Array:
    """The corrupted model by hand with layer ``target``'s input patched to the clean run's
    (``True``/a mask: where to)."""
    clean_in = [CLEAN, *CLEAN_ACTS[:-1]]
    x = CORRUPT
    for layer in range(L):
        if layer == target:
            x = jnp.where(m, clean_in[layer], x)
        x = x + jnp.tanh(causal_mean(x) @ W[layer] + BIAS[layer])
    return x @ W_OUT


@pytest.mark.parametrize("name", ["nnx", "linen", "equinox"])
def test_grid_rows_of_inputs_are_suffixes_of_one_traced_forward(
    name: str, traces: Any, monkeypatch: Any
) -> None:
    """``"key:in"`` targets (a call's one positional argument: TransformerLens' resid_pre) cut
    the same one traced forward: one trace in all, the hand-patched grid, and (NNX) the grid
    of the program that traces a forward per row."""
    from hookax._patching import cutgrid

    fw = make(name)

    def forward(*args: Any) -> jax.Array:
        traces()
        return fw.fn(*args)

    keys = [k + ":in" for k in fw.keys]
    grid = hx.patch_grid(forward, fw.args(CLEAN), fw.args(CORRUPT), metric, where=keys)
    want = [[metric(_reference_patching_input(i, mask_of(t))) for t in range(T)] for i in range(L)]
    close(grid, jnp.asarray(want))
    assert traces.n == 1
    whole = hx.patch_grid(
        forward, fw.args(CLEAN), fw.args(CORRUPT), metric, where=keys[1:], positions=None
    )
    close(whole, jnp.stack([metric(_reference_patching_input(i, True)) for i in range(1, L)]))
    if name != "nnx":
        return
    grid_of = lambda m, c, x: hx.patch_grid(m, (c,), (x,), metric, where=keys)  # noqa: E731
    close(jax.jit(grid_of)(fw.fn, CLEAN, CORRUPT), grid)  # the model as an argument
    close(nnx.jit(grid_of)(fw.fn, CLEAN, CORRUPT), grid)
    monkeypatch.setattr(cutgrid, "eligible", lambda keys, ops: False)
    n = traces.n
    again = lambda y: metric(y)  # noqa: E731 (a new program)
    rowwise = hx.patch_grid(forward, fw.args(CLEAN), fw.args(CORRUPT), again, where=keys)
    assert traces.n - n == 1 + L  # the clean values captured, then a forward per row
    close(rowwise, grid)
