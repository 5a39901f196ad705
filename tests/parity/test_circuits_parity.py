"""hookax's edge attribution patching and induction scores against auto-circuit 1.0.1 and
TransformerLens 2.16.1 on the same trained weights (``nox -s parity_circuits``).

The hookax side runs in a venv of its own (auto-circuit needs NumPy < 2, JAX 0.10 NumPy >= 2):
:mod:`.circuits_hookax` trains (or loads) the small induction model of ``docs/circuits.md``
and writes its weights in TransformerLens' layout, the prompts, and hookax's logits, induction
scores and ``hx.edge_attribution`` scores to the ``.npz`` that ``$HOOKAX_PARITY_CIRCUITS``
names. Here the same weights go into an attention-only ``HookedTransformer`` (no norms,
standard positional embeddings, biases), whose logits must agree first; auto-circuit wraps it
(``patchable_model``, factorized, separate q/k/v, the last position) and scores every edge with
the corrupted prompts' activations (resample ablation).

The two graphs name the same edges differently, and auto-circuit's scores have the opposite
sign (it differentiates the loss ``-metric``):

- auto-circuit's ``Resid Start`` (``blocks.0.hook_resid_pre``) is hookax's ``embed`` plus
  ``pos_embed`` (two senders; EAP is linear in the sender's change, so their scores add);
- ``A{l}.{h}`` (``attn.hook_result``, the head's output without ``b_O``) is ``L{l}H{h}``;
- ``A{l}.{h}.Q`` / ``.K`` / ``.V`` (``hook_q_input`` ...) is ``L{l}H{h}.q`` / ``.k`` / ``.v``;
- ``Resid End`` (the last block's ``hook_resid_post``, the unembedding's input) is ``logits``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

pytest.importorskip("auto_circuit")
pytest.importorskip("transformer_lens.HookedTransformer")

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

# The bounds, each relative to the largest value compared. Every score is a float32 sum of
# ``(corrupt - clean) * grad`` over the batch, the positions and d_model (32 * 15 * 32 terms),
# summed in different orders by XLA and torch: about sqrt(15360) * 1.2e-7 = 1.5e-5 of the
# largest term at worst. Measured on 2 CPU cores: 3.0e-6 (log-probability), 2.6e-7 (logit
# difference); held to 1e-4.
REL_TOL = 1e-4
LOGITS_TOL = 1e-5  # relative to the largest logit (21.4); measured 5.6e-7 (1.2e-5 absolute)
INDUCTION_TOL = 1e-5  # attention weights in [0, 1]; measured 1.8e-7
TOP = 5  # the top edges come out in the same order (measured: the top 8, the top 10 as a set)


@pytest.fixture(scope="module")
def saved() -> dict[str, np.ndarray]:
    path = os.environ.get("HOOKAX_PARITY_CIRCUITS")
    if not path or not os.path.exists(path):
        pytest.skip("HOOKAX_PARITY_CIRCUITS names no file: run `nox -s parity_circuits`")
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def tl_model(s: dict[str, np.ndarray]) -> HookedTransformer:
    """An attention-only ``HookedTransformer`` holding the saved weights, with each head's
    output (``use_attn_result``) and its own q/k/v inputs (``use_split_qkv_input``), as
    auto-circuit's factorized graph needs."""
    torch.set_num_threads(1)  # a shared 2-core machine: see compare.build
    n_layers, d_model, n_heads, n_ctx, vocab = (int(v) for v in s["config"])
    cfg = HookedTransformerConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        d_head=d_model // n_heads,
        n_ctx=n_ctx,
        d_vocab=vocab,
        act_fn=None,
        attn_only=True,
        normalization_type=None,
        positional_embedding_type="standard",
        use_attn_result=True,
        use_split_qkv_input=True,
        default_prepend_bos=False,
        device="cpu",
        seed=0,
    )
    model = HookedTransformer(cfg)
    weights = {k[2:]: torch.from_numpy(v) for k, v in s.items() if k.startswith("w:")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    params = {name for name, _ in model.named_parameters()}
    assert params <= set(weights), sorted(params - set(weights))
    assert not set(missing) & params, missing
    return model.eval()


def tokens(s: dict[str, np.ndarray], name: str) -> torch.Tensor:
    return torch.from_numpy(s[name].astype(np.int64))


def test_logits_agree(saved: dict[str, np.ndarray]) -> None:
    model = tl_model(saved)
    with torch.no_grad():
        logits = model(tokens(saved, "clean")).numpy()
    assert logits.shape == saved["logits"].shape
    diff = float(np.abs(logits - saved["logits"]).max())
    scale = float(np.abs(logits).max())
    assert diff <= LOGITS_TOL * scale, f"max |TransformerLens - hookax| logits = {diff:.3g}"


def tl_induction_scores(s: dict[str, np.ndarray]) -> np.ndarray:
    """TransformerLens' induction score from its cache: each head's mean attention from every
    token of the repeated half (query ``i >= half``) to the token after its earlier copy (key
    ``i - half + 1``), the stripe ``pattern.diagonal(offset=1 - half)`` without its first
    entry, over the batch: ``(layer, head)``."""
    model = tl_model(s)
    repeated = tokens(s, "repeated")
    half = repeated.shape[1] // 2
    with torch.no_grad():
        _, cache = model.run_with_cache(repeated, names_filter=lambda n: n.endswith("pattern"))
    rows = []
    for layer in range(model.cfg.n_layers):
        pattern = cache["pattern", layer]  # (batch, head, query, key)
        stripe = pattern.diagonal(offset=1 - half, dim1=-2, dim2=-1)[..., 1:]
        rows.append(stripe.mean(dim=(0, -1)))
    return torch.stack(rows).numpy()


def test_induction_scores_agree(saved: dict[str, np.ndarray]) -> None:
    tl = tl_induction_scores(saved)
    mine = saved["induction"]
    diff = float(np.abs(tl - mine).max())
    assert diff <= INDUCTION_TOL, f"max |TransformerLens - hookax| induction score = {diff:.3g}"
    # the circuit is there: an induction head in layer 1, none in layer 0
    assert tl[1].max() > 0.6 and tl[0].max() < 0.1, tl


def _edge_name(node: str) -> str:
    if node == "Resid End":
        return "logits"
    head = node.split(".")
    label = f"L{head[0][1:]}H{head[1]}"
    return label if len(head) == 2 else f"{label}.{head[2].lower()}"


def hookax_edges(s: dict[str, np.ndarray], metric: str) -> dict[tuple[str, str], float]:
    """hookax's scores of ``metric``, on auto-circuit's edges and sign: ``embed`` and
    ``pos_embed`` summed into ``Resid Start``, every score negated."""
    out: dict[tuple[str, str], float] = {}
    for src, dest, score in zip(s["sources"], s["destinations"], s[f"eap:{metric}"]):
        src = "Resid Start" if src in ("embed", "pos_embed") else str(src)
        key = (src, str(dest))
        out[key] = out.get(key, 0.0) - float(score)
    return out


def auto_circuit_edges(s: dict[str, np.ndarray], method: str) -> dict[tuple[str, str], float]:
    """auto-circuit's EAP scores, keyed by hookax's names (``Resid Start`` kept).

    ``method``: ``mask_gradient_logprob`` (``mask_gradient_prune_scores`` with
    ``grad_function="logprob"``, ``answer_function="avg_val"``, ``mask_val=0``), or
    ``mask_gradient_logit_diff`` (``"logit"``, ``"avg_diff"``), or ``eap_logit_diff``
    (``edge_attribution_patching_prune_scores``: the slower replication of Syed et al.'s
    code, with TransformerLens' backward hooks; the same logit difference)."""
    from auto_circuit.data import PromptDataLoader, PromptDataset
    from auto_circuit.prune_algos.edge_attribution_patching import (
        edge_attribution_patching_prune_scores,
    )
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.types import AblationType
    from auto_circuit.utils.graph_utils import patchable_model

    model = patchable_model(
        tl_model(s), factorized=True, slice_output="last_seq", separate_qkv=True
    )
    clean, corrupt = tokens(s, "clean"), tokens(s, "corrupt")
    answers = [a.reshape(1) for a in tokens(s, "answer")]
    wrong = [w.reshape(1) for w in tokens(s, "wrong")]
    data = PromptDataset(clean, corrupt, answers, wrong)
    loader = PromptDataLoader(data, seq_len=None, diverge_idx=0, batch_size=len(clean))
    if method == "eap_logit_diff":
        scores = edge_attribution_patching_prune_scores(model, loader, None, answer_diff=True)
    else:
        grad, answer = {
            "mask_gradient_logprob": ("logprob", "avg_val"),
            "mask_gradient_logit_diff": ("logit", "avg_diff"),
        }[method]
        scores = mask_gradient_prune_scores(
            model,
            loader,
            None,
            grad_function=grad,
            answer_function=answer,
            mask_val=0.0,
            ablation_type=AblationType.RESAMPLE,
            clean_corrupt="corrupt",
        )
    out = {}
    for edge in model.edges:
        src = edge.src.name if edge.src.name == "Resid Start" else _edge_name(edge.src.name)
        out[(src, _edge_name(edge.dest.name))] = float(
            scores[edge.dest.module_name][edge.patch_idx]
        )
    return out


METHODS = {
    "mask_gradient_logprob": "logprob",
    "mask_gradient_logit_diff": "logit_diff",
    "eap_logit_diff": "logit_diff",
}


def compare(s: dict[str, np.ndarray], method: str) -> dict[str, Any]:
    """auto-circuit against hookax on every edge: the largest difference, absolute and
    relative to the largest score, and the top edges of each."""
    ac, mine = auto_circuit_edges(s, method), hookax_edges(s, METHODS[method])
    assert set(ac) == set(mine), sorted(set(ac) ^ set(mine))
    keys = sorted(ac)
    a = np.asarray([ac[k] for k in keys])
    m = np.asarray([mine[k] for k in keys])
    diff = float(np.abs(a - m).max())
    top = {
        name: [keys[i] for i in np.argsort(-np.abs(v), kind="stable")]
        for name, v in (("auto_circuit", a), ("hookax", m))
    }
    return {
        "edges": len(keys),
        "max_abs_diff": diff,
        "max_abs_score": float(np.abs(a).max()),
        "relative": diff / float(np.abs(a).max()),
        "top": top,
        "auto_circuit": ac,
        "hookax": mine,
    }


@pytest.mark.parametrize("method", list(METHODS))
def test_edge_attribution_agrees_with_auto_circuit(
    saved: dict[str, np.ndarray], method: str
) -> None:
    c = compare(saved, method)
    assert c["max_abs_score"] > 0.1, "auto-circuit's scores are all near zero; no test"
    assert c["relative"] <= REL_TOL, (
        f"{method}: max |auto-circuit - hookax| = {c['max_abs_diff']:.3g}, "
        f"{c['relative']:.3g} of the largest score {c['max_abs_score']:.3g}"
    )
    assert c["top"]["auto_circuit"][:TOP] == c["top"]["hookax"][:TOP]


def test_the_same_circuit_on_top(saved: dict[str, np.ndarray]) -> None:
    """The K-composition edge, the previous-token head into the induction head's key, is among
    the top edges of both (log-probability of the answer)."""
    prev, ind = saved["prev_token"], tl_induction_scores(saved)
    edge = (f"L0H{int(prev[0].argmax())}", f"L1H{int(ind[1].argmax())}.k")
    c = compare(saved, "mask_gradient_logprob")
    assert edge in c["top"]["auto_circuit"][:TOP] and edge in c["top"]["hookax"][:TOP]
