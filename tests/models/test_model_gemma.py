"""Every feature on the ``gemma`` library's ``gm.nn.Transformer`` (Flax Linen) and its sampler.

A tiny config with random weights; the reference is the model's forward written out from its
own bound submodules (embedder, blocks, final norm), with each edit written into that loop, and
Flax's own ``nn.intercept_methods`` / ``capture_intermediates`` for values inside the attention.
Runs where ``gemma`` is installed (``nox -s models``); skipped elsewhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Any

import pytest

# Skipped where gemma is not installed; where it is, a failing import is an error (a missing
# dependency must not pass as a skip).
if importlib.util.find_spec("gemma") is None:
    pytest.skip("gemma is not installed", allow_module_level=True)

import flax.linen as nn
import jax
import jax.numpy as jnp
import model_checks as mc
import numpy as np
from gemma import gm
from gemma.gm.text import _tokenizer

import hookax as hx

NAME = "gemma"
V, D, LAYERS, HEADS = 128, 32, 3, 2


@pytest.fixture(scope="module", autouse=True)
def _default_promotion() -> Any:
    # gemma mixes int and float constants; the project's suite runs with strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def _model() -> gm.nn.Transformer:
    cfg = gm.nn.config.TransformerConfig(
        num_embed=V,
        embed_dim=D,
        hidden_dim=64,
        num_heads=HEADS,
        head_dim=16,
        num_kv_heads=1,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(gm.nn.AttentionType.GLOBAL,) * LAYERS,
    )
    return gm.nn.Transformer(config=cfg, dtype=jnp.float32)


@pytest.fixture(scope="module")
def case() -> mc.Case:
    with jax.numpy_dtype_promotion("standard"):
        return _case()


def _case() -> mc.Case:
    model = _model()
    clean_tokens = jax.random.randint(jax.random.key(0), (2, 6), 3, V)
    corrupt_tokens = clean_tokens.at[:, 1:3].set(
        jax.random.randint(jax.random.key(1), (2, 2), 3, V)
    )
    params = model.init(jax.random.key(1), clean_tokens)["params"]

    def fn(params: Any, tokens: jax.Array) -> jax.Array:
        return model.apply({"params": params}, tokens).logits

    def run(args: tuple[Any, ...], edit: Any, head_edit: Any) -> tuple[jax.Array, list, list]:
        params, tokens = args
        m = model.bind({"params": params})
        inputs = m._encode_and_get_inputs(tokens=tokens)
        heads: list[jax.Array] = []

        def interceptor(next_fun: Any, a: Any, kw: Any, ctx: Any) -> Any:
            if ctx.module.name != "attn_vec_einsum" or ctx.method_name != "__call__":
                return next_fun(*a, **kw)
            i = int(ctx.module.parent.parent.name.split("_")[1])
            eqn, h = a
            h = h if head_edit is None else head_edit(i, h)
            heads.append(h)
            return next_fun(eqn, h, **kw)

        x, hs = inputs.embeddings, []
        with nn.intercept_methods(interceptor):
            for i, block in enumerate(m.blocks):
                _, x = block(x, inputs.positions, None, inputs.attention_mask)
                x = x if edit is None else edit(i, x)
                hs.append(x)
        return m.embedder.decode(m.final_norm(x)), hs, heads

    def probs_ref(args: tuple[Any, ...]) -> list[jax.Array]:
        params, tokens = args
        _, state = model.apply(
            {"params": params},
            tokens,
            capture_intermediates=lambda mdl, _: mdl.name == "attention_weights",
        )
        inter = state["intermediates"]
        return [
            inter[f"layer_{i}"]["attn"]["attention_weights"]["__call__"][0] for i in range(LAYERS)
        ]

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        logits = fn(params, tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1, :] * jax.nn.one_hot(tokens[:, 1:], V))

    def poison(args: tuple[Any, ...]) -> tuple[Any, ...]:
        params, tokens = args
        bad = jax.tree.map(lambda p: p, params)
        bad["layer_2"]["mlp"]["linear"] = bad["layer_2"]["mlp"]["linear"].at[0, 0].set(jnp.inf)
        return (bad, tokens)

    def layer_of(nf: Any) -> int | None:
        found = re.match(r"layer_(\d+)", nf.key or "")
        return int(found.group(1)) if found else None

    def steer(v: jax.Array) -> tuple[str, Any]:
        return "layer_1", lambda module, args, out: (out[0], out[1] + v)

    clean = (params, clean_tokens)

    def stats_ref() -> np.ndarray:
        _, hs, _ = run(clean, None, None)
        return np.array([jnp.linalg.norm(h) for h in hs])

    return mc.Case(
        name=NAME,
        fn=fn,
        clean=clean,
        corrupt=(params, corrupt_tokens),
        n_layers=LAYERS,
        layers="layer_*",
        layer_values=lambda acts: [acts[f"layer_{i}"][0][1] for i in range(LAYERS)],
        layer_part="layer_*.1",
        one_layer="layer_1",
        ref=lambda args, edit: run(args, edit, None)[:2],
        d_model=D,
        steer=steer,
        n_params=sum(p.size for p in jax.tree.leaves(params)),
        summary_args=(model.bind({"params": params}), clean_tokens),
        probs_ops="layer_*/attn:softmax",
        probs_ref=probs_ref,
        probs_values=lambda vals: [vals[f"layer_{i}/attn:softmax"][0] for i in range(LAYERS)],
        heads_ops="layer_*/attn:dot_general#1",
        head_axis=2,
        n_heads=HEADS,
        ref_heads=lambda args, edit: (lambda r: (r[0], r[2]))(run(args, None, edit)),
        loss_args=(loss_fn, clean),
        poison=poison,
        nonfinite_layer=layer_of,
        extra={
            "stats_where": "layer_*",
            "stats_norms": lambda s: np.array(
                [s[f"layer_{i}"]["act"]["norm"] for i in range(LAYERS)]
            ),
            "stats_ref": stats_ref,
            "batch_args": lambda b: (params, *b),
        },
    )


class TestGemma(mc.Checks):
    """The features every codebase is checked for (``model_checks.Checks``), on this case."""


def test_harvest_one_layer_read_back(case: mc.Case) -> None:
    params = case.clean[0]
    batches = [(case.clean[1],), (case.corrupt[1],)]
    mc.harvest_and_read(
        case, lambda tokens: case.fn(params, tokens), batches, where="layer_1", name="layer_1.1"
    )


@dataclasses.dataclass(frozen=True)
class ToyTokenizer(gm.text.Tokenizer):
    """Characters as token ids (no vocabulary file): the sampler's own loop runs unchanged."""

    path: str = ""
    special_tokens = _tokenizer._Gemma3SpecialTokens

    def encode(self, text: Any, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [3 + (ord(c) % (V - 3)) for c in text]
        return ([self.special_tokens.BOS] if add_bos else []) + ids

    def decode(self, ids: Any) -> str:
        return " ".join(str(int(i)) for i in np.ravel(np.asarray(ids)))


def test_steering_in_the_sampler(case: mc.Case) -> None:
    """A steering vector added to layer 1 in ``gm.text.Sampler``'s own decode loop (KV cache,
    ``lax.while_loop``) gives the tokens of a greedy loop written by hand over the full sequence
    with the same edit."""
    model = _model()
    params = case.clean[0]
    sampler = gm.text.Sampler(
        model=model,
        params=params,
        tokenizer=ToyTokenizer(),
        cache_length=32,
        max_out_length=8,
        pad_length=None,
    )
    v = mc.steering_vector(case)
    where, hook = case.steer(v)
    steps = 6
    with hx.hooks(where=where, forward=hook):
        out = sampler.sample("hello", max_new_tokens=steps, return_state=True, rng=0)
    plain = sampler.sample("hello", max_new_tokens=steps, return_state=True, rng=0)
    got = [int(t) for t in np.ravel(out.tokens)[:steps]]

    prompt = ToyTokenizer().encode("hello", add_bos=True)
    seq = list(prompt)
    step = jax.jit(lambda p, t: case.ref((p, t), lambda i, x: x + v if i == 1 else x)[0][0, -1])
    for _ in range(steps):
        seq.append(int(jnp.argmax(step(params, jnp.asarray([seq])))))
    ref = seq[len(prompt) :]
    assert got == ref, (got, ref)
    assert got != [int(t) for t in np.ravel(plain.tokens)[:steps]]
    mc.record(NAME, "steering in gm.text.Sampler (greedy tokens)", f"{steps}/{steps} tokens equal")
