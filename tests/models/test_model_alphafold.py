"""Every feature the Evoformer is used for, on AlphaFold 2's own Haiku modules (the
``alphafold-colabfold`` package), against a hookax-free reference.

The model is the Evoformer stack as AlphaFold's trunk (``EmbeddingsAndEvoformer``) builds it:
``modules.EvoformerIteration`` under AlphaFold's own ``layer_stack`` (an ``hk.scan`` over stacked
parameters), from ``config.model_config("model_1_ptm")`` shrunk to 3 blocks and a few channels,
with random parameters, a 4-sequence x 6-residue MSA representation and a pair representation
(no features, no databases: the stack's inputs are the two representations and their masks).

The reference runs the same blocks one by one (``hk.transform`` of one ``EvoformerIteration``,
given block ``i``'s slice of the stacked parameters), with each edit written into that loop; the
attention probabilities are recomputed by hand from the query and key data each ``Attention``
call receives (read with Haiku's own ``hk.intercept_methods``) and the parameters it reads.
Each check runs eagerly and under ``jax.jit``; the probabilities also under AlphaFold's default
sub-batching (each attention in chunks of 4 rows). In ColabFold's whole model (``RunModel``)
the same keys sit under ``alphafold/alphafold_iteration/evoformer/`` (``docs/models.md``). Runs
where ``alphafold`` is installed (``nox -s models`` on Python 3.11; the figures on 3.12 were
measured once, CI does not install it there); skipped elsewhere.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# Skipped where alphafold is not installed; where it is, a failing import is an error (a missing
# dependency must not pass as a skip).
if importlib.util.find_spec("alphafold") is None:
    pytest.skip("alphafold (alphafold-colabfold) is not installed", allow_module_level=True)

import haiku as hk
import jax
import jax.numpy as jnp
import model_checks as mc
import numpy as np
from alphafold.model import config, layer_stack, modules, prng

import hookax as hx

NAME = "AlphaFold 2"
LAYERS, N_SEQ, N_RES, C_M, C_Z, HEADS = 3, 4, 6, 16, 8, 2
STACK = "evoformer_iteration"
# Each attention of a block: its hookax key below the block, and the layout of its
# probabilities, [batch, heads, query, key], in the residues (r) and sequences (s) of the MSA.
ATTENTIONS = {
    "msa_row_attention_with_pair_bias": (N_SEQ, N_RES),  # [s, h, r, r]: along each MSA row
    "msa_column_attention": (N_RES, N_SEQ),  # [r, h, s, s]: down each MSA column
    "triangle_attention_starting_node": (N_RES, N_RES),  # [i, h, j, k]: edges ij attend to ik
    "triangle_attention_ending_node": (N_RES, N_RES),  # [j, h, i, k]: edges ij attend to kj
}
PROBS = f"{STACK}/*/attention:softmax"
ONE_BLOCK_PROBS = f"{STACK}/triangle_attention_starting_node/attention[2]:softmax"
MODES = ("eager", "jit")


@pytest.fixture(scope="module", autouse=True)
def _default_promotion() -> Iterator[None]:
    # AlphaFold mixes Python and NumPy scalars with arrays; the project's suite runs with
    # strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def tiny_config(subbatch_size: int = 1 << 20) -> tuple[Any, Any]:
    """``model_1_ptm``'s Evoformer config with few channels and heads; float32 (the config's
    bfloat16 off) and, by default, no sub-batching (each attention one call over its whole
    batch; the config's own ``subbatch_size`` is 4)."""
    cfg = config.model_config("model_1_ptm")
    gc = cfg.model.global_config
    gc.bfloat16 = False
    gc.subbatch_size = subbatch_size
    c = cfg.model.embeddings_and_evoformer
    c.evoformer_num_block = LAYERS
    c.msa_channel, c.pair_channel = C_M, C_Z
    e = c.evoformer
    for name in ATTENTIONS:
        e[name].num_head = HEADS
    e.outer_product_mean.num_outer_channel = 4
    e.triangle_multiplication_outgoing.num_intermediate_channel = 8
    e.triangle_multiplication_incoming.num_intermediate_channel = 8
    e.msa_transition.num_intermediate_factor = 2
    e.pair_transition.num_intermediate_factor = 2
    return c, gc


CFG, GC = tiny_config()
# AlphaFold's default: each attention over chunks of 4 of its batch rows.
_, GC_CHUNKED = tiny_config(subbatch_size=4)


def _iteration(gc: Any = GC) -> Any:
    return modules.EvoformerIteration(CFG.evoformer, gc, is_extra_msa=False, name=STACK)


def _masks(msa_mask: jax.Array, pair_mask: jax.Array) -> dict[str, jax.Array]:
    return {"msa": msa_mask, "pair": pair_mask}


def _evoformer(
    msa: jax.Array, pair: jax.Array, msa_mask: jax.Array, pair_mask: jax.Array, gc: Any = GC
) -> Any:
    """The Evoformer stack as ``EmbeddingsAndEvoformer`` writes it (its ``evoformer_fn``)."""
    iteration = _iteration(gc)

    def evoformer_fn(x: Any) -> Any:
        act, safe_key = x
        safe_key, safe_subkey = safe_key.split()
        out = iteration(
            activations=act,
            masks=_masks(msa_mask, pair_mask),
            is_training=False,
            safe_key=safe_subkey,
        )
        return out, safe_key

    stack = layer_stack.layer_stack(CFG.evoformer_num_block)(evoformer_fn)
    out, _ = stack(({"msa": msa, "pair": pair}, prng.SafeKey(jax.random.key(0))))
    return out


def _one_block(act: Any, msa_mask: jax.Array, pair_mask: jax.Array) -> Any:
    return _iteration()(
        activations=act,
        masks=_masks(msa_mask, pair_mask),
        is_training=False,
        safe_key=prng.SafeKey(jax.random.key(0)),
    )


EVOFORMER = hk.transform(_evoformer)
EVOFORMER_CHUNKED = hk.transform(functools.partial(_evoformer, gc=GC_CHUNKED))
BLOCK = hk.transform(_one_block)


def fn(params: Any, msa: jax.Array, pair: jax.Array, msa_mask: jax.Array, pair_mask: Any) -> Any:
    """The model as the features take it: ``{"msa": [s, r, c_m], "pair": [r, r, c_z]}``."""
    return EVOFORMER.apply(params, None, msa, pair, msa_mask, pair_mask)


def _inputs(key: jax.Array) -> tuple[jax.Array, ...]:
    k_msa, k_pair = jax.random.split(key)
    msa = jax.random.normal(k_msa, (N_SEQ, N_RES, C_M))
    pair = jax.random.normal(k_pair, (N_RES, N_RES, C_Z))
    # A gap in the last sequence: masked keys of the row attention and column attention.
    msa_mask = jnp.ones((N_SEQ, N_RES)).at[-1, -2:].set(0.0)
    return msa, pair, msa_mask, jnp.ones((N_RES, N_RES))


def random_params(args: tuple[Any, ...]) -> Any:
    """Random parameters of the stack's shapes (``jax.eval_shape`` of its ``init``: the
    compiled init of the layer stack is slow on a CPU), drawn by NumPy (no program per
    shape): weights scaled by their fan-in, layer norm scales near 1, offsets and biases
    small, so that no attention is one-hot."""
    shapes = jax.eval_shape(EVOFORMER.init, jax.random.key(0), *args)
    flat, tree = jax.tree_util.tree_flatten_with_path(shapes)
    rng = np.random.default_rng(1)
    leaves = []
    for path, s in flat:
        name = path[-1].key
        n = rng.standard_normal(s.shape).astype(np.float32)
        if name == "scale":
            leaves.append(1.0 + 0.1 * n)
        elif name in ("offset", "bias") or name.endswith("_b"):
            leaves.append(0.1 * n)
        else:
            leaves.append(n / np.float32(np.sqrt(s.shape[1])))
    return jax.tree_util.tree_unflatten(tree, [jnp.asarray(x) for x in leaves])


@jax.jit
def _ref_block(params: Any, act: Any, msa_mask: jax.Array, pair_mask: jax.Array) -> Any:
    """One Evoformer block; and each attention's probabilities, by hand from the arguments of
    its ``Attention`` call and its parameters."""
    probs: dict[str, jax.Array] = {}

    def interceptor(next_fun: Any, args: Any, kwargs: Any, ctx: Any) -> Any:
        mod = ctx.module
        if isinstance(mod, modules.Attention) and ctx.method_name == "__call__":
            q_data, m_data, bias, *rest = args
            nonbatched = rest[0] if rest else kwargs.get("nonbatched_bias")
            p = params[mod.module_name]
            key_dim = mod.config.get("key_dim", q_data.shape[-1]) // mod.config.num_head
            q = jnp.einsum("bqa,ahc->bqhc", q_data, p["query_w"]) * key_dim**-0.5
            k = jnp.einsum("bka,ahc->bkhc", m_data, p["key_w"])
            logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) + bias
            if nonbatched is not None:
                logits = logits + nonbatched[None]
            # AlphaFold runs each attention under hk.eval_shape first (its sub-batching):
            # the last call is the one computed.
            probs[mod.module_name.split("/")[1]] = jax.nn.softmax(logits)
        return next_fun(*args, **kwargs)

    with hk.intercept_methods(interceptor):
        out = BLOCK.apply(params, None, act, msa_mask, pair_mask)
    return out, probs


@jax.jit
def _ref_block_vjp(params: Any, act: Any, msa_mask: jax.Array, pair_mask: Any, cot: Any) -> Any:
    """The cotangent of one block's input from its output's (``jax.vjp`` of the block)."""
    _, vjp = jax.vjp(lambda a: BLOCK.apply(params, None, a, msa_mask, pair_mask), act)
    return vjp(cot)[0]


Edit = Callable[[int, Any], Any]


def reference(params: Any, args: tuple[Any, ...], edit: Edit | None = None) -> Any:
    """The stack unrolled: ``(output, [each block's output], [each block's probabilities])``;
    ``edit(i, act)`` edits block ``i``'s output (``{"msa", "pair"}``) before the next block."""
    msa, pair, msa_mask, pair_mask = args
    act = {"msa": msa, "pair": pair}
    outs, probs = [], []
    for i in range(LAYERS):
        act, found = _ref_block(jax.tree.map(lambda p, i=i: p[i], params), act, msa_mask, pair_mask)
        if edit is not None:
            act = edit(i, act)
        outs.append(act)
        probs.append(found)
    return act, outs, probs


class Model:
    """The stack, its parameters, the clean and corrupted inputs and the reference's values."""

    def __init__(self) -> None:
        self.clean = _inputs(jax.random.key(0))
        msa, pair, msa_mask, pair_mask = self.clean
        c_msa, c_pair, _, _ = _inputs(jax.random.key(5))
        # The corrupted run: residues 2 and 3 of the MSA and their rows of the pair replaced.
        self.corrupt = (
            msa.at[:, 2:4].set(c_msa[:, 2:4]),
            pair.at[2:4].set(c_pair[2:4]),
            msa_mask,
            pair_mask,
        )
        self.params = random_params(self.clean)
        self.out, self.outs, self.probs = reference(self.params, self.clean)
        self.w = jax.random.normal(jax.random.key(9), (N_RES, N_RES, C_Z))
        self.w_msa = jax.random.normal(jax.random.key(10), (N_SEQ, N_RES, C_M))
        self._grads: list[Any] | None = None
        self._grid: np.ndarray | None = None

    def loss_of(self, out: Any) -> jax.Array:
        """The loss the gradient tests differentiate: fixed weights on both outputs."""
        return jnp.sum(out["pair"] * self.w) + jnp.sum(out["msa"] * self.w_msa)

    def act_grads(self) -> list[Any]:
        """The loss's gradient with respect to each block's output, by hand: the output's
        cotangent carried back through the blocks one ``jax.vjp`` at a time."""
        if self._grads is None:
            msa_mask, pair_mask = self.clean[2:]
            cot = jax.grad(self.loss_of)(self.out)
            grads = [cot]
            for i in range(LAYERS - 1, 0, -1):
                p = jax.tree.map(lambda x, i=i: x[i], self.params)
                cot = _ref_block_vjp(p, self.outs[i - 1], msa_mask, pair_mask, cot)
                grads.insert(0, cot)
            self._grads = grads
        return self._grads

    def patched_grid(self) -> np.ndarray:
        """The metric of the corrupted run with block ``l``'s pair row ``r`` set to the clean
        run's, written into the reference's loop, for every ``l`` and ``r``."""
        if self._grid is None:

            def patched(layer: int, r: int) -> jax.Array:
                def edit(i: int, a: Any) -> Any:
                    if i != layer:
                        return a
                    return {**a, "pair": a["pair"].at[r].set(self.outs[i]["pair"][r])}

                return metric(reference(self.params, self.corrupt, edit)[0])

            self._grid = np.array([[patched(i, r) for r in range(N_RES)] for i in range(LAYERS)])
        return self._grid


@pytest.fixture(scope="module")
def model() -> Model:
    with jax.numpy_dtype_promotion("standard"):
        return Model()


def metric(out: Any) -> jax.Array:
    """A scalar of the stack's output: residue 0's pair entries with residue 5, channel 0,
    minus residue 5's with residue 0."""
    return out["pair"][0, N_RES - 1, 0] - out["pair"][N_RES - 1, 0, 0]


def _mode(f: Callable[..., Any], mode: str) -> Callable[..., Any]:
    return jax.jit(f) if mode == "jit" else f


_CAPTURED: dict[tuple[str, str], Any] = {}


def captured(model: Model, mode: str, which: str) -> tuple[Any, dict[str, Any]]:
    """The captures the capture tests share: ``"every"`` block and every attention's
    probabilities (``where="evoformer_iteration"``, ``ops=PROBS``); ``"one"``: block 1 and one
    attention of block 2 (a layer suffix in ``where=`` and before an address's colon)."""
    if (mode, which) not in _CAPTURED:
        if which == "every":
            f = hx.capture(fn, where=STACK, ops=PROBS)
        else:
            f = hx.capture(fn, where=f"{STACK}[1]", ops=ONE_BLOCK_PROBS)
        _CAPTURED[mode, which] = _mode(f, mode)(model.params, *model.clean)
    return _CAPTURED[mode, which]


def test_the_reference_is_the_model(model: Model) -> None:
    """The unrolled reference computes the stack's output (the stack scanned by AlphaFold's own
    ``layer_stack``), and its probabilities are probabilities (no row one-hot)."""
    out = jax.jit(fn)(model.params, *model.clean)
    d = max(mc.maxdiff(out[k], model.out[k]) for k in ("msa", "pair"))
    assert d < 1e-5, d
    for found in model.probs:
        assert sorted(found) == sorted(ATTENTIONS)
        for name, p in found.items():
            np.testing.assert_allclose(np.sum(p, -1), 1.0, atol=1e-5)
            assert float(jnp.max(p)) < 0.999, name


def test_summary_parameter_count(model: Model) -> None:
    """``hx.summary`` of the transformed stack counts its parameters (the stacked weights of
    the 3 blocks) as the parameter tree holds them, abstractly."""
    s = hx.summary(EVOFORMER, *model.clean)
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(model.params))
    assert s.totals.params == n, (s.totals.params, n)
    mc.record(NAME, "summary params", f"exact ({n:,})")


@pytest.mark.parametrize("mode", MODES)
def test_attention_probabilities_by_head(model: Model, mode: str) -> None:
    """``ops="evoformer_iteration/*/attention:softmax"`` captures the row, column and both
    triangle attentions' probabilities of every block, ``[layer, batch, head, query, key]``,
    equal to the reference's for each block and each head."""
    _, acts = captured(model, mode, "every")
    worst = 0.0
    for name, (batch, seq) in ATTENTIONS.items():
        (got,) = acts[f"{STACK}/{name}/attention:softmax"]
        assert got.shape == (LAYERS, batch, HEADS, seq, seq), (name, got.shape)
        for i in range(LAYERS):
            for h in range(HEADS):
                ref = model.probs[i][name][:, h]
                np.testing.assert_allclose(got[i, :, h], ref, rtol=1e-5, atol=1e-6)
                worst = max(worst, mc.maxdiff(got[i, :, h], ref))
    mc.record(NAME, f"attention probabilities ops={PROBS!r} ({mode})", f"{worst:.1e}")


@pytest.mark.parametrize("mode", MODES)
def test_attention_probabilities_of_one_block(model: Model, mode: str) -> None:
    """A layer suffix before the colon picks one block's probabilities:
    ``"evoformer_iteration/triangle_attention_starting_node/attention[2]:softmax"``."""
    _, acts = captured(model, mode, "one")
    (got,) = acts[ONE_BLOCK_PROBS]
    ref = model.probs[2]["triangle_attention_starting_node"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    mc.record(
        NAME, f"attention probabilities, one block [2] ({mode})", f"{mc.maxdiff(got, ref):.1e}"
    )


@pytest.mark.parametrize("mode", MODES)
def test_capture_every_block_and_one(model: Model, mode: str) -> None:
    """``where="evoformer_iteration"`` captures each block's MSA and pair representations,
    stacked on a leading layer axis; ``"evoformer_iteration[1]"`` block 1's alone; both equal
    the unrolled reference's."""
    y, acts = captured(model, mode, "every")
    y1, acts1 = captured(model, mode, "one")
    ((every,), (one,)) = acts[STACK], acts1[f"{STACK}[1]"]
    worst = 0.0
    for part, shape in (("msa", (N_SEQ, N_RES, C_M)), ("pair", (N_RES, N_RES, C_Z))):
        assert every[part].shape == (LAYERS, *shape)
        for i in range(LAYERS):
            np.testing.assert_allclose(every[part][i], model.outs[i][part], rtol=1e-5, atol=1e-5)
            worst = max(worst, mc.maxdiff(every[part][i], model.outs[i][part]))
        np.testing.assert_allclose(one[part], model.outs[1][part], rtol=1e-5, atol=1e-5)
        for out in (y, y1):
            np.testing.assert_allclose(out[part], model.out[part], rtol=1e-5, atol=1e-5)
    mc.record(NAME, f"capture every block / block [1] ({mode})", f"{worst:.1e}")


@pytest.mark.parametrize("mode", MODES)
def test_activation_gradients(model: Model, mode: str) -> None:
    """``hx.value_and_grad(loss, where="evoformer_iteration")``: the gradient of a loss with
    respect to each block's MSA and pair outputs equals the reference's, carried back by hand
    through the blocks one ``jax.vjp`` at a time; one entry also agrees with a central finite
    difference of the reference with that entry perturbed."""

    def loss(params: Any, *args: Any) -> jax.Array:
        return model.loss_of(fn(params, *args))

    val, _, act_grads = _mode(hx.value_and_grad(loss, where=STACK), mode)(
        model.params, *model.clean
    )
    (got,) = act_grads[STACK]
    ref = model.act_grads()
    np.testing.assert_allclose(val, model.loss_of(model.out), rtol=1e-5)
    worst = 0.0
    for part in ("msa", "pair"):
        scale = max(float(jnp.max(jnp.abs(r[part]))) for r in ref)
        assert got[part].shape[0] == LAYERS
        for i in range(LAYERS):
            np.testing.assert_allclose(got[part][i], ref[i][part], rtol=1e-4, atol=1e-5 * scale)
            worst = max(worst, mc.maxdiff(got[part][i], ref[i][part]))

    # Block 1's pair entry [2, 0, 0], by central differences (float32: a loose tolerance).
    h = 1e-2

    def bumped(s: float) -> jax.Array:
        def edit(i: int, a: Any) -> Any:
            return {**a, "pair": a["pair"].at[2, 0, 0].add(s * h)} if i == 1 else a

        return model.loss_of(reference(model.params, model.clean, edit)[0])

    fd = (bumped(1.0) - bumped(-1.0)) / (2 * h)
    np.testing.assert_allclose(got["pair"][1, 2, 0, 0], fd, rtol=2e-2, atol=2e-2)
    mc.record(NAME, f"activation gradients (hx.value_and_grad) ({mode})", f"{worst:.1e}")


def steering_vector() -> jax.Array:
    return 3.0 * jax.random.normal(jax.random.key(3), (C_Z,))


@pytest.mark.parametrize("mode", MODES)
def test_steering_the_pair_representation(model: Model, mode: str) -> None:
    """A forward hook on ``"evoformer_iteration[1]"`` adding a vector to block 1's pair
    representation gives the reference with that addition written after block 1 (and changes
    the output)."""
    v = steering_vector()

    def steer(module: Any, args: Any, out: Any) -> Any:
        return {**out, "pair": out["pair"] + v}

    with hx.hooks(where=f"{STACK}[1]", forward=steer):
        got = _mode(fn, mode)(model.params, *model.clean)
    ref, _, _ = reference(
        model.params, model.clean, lambda i, a: {**a, "pair": a["pair"] + v} if i == 1 else a
    )
    assert mc.maxdiff(model.out["pair"], ref["pair"]) > 1e-2  # the edit changes the output
    d = 0.0
    for part in ("msa", "pair"):
        np.testing.assert_allclose(got[part], ref[part], rtol=1e-5, atol=1e-5)
        d = max(d, mc.maxdiff(got[part], ref[part]))
    mc.record(NAME, f"steering the pair representation (hx.hooks) ({mode})", f"{d:.1e}")


@pytest.mark.parametrize("mode", MODES)
def test_patch_grid_blocks_by_residue(model: Model, mode: str) -> None:
    """``hx.patch_grid(..., where="evoformer_iteration[0:3].pair", axis=0)``: a row per block, a
    column per residue ``r``; each entry is the metric of the corrupted run with block ``l``'s
    pair row ``r`` (``pair[r, :, :]``) taken from the clean run, as the reference computes it
    with that row written into its loop."""

    def grid_of(clean: tuple[Any, ...], corrupt: tuple[Any, ...]) -> jax.Array:
        return hx.patch_grid(fn, clean, corrupt, metric, where=f"{STACK}[0:{LAYERS}].pair", axis=0)

    grid = _mode(grid_of, mode)((model.params, *model.clean), (model.params, *model.corrupt))
    assert grid.shape == (LAYERS, N_RES)
    ref = model.patched_grid()
    corrupt_metric = metric(reference(model.params, model.corrupt)[0])
    assert np.max(np.abs(ref - corrupt_metric)) > 1e-3  # patching moves the metric
    np.testing.assert_allclose(np.asarray(grid), ref, rtol=1e-5, atol=1e-5)
    mc.record(NAME, f"patch_grid blocks x residues ({mode})", f"{mc.maxdiff(grid, ref):.1e}")


def test_attention_probabilities_in_chunks(model: Model) -> None:
    """With AlphaFold's default sub-batching (``subbatch_size=4``) each attention runs on
    chunks of 4 batch rows in an ``hk.scan``, then once on the remaining rows: the capture
    holds one value per call, ``[block, chunk, 4, head, q, k]`` then ``[block, rest, head, q,
    k]``, which put together along the batch axis are the unchunked reference's."""

    def chunked(params: Any, *args: Any) -> Any:
        return EVOFORMER_CHUNKED.apply(params, None, *args)

    _, acts = jax.jit(hx.capture(chunked, ops=PROBS))(model.params, *model.clean)
    worst = 0.0
    for name, (batch, seq) in ATTENTIONS.items():
        calls = acts[f"{STACK}/{name}/attention:softmax"]
        whole = [c.reshape(LAYERS, -1, HEADS, seq, seq) for c in calls]
        got = jnp.concatenate(whole, axis=1)
        assert got.shape == (LAYERS, batch, HEADS, seq, seq), (name, [c.shape for c in calls])
        assert len(calls) == (1 if batch % 4 == 0 else 2), (name, [c.shape for c in calls])
        for i in range(LAYERS):
            ref = model.probs[i][name]
            np.testing.assert_allclose(got[i], ref, rtol=1e-5, atol=1e-6)
            worst = max(worst, mc.maxdiff(got[i], ref))
    mc.record(NAME, "attention probabilities, default sub-batching (jit)", f"{worst:.1e}")
