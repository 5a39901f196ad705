"""Every feature on EasyDeL's Llama (Flax NNX, layers in a Python loop, computing in
``forward``/``native_forward`` methods), against a hookax-free reference.

The reference runs a copy of the model (``nnx.merge`` of its split state) with the edit written
into its code: each decoder layer, or each attention's output projection, swapped for a module
that edits the value and calls the original. EasyDeL's own ``output_attentions=True`` gives the
attention probabilities. Runs where ``easydel`` is installed (``nox -s models``); skipped
elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings
from typing import Any

import pytest

os.environ.setdefault("EASYDEL_AUTO", "0")  # else it appends GPU flags to XLA_FLAGS at import
# Skipped where easydel is not installed; where it is, a failing import is an error (a missing
# dependency must not pass as a skip).
if importlib.util.find_spec("easydel") is None:
    pytest.skip("easydel is not installed", allow_module_level=True)
import easydel as ed
import jax
import jax.numpy as jnp
import model_checks as mc
import numpy as np
from flax import nnx

NAME = "EasyDeL"
V, D, LAYERS, HEADS, HEAD_DIM, SEQ = 128, 64, 3, 4, 16, 8


def _model() -> Any:
    cfg = ed.LlamaConfig(
        hidden_size=D,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
        attn_dtype=jnp.float32,
        attn_softmax_dtype=jnp.float32,
    )
    return ed.LlamaForCausalLM(
        config=cfg,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
        rngs=nnx.Rngs(0),
    )


@pytest.fixture(scope="module")
def model() -> Any:
    return _model()


@pytest.fixture(scope="module", autouse=True)
def _mesh(model: Any) -> Any:
    # EasyDeL's layers shard by the mesh in context; its models carry one.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model.mesh.__enter__()
    with jax.numpy_dtype_promotion("standard"):
        yield
    model.mesh.__exit__(None, None, None)


def fn(model: Any, ids: jax.Array) -> jax.Array:
    return model(input_ids=ids).logits


def _with_hidden(out: Any, h: jax.Array) -> Any:
    out = type(out)(**out)
    out["hidden_states"] = h
    out.hidden_states = h
    return out


def _copy(model: Any) -> Any:
    return nnx.merge(*nnx.split(model))


def run(args: tuple[Any, ...], edit: Any, head_edit: Any) -> tuple[jax.Array, list, list]:
    EditOutput, EditInput = mc.nnx_wrappers()
    model, ids = args
    m = _copy(model)
    hs: list[jax.Array] = []
    heads: list[jax.Array] = []
    for i in range(LAYERS):
        layer = m.model.layers[i]

        def out_fn(out: Any, i: int = i) -> Any:
            h = out.hidden_states if edit is None else edit(i, out.hidden_states)
            hs.append(h)
            return _with_hidden(out, h)

        def in_fn(x: jax.Array, i: int = i) -> jax.Array:
            h = x.reshape(*x.shape[:2], HEADS, HEAD_DIM)
            h = h if head_edit is None else head_edit(i, h)
            heads.append(h)
            return h.reshape(x.shape)

        layer.self_attn.o_proj = EditInput(layer.self_attn.o_proj, in_fn)
        m.model.layers[i] = EditOutput(layer, out_fn)
    return fn(m, ids), hs, heads


@pytest.fixture(scope="module")
def case(model: Any) -> mc.Case:
    clean_ids = jax.random.randint(jax.random.key(0), (2, SEQ), 3, V)
    corrupt_ids = clean_ids.at[:, 1:3].set(jax.random.randint(jax.random.key(1), (2, 2), 3, V))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def probs_ref(args: tuple[Any, ...]) -> list[jax.Array]:
        m, ids = args
        return list(m(input_ids=ids, output_attentions=True).attentions)

    def loss_fn(params: Any, ids: jax.Array) -> jax.Array:
        logits = fn(nnx.merge(graphdef, params, rest), ids)
        return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1, :] * jax.nn.one_hot(ids[:, 1:], V))

    def poison(args: tuple[Any, ...]) -> tuple[Any, ...]:
        def put(path: Any, p: Any) -> Any:
            names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
            hit = (
                "layers" in names
                and names[names.index("layers") + 1] == "2"
                and "down_proj" in names
            )
            return p.at[(0,) * p.ndim].set(jnp.inf) if hit and p.ndim == 2 else p

        return (jax.tree_util.tree_map_with_path(put, args[0]), args[1])

    def layer_of(nf: Any) -> int | None:
        found = re.match(r"model/layers/(\d+)", nf.key or "")
        return int(found.group(1)) if found else None

    def steer(v: jax.Array) -> tuple[str, Any]:
        return "model/layers/1", lambda module, args, out: _with_hidden(out, out.hidden_states + v)

    def stats_ref() -> np.ndarray:
        _, hs, _ = run((model, clean_ids), None, None)
        return np.array([jnp.linalg.norm(h) for h in hs])

    def softmax_values(vals: dict[str, Any]) -> list[jax.Array]:
        key = "model/layers/{}/self_attn/attention_performer:forward:softmax"
        return [vals[key.format(i)][0].reshape(2, HEADS, SEQ, SEQ) for i in range(LAYERS)]

    return mc.Case(
        name=NAME,
        fn=fn,
        clean=(model, clean_ids),
        corrupt=(model, corrupt_ids),
        n_layers=LAYERS,
        layers="model/layers/*",
        layer_values=lambda acts: [
            acts[f"model/layers/{i}"][0].hidden_states for i in range(LAYERS)
        ],
        layer_part="model/layers/*.hidden_states",
        one_layer="model/layers/1",
        ref=lambda args, edit: run(args, edit, None)[:2],
        d_model=D,
        steer=steer,
        n_params=sum(p.size for p in jax.tree.leaves(params)),
        summary_args=(model, clean_ids),
        probs_ops="model/layers/*/self_attn/attention_performer:forward:softmax",
        probs_ref=probs_ref,
        probs_values=softmax_values,
        heads_ops="model/layers/*/self_attn/attention_performer:forward:reshape#3",
        head_axis=2,
        n_heads=HEADS,
        ref_heads=lambda args, edit: (lambda r: (r[0], r[2]))(run(args, None, edit)),
        loss_args=(loss_fn, (params, clean_ids)),
        poison=poison,
        nonfinite_layer=layer_of,
        extra={
            "stats_where": "model/layers/*",
            "stats_norms": lambda s: np.array(
                [s[f"model/layers/{i}"]["act"]["norm"] for i in range(LAYERS)]
            ),
            "stats_ref": stats_ref,
            "poison_ref_args": lambda bad: (nnx.merge(graphdef, bad[0], rest), bad[1]),
            "batch_args": lambda b: (model, *b),
        },
    )


class TestEasyDeL(mc.Checks):
    """The features every codebase is checked for (``model_checks.Checks``), on this case."""

    def test_attribution_patch(self, case: mc.Case) -> None:
        """With the model itself, after its first call has set its RoPE table (a
        ``cached_property`` that NNX carries as static data)."""
        fn(*case.clean)
        mc.check_attribution(case)


def test_harvest_one_layer_read_back(case: mc.Case) -> None:
    model = case.clean[0]
    batches = [(case.clean[1],), (case.corrupt[1],)]
    mc.harvest_and_read(
        case,
        lambda ids: fn(model, ids),
        batches,
        where="model/layers/1",
        name="model/layers/1.hidden_states",
    )


def test_find_nonfinite_with_the_module(case: mc.Case) -> None:
    model, ids = case.clean
    fn(model, ids)  # the model's first call creates its RoPE cache

    def loss_fn(model: Any, ids: jax.Array) -> jax.Array:
        return jnp.mean(fn(model, ids) ** 2)

    assert mc.hx.find_nonfinite(loss_fn, model, ids) is None


def test_attribution_patch_on_split_state(case: mc.Case) -> None:
    """The functional form: the model's state split, merged inside the function."""
    model, clean_ids = case.clean
    graphdef, state = nnx.split(model)

    def split_fn(state: Any, ids: jax.Array) -> jax.Array:
        return fn(nnx.merge(graphdef, state), ids)

    split_case = mc.dataclasses.replace(
        case,
        fn=split_fn,
        clean=(state, clean_ids),
        corrupt=(state, case.corrupt[1]),
        ref=lambda args, edit: run((nnx.merge(graphdef, args[0]), args[1]), edit, None)[:2],
    )
    mc.check_attribution(split_case)


def test_steering_in_generate(case: mc.Case) -> None:
    """A steering vector added to layer 1 during EasyDeL's own ``generate()`` (greedy, its KV
    cache and compiled decode loop) gives the tokens of a greedy loop written by hand over the
    full sequence with the same edit written into the layer."""
    from transformers.generation.configuration_utils import GenerationConfig

    model = case.clean[0]
    prompt = case.clean[1][:1, :5]
    steps = 4
    config = GenerationConfig(max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=1)
    v = mc.steering_vector(case)
    where, hook = case.steer(v)
    with mc.hx.hooks(where=where, forward=hook):
        got = np.asarray(model.generate(prompt, generation_config=config).sequences)[0, -steps:]
    plain = np.asarray(model.generate(prompt, generation_config=config).sequences)[0, -steps:]

    seq = [int(t) for t in prompt[0]]
    for _ in range(steps):
        logits = run((model, jnp.asarray([seq])), lambda i, h: h + v if i == 1 else h, None)[0]
        seq.append(int(jnp.argmax(logits[0, -1])))
    ref = seq[-steps:]
    assert [int(t) for t in got] == ref, (got, ref)
    assert list(plain) != ref
    mc.record(NAME, "steering in generate() (greedy tokens)", f"{steps}/{steps} tokens equal")
