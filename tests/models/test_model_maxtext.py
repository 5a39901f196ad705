"""Every feature on MaxText's NNX decoder (its default: each layer run as ``nnx.split`` ->
``jax.checkpoint(pure_fn)`` -> ``nnx.merge(...)(x)``, inside ``lax.scan`` with ``scan_layers``),
Llama-2 blocks, full remat, scanned and unscanned, against a hookax-free reference.

The reference is the unscanned model (for the scanned one: with the scanned weights unstacked
into it: an unrolled stack), run as a copy (``nnx.merge`` of its split state) with the edit
written into its code: each decoder layer, or each attention's output projection, swapped for a
module that edits the value and calls the original; the attention probabilities by hand from the
query and key entering the attention op. Runs where ``maxtext`` is installed (``nox -s models``,
Python >= 3.12); skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import warnings
from typing import Any

import pytest

# Skipped where maxtext is not installed; where it is, a failing import is an error (a missing
# dependency must not pass as a skip).
if importlib.util.find_spec("maxtext") is None:
    pytest.skip("maxtext is not installed", allow_module_level=True)

import jax
import jax.numpy as jnp
import model_checks as mc
import numpy as np
from flax import nnx
from maxtext.common.common_types import MODEL_MODE_TRAIN
from maxtext.configs import pyconfig
from maxtext.inference.maxengine import maxengine
from maxtext.models import models
from maxtext.utils import maxtext_utils
from maxtext.utils.globals import MAXTEXT_PKG_DIR

V, D, LAYERS, HEADS, HEAD_DIM, B, SEQ = 128, 64, 3, 4, 16, 2, 8
POS = jnp.broadcast_to(jnp.arange(SEQ), (B, SEQ))
SEG = jnp.ones((B, SEQ), jnp.int32)


def _config(scan: bool, **more: Any) -> Any:
    return pyconfig.initialize(
        [None, os.path.join(MAXTEXT_PKG_DIR, "configs", "base.yml")],
        run_name="hookax",
        enable_checkpointing=False,
        model_name="default",
        decoder_block="llama2",
        base_emb_dim=D,
        base_num_query_heads=HEADS,
        base_num_kv_heads=HEADS,
        base_mlp_dim=128,
        base_num_decoder_layers=LAYERS,
        head_dim=HEAD_DIM,
        vocab_size=V,
        per_device_batch_size=1,
        scan_layers=scan,
        remat_policy="full",
        dtype="float32",
        weight_dtype="float32",
        matmul_precision="highest",
        attention="dot_product",
        skip_jax_distributed_system=True,
        ici_fsdp_parallelism=-1,
        **more,
    )


def _make(scan: bool) -> tuple[Any, Any]:
    cfg = _config(scan, max_target_length=SEQ)
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
    rngs = nnx.Rngs(params=0, dropout=1)
    model = models.Transformer(cfg, mesh=mesh, quant=None, rngs=rngs, model_mode=MODEL_MODE_TRAIN)
    return model, mesh


def fn(model: Any, ids: jax.Array) -> jax.Array:
    return model(ids, POS, decoder_segment_ids=SEG, enable_dropout=False)


def _unstacked(scanned: Any, unscanned: Any) -> Any:
    """The unscanned model holding the scanned model's weights (layer axis 1 taken apart)."""
    flat = dict(nnx.to_flat_state(nnx.state(scanned, nnx.Param)))
    g, params, rest = nnx.split(unscanned, nnx.Param, ...)
    out = []
    for path, var in nnx.to_flat_state(params):
        if path[0] == "decoder" and str(path[1]).startswith("layers_"):
            i = int(str(path[1])[len("layers_") :])
            src = flat[("decoder", "layers", *path[2:])]
            out.append((path, var.replace(jnp.take(src[...], i, axis=1))))
        else:
            out.append((path, var.replace(flat[path][...])))
    return nnx.merge(g, nnx.from_flat_state(out), rest)


def _x(out: Any) -> jax.Array:
    return out[0] if isinstance(out, tuple) else out


def _put_x(out: Any, x: jax.Array) -> Any:
    return (x, *out[1:]) if isinstance(out, tuple) else x


@pytest.fixture(scope="module", params=[False, True], ids=["unscanned", "scanned"])
def setup(request: pytest.FixtureRequest) -> Any:
    scan = request.param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model, mesh = _make(scan)
        ref_model = _unstacked(model, _make(False)[0]) if scan else model
        mesh.__enter__()
    with jax.numpy_dtype_promotion("standard"):
        yield scan, model, ref_model
    mesh.__exit__(None, None, None)


def _case(scan: bool, model: Any, ref_model: Any) -> mc.Case:
    name = "MaxText NNX " + ("scanned" if scan else "unscanned")
    clean_ids = jax.random.randint(jax.random.key(0), (B, SEQ), 3, V)
    corrupt_ids = clean_ids.at[:, 1:3].set(jax.random.randint(jax.random.key(1), (B, 2), 3, V))
    params = nnx.state(model, nnx.Param)
    _, EditInput = mc.nnx_wrappers()

    def run(args: tuple[Any, ...], edit: Any, head_edit: Any) -> tuple[jax.Array, list, list, list]:
        # The decoder's forward written out from its own parts, without its per-layer
        # jax.checkpoint (values are recorded as they pass).
        m = nnx.merge(*nnx.split(args[0]))
        dec, ids = m.decoder, args[1]
        hs: list[jax.Array] = []
        heads: list[jax.Array] = []
        qk: list[tuple[jax.Array, jax.Array]] = []
        y = dec._apply_embedding(m.token_embedder, ids, POS, True, MODEL_MODE_TRAIN)
        for i in range(LAYERS):
            layer = getattr(dec, f"layers_{i}")

            def head_fn(h: jax.Array, i: int = i) -> jax.Array:
                h = h if head_edit is None else head_edit(i, h)
                heads.append(h)
                return h

            op = layer.self_attention.attention_op

            class Record(nnx.Module):
                def __init__(self, inner: Any) -> None:
                    self.inner = inner

                def __call__(self, q: Any, k: Any, *a: Any, **kw: Any) -> Any:
                    qk.append((q, k))
                    return self.inner(q, k, *a, **kw)

            layer.self_attention.attention_op = Record(op)
            layer.self_attention.out = EditInput(layer.self_attention.out, head_fn)
            y = _x(layer(y, SEG, POS, True, MODEL_MODE_TRAIN))
            y = y if edit is None else edit(i, y)
            hs.append(y)
        logits = dec.apply_output_head(m.token_embedder, y, True, MODEL_MODE_TRAIN)
        return logits, hs, heads, qk

    def unrolled(args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_unstacked(args[0], ref_model) if scan else args[0], *args[1:])

    def ref(args: tuple[Any, ...], edit: Any) -> Any:
        return run(unrolled(args), edit, None)[:2]

    def ref_heads(args: tuple[Any, ...], edit: Any) -> Any:
        logits, _, heads, _ = run(unrolled(args), None, edit)
        return logits, heads

    def probs_ref(args: tuple[Any, ...]) -> list[jax.Array]:
        out = []
        for q, k in run(unrolled(args), None, None)[3]:
            logits = jnp.einsum("btnd,bsnd->bnts", q, k)
            causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
            out.append(jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1))
        return out

    op = "self_attention/attention_op:compute_local_attention:"
    stack = "decoder/layers/" if scan else "decoder/layers_*/"

    def probs_values(vals: dict[str, Any]) -> list[jax.Array]:
        if scan:
            e = vals["decoder/layers/" + op + "exp"][0]
            s = vals["decoder/layers/" + op + "reduce_sum"][0]
            return [e[i] / s[i][..., None] for i in range(LAYERS)]
        return [
            vals[f"decoder/layers_{i}/{op}exp"][0]
            / vals[f"decoder/layers_{i}/{op}reduce_sum"][0][..., None]
            for i in range(LAYERS)
        ]

    def layer_values(acts: dict[str, Any]) -> list[jax.Array]:
        if scan:
            stacked = _x(acts["decoder/layers"][0])
            return [stacked[i] for i in range(LAYERS)]
        return [_x(acts[f"decoder/layers_{i}"][0]) for i in range(LAYERS)]

    def loss_fn(model: Any, ids: jax.Array) -> jax.Array:
        # The model itself is differentiated (MaxText's state, split and merged again outside
        # its own train step, mutates its RNG counts from another trace level).
        logits = fn(model, ids)
        return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1, :] * jax.nn.one_hot(ids[:, 1:], V))

    def poison(args: tuple[Any, ...]) -> tuple[Any, ...]:
        # A copy of its variables too: merged from the same state, the model would share them
        # and keep the Inf for the tests that come after.
        bad = nnx.merge(*nnx.split(args[0]), copy=True)
        if scan:
            kernel = bad.decoder.layers.mlp.wo.kernel
            kernel[...] = kernel[...].at[0, 2, 0].set(jnp.inf)
        else:
            kernel = bad.decoder.layers_2.mlp.wo.kernel
            kernel[...] = kernel[...].at[0, 0].set(jnp.inf)
        return (bad, args[1])

    def layer_of(nf: Any) -> int | None:
        if scan:
            return nf.layer if isinstance(nf.layer, int) else None
        found = re.match(r"decoder/layers_(\d+)", nf.key or "")
        return int(found.group(1)) if found else None

    one = "decoder/layers[1]" if scan else "decoder/layers_1"

    def steer(v: jax.Array) -> tuple[str, Any]:
        return one, lambda module, args, out: _put_x(out, _x(out) + v)

    def stats_ref() -> np.ndarray:
        _, hs = ref((model, clean_ids), None)
        return np.array([jnp.linalg.norm(h) for h in hs])

    def stats_norms(s: Any) -> np.ndarray:
        if scan:
            return np.asarray(s["decoder/layers"]["act"]["norm"])
        return np.array([s[f"decoder/layers_{i}"]["act"]["norm"] for i in range(LAYERS)])

    return mc.Case(
        name=name,
        fn=fn,
        clean=(model, clean_ids),
        corrupt=(model, corrupt_ids),
        n_layers=LAYERS,
        layers="decoder/layers" if scan else "decoder/layers_*",
        layer_values=layer_values,
        layer_part="decoder/layers[0:3].0" if scan else "decoder/layers_*.0",
        one_layer=one,
        ref=ref,
        d_model=D,
        steer=steer,
        n_params=sum(p.size for p in jax.tree.leaves(params)),
        summary_args=(model, clean_ids, POS),
        probs_ops=f"{stack}{op}*",
        probs_ref=probs_ref,
        probs_values=probs_values,
        heads_where=(
            "decoder/layers/self_attention/attention_op[0:3]"
            if scan
            else "decoder/layers_*/self_attention/attention_op"
        ),
        head_axis=2,
        n_heads=HEADS,
        ref_heads=ref_heads,
        loss_args=(loss_fn, (model, clean_ids)),
        poison=poison,
        nonfinite_layer=layer_of,
        extra={
            "stats_where": "decoder/layers" if scan else "decoder/layers_*",
            "stats_norms": stats_norms,
            "stats_ref": stats_ref,
            "params_of": lambda m: nnx.state(m, nnx.Param),
            "value_and_grad": nnx.value_and_grad,
            "grad": nnx.grad,
            "batch_args": lambda b: b,
        },
    )


@pytest.fixture(scope="module")
def case(setup: Any) -> mc.Case:
    return _case(*setup)


class TestMaxText(mc.Checks):
    """The features every codebase is checked for (``model_checks.Checks``), on this case."""


def test_harvest_one_layer_read_back(case: mc.Case) -> None:
    model = case.clean[0]
    batches = [(case.clean[1],), (case.corrupt[1],)]
    name = case.one_layer + ".0"
    # The model passed in each batch: MaxText's decoder writes its layers' state back, which a
    # model closed over by the jitted step cannot take.
    batches = [(model, ids) for (ids,) in batches]
    mc.harvest_and_read(case, fn, batches, where=case.one_layer, name=name)


@pytest.fixture(scope="module")
def linen_case(setup: Any) -> mc.Case:
    """MaxText's Linen entry point (``transformer_as_linen``: the same NNX model behind
    ``ToLinen``), driven by Linen's ``init``/``apply``; the reference is the NNX model holding
    the Linen variables' weights, run as above."""
    scan, model, _ = setup
    linen = models.transformer_as_linen(model.config, model.mesh, None)
    ids = jax.random.randint(jax.random.key(0), (B, SEQ), 3, V)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = linen.init(rngs, ids, POS, decoder_segment_ids=SEG, enable_dropout=False)

    def linen_fn(variables: Any, ids: jax.Array) -> jax.Array:
        return linen.apply(variables, ids, POS, decoder_segment_ids=SEG, enable_dropout=False)

    def weight(path: tuple[Any, ...]) -> jax.Array:
        node = variables["params"]
        for k in path:
            node = node[k]
        return node.unbox() if hasattr(node, "unbox") else node

    g, params, rest = nnx.split(model, nnx.Param, ...)
    flat = [(p, v.replace(weight(p))) for p, v in nnx.to_flat_state(params)]
    same = nnx.merge(g, nnx.from_flat_state(flat), rest)
    nnx_case = _case(scan, same, _make(False)[0] if scan else same)
    ref = nnx_case.ref
    return mc.dataclasses.replace(
        nnx_case,
        name=nnx_case.name.replace("NNX", "Linen (ToLinen)"),
        fn=linen_fn,
        clean=(variables, nnx_case.clean[1]),
        corrupt=(variables, nnx_case.corrupt[1]),
        ref=lambda args, edit: ref((same, args[1]), edit),
    )


class TestMaxTextLinen:
    """The features of an interpretability session on the Linen entry point."""

    def test_capture_every_layer(self, linen_case: mc.Case) -> None:
        mc.check_capture(linen_case)

    def test_steering_forward(self, linen_case: mc.Case) -> None:
        mc.check_steering(linen_case)

    def test_patch_grid_layers_by_positions(self, linen_case: mc.Case) -> None:
        mc.check_patch_grid_layers(linen_case)

    def test_attribution_patch(self, linen_case: mc.Case) -> None:
        mc.check_attribution(linen_case)


PREFILL, STEPS = 8, 6


def _result_tokens_as_pytree() -> None:
    """Without JetStream, MaxText's engine returns its stand-in ``ResultTokens``, a plain class
    that its jitted prefill and generate cannot return; registered as a pytree here, as
    JetStream's own (a ``flax.struct`` dataclass) is."""
    rt = maxengine.engine_api.ResultTokens
    if not getattr(maxengine.engine_api, "_IS_STUB", False):
        return
    with contextlib.suppress(ValueError):  # registered already
        jax.tree_util.register_pytree_node(
            rt,
            lambda r: ((r.data, r.log_prob), (r.tokens_idx, r.valid_idx, r.length_idx)),
            lambda aux, ch: rt(
                data=ch[0],
                log_prob=ch[1],
                tokens_idx=aux[0],
                valid_idx=aux[1],
                length_idx=aux[2],
                samples_per_slot=1,
            ),
        )


def _engine(scan: bool, params: Any) -> tuple[Any, Any]:
    """MaxText's inference engine on the tiny config, holding ``params``."""
    cfg = _config(scan, max_target_length=PREFILL + STEPS, max_prefill_predict_length=PREFILL)
    engine = maxengine.MaxEngine(cfg)
    return engine, engine.load_params(params=params)


def _decode(engine: Any, params: Any, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy decoding by the engine's own steps: ``prefill`` (the first token), ``insert``
    into slot 0 of its decode state, then ``generate`` (one token each, from its KV cache).
    The tokens, and the logits each was chosen from."""
    padded = jnp.zeros(PREFILL, jnp.int32).at[: len(prompt)].set(jnp.asarray(prompt))
    prefix, _ = engine.prefill(params=params, padded_tokens=padded, true_length=len(prompt))
    tokens, logits = [int(prefix["tokens"][0, 0])], [np.asarray(prefix["logits"][0, 0])]
    state = engine.insert(prefix, engine.init_decode_state(), slot=0)
    for _ in range(STEPS - 1):
        state, _ = engine.generate(params, state)
        tokens.append(int(state["tokens"][0, 0]))
        logits.append(np.asarray(state["logits"][0, 0]))
    return tokens, np.stack(logits)


def _write_edit(engine: Any, layer: int, v: jax.Array) -> None:
    """The edit written into the engine's model: decoder layer ``layer``, in both the prefill
    and the autoregressive model, made an instance of a subclass of its class that adds ``v``
    to its output (the parameter and cache paths stay the same)."""
    for model in (engine.model, engine.model_ar):
        module = getattr(model.decoder, f"layers_{layer}")
        base = type(module)

        class AddV(base):  # type: ignore[misc, valid-type]
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                out = super().__call__(*args, **kwargs)
                return _put_x(out, _x(out) + v)

        module.__class__ = AddV
    engine.graphdef = nnx.split(engine.model, nnx.Param, nnx.Cache, ...)[0]
    engine.graphdef_ar = nnx.split(engine.model_ar, nnx.Param, nnx.Cache, ...)[0]


def test_steering_in_maxengine(setup: Any, case: mc.Case) -> None:
    """A steering vector added to layer 1 by ``hx.hooks`` during greedy decoding by MaxText's
    own engine (``MaxEngine``: its jitted prefill, insert and generate, its KV cache) gives the
    tokens and logits of the same engine run without hookax, with the edit written into the
    layer (an unscanned engine holding the same weights)."""
    scan, model, ref_model = setup
    _result_tokens_as_pytree()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")  # on CPU
        engine, params = _engine(scan, nnx.state(model, nnx.Param))
        ref_engine, ref_params = _engine(False, nnx.state(ref_model, nnx.Param))
        v = mc.steering_vector(case) / 3  # the tokens steered, not all one token
        prompt = [int(t) for t in case.clean[1][0, :5]]
        plain, _ = _decode(engine, params, prompt)

        def add_v(module: Any, args: Any, out: Any) -> Any:
            # Not case.steer's hook: that one, made again over a new array, would be made
            # often enough in a row (one per test here) for hookax's warning of retracing.
            return _put_x(out, _x(out) + v)

        with mc.hx.hooks(where=case.one_layer, forward=add_v):
            got, got_logits = _decode(engine, params, prompt)
        again, _ = _decode(engine, params, prompt)  # the block's end takes the edit away
        _write_edit(ref_engine, 1, v)
        ref, ref_logits = _decode(ref_engine, ref_params, prompt)
    assert got == ref, (got, ref)
    d = mc.maxdiff(got_logits, ref_logits)
    assert d < 1e-5, d
    assert got != plain and again == plain, (got, plain, again)
    same = f"{STEPS}/{STEPS} tokens equal, logits {d:.1e}"
    mc.record(case.name, "steering in MaxEngine (greedy tokens)", same)
