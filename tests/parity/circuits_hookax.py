"""The hookax side of the circuits parity check (``nox -s parity_circuits``): the trained
induction model's weights in TransformerLens' layout, the prompts, and hookax's logits,
induction scores and edge attribution scores (EAP, and EAP-IG with ``IG_STEPS`` points),
written to one ``.npz`` that ``test_circuits_parity.py`` reads in the torch venv (auto-circuit
1.0.1 needs NumPy < 2, JAX 0.10 NumPy >= 2: the two sides cannot share a venv).

``python -m tests.parity.circuits_hookax OUT.npz``. The model is the small configuration of
``docs/circuits.md`` and ``tests/test_induction.py`` (2 layers, 2 heads of 16, 400 steps: a
few seconds to train), loaded from ``induction.load_or_train``'s cache (``$HOOKAX_CACHE`` or
``~/.cache/hookax``) after the first run.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import hookax as hx
from hookax.examples import induction

CFG = induction.Config(vocab=32, d_model=32, n_heads=2, half=8, batch=32, steps=400)
BATCH = 32
IG_STEPS = 5  # EAP-IG's points (alpha = 1/5, 2/5, ..., 1)


def prompts(cfg: induction.Config = CFG) -> dict[str, Any]:
    """The repeated tokens (``2 * half``), and the prompts of the metric: the repeated tokens
    but the last (the answer, which only the earlier copy predicts), their corrupted version
    (the first half replaced by fresh tokens), and a wrong answer (the prompt's last token)."""
    repeated = induction.repeated_tokens(jax.random.key(9), BATCH, cfg.half, cfg.vocab)
    corrupt = induction.corrupted(jax.random.key(7), repeated, cfg.vocab)
    return {
        "repeated": repeated,
        "clean": repeated[:, :-1],
        "corrupt": corrupt[:, :-1],
        "answer": repeated[:, -1],
        "wrong": repeated[:, -2],
    }


def metrics(p: dict[str, Any]) -> dict[str, Any]:
    """auto-circuit's two metrics at the last position, averaged over the batch:
    ``logprob`` (its ``grad_function="logprob", answer_function="avg_val"``) and
    ``logit_diff`` (``"logit"``, ``"avg_diff"``)."""
    rows = jnp.arange(p["clean"].shape[0])

    def logprob(y: Any) -> Any:
        return jax.nn.log_softmax(y[:, -1])[rows, p["answer"]].mean()

    def logit_diff(y: Any) -> Any:
        return (y[rows, -1, p["answer"]] - y[rows, -1, p["wrong"]]).mean()

    return {"logprob": logprob, "logit_diff": logit_diff}


def tl_weights(model: induction.AttnOnly) -> dict[str, np.ndarray]:
    """The weights under TransformerLens' ``HookedTransformer`` state-dict names and layouts:
    ``W_Q[head, d_model, d_head]`` from the query kernel ``[d_model, head, d_head]``; the output
    kernel ``[head, d_head, d_model]`` is ``W_O`` as it is."""
    out = {
        "embed.W_E": model.embed.embedding[...],
        "pos_embed.W_pos": model.pos_embed.embedding[...],
        "unembed.W_U": model.unembed.kernel[...],
        "unembed.b_U": model.unembed.bias[...],
    }
    for i, block in enumerate(model.blocks):
        attn = block.attn
        for letter, proj in (("Q", attn.query), ("K", attn.key), ("V", attn.value)):
            out[f"blocks.{i}.attn.W_{letter}"] = jnp.transpose(proj.kernel[...], (1, 0, 2))
            out[f"blocks.{i}.attn.b_{letter}"] = proj.bias[...]
        out[f"blocks.{i}.attn.W_O"] = attn.out.kernel[...]
        out[f"blocks.{i}.attn.b_O"] = attn.out.bias[...]
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def compute(cfg: induction.Config = CFG) -> dict[str, np.ndarray]:
    start = time.perf_counter()
    model = induction.load_or_train(cfg)
    loaded = time.perf_counter() - start
    p = prompts(cfg)
    pattern = induction.patterns(model, p["repeated"])
    out: dict[str, Any] = {f"w:{k}": v for k, v in tl_weights(model).items()}
    out.update({k: np.asarray(v) for k, v in p.items()})
    out["config"] = np.asarray([cfg.n_layers, cfg.d_model, cfg.n_heads, 2 * cfg.half, cfg.vocab])
    out["logits"] = np.asarray(model(p["clean"]))
    out["induction"] = np.asarray(induction.induction_scores(pattern))
    out["prev_token"] = np.asarray(induction.prev_token_scores(pattern))
    start = time.perf_counter()
    for name, metric in metrics(p).items():
        edges = hx.edge_attribution(
            model, (p["clean"],), (p["corrupt"],), metric, induction.components()
        )
        out[f"eap:{name}"] = edges.scores
        out["sources"], out["destinations"] = edges.sources, edges.destinations
        out[f"metric:{name}"] = [metric(model(p["clean"])), metric(model(p["corrupt"]))]
        ig = hx.edge_attribution(
            model, (p["clean"],), (p["corrupt"],), metric, induction.components(), steps=IG_STEPS
        )
        assert ig.sources == edges.sources and ig.destinations == edges.destinations
        out[f"eap_ig:{name}"] = ig.scores
    out["ig_steps"] = np.asarray(IG_STEPS)
    out["seconds"] = np.asarray([loaded, time.perf_counter() - start])
    return {k: np.asarray(v) for k, v in out.items()}


def main(path: str) -> None:
    out = compute()
    np.savez(path, **out)
    load, eap = out["seconds"]
    print(f"hookax side written to {path}: model loaded in {load:.1f} s, EAP in {eap:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1])
