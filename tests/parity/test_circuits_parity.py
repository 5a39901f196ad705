"""hookax's edge attribution patching and induction scores against auto-circuit 1.0.1 and
TransformerLens 2.16.1 on the same trained weights (``nox -s parity_circuits``); EAP-IG
against its definition computed on TransformerLens' hooks (the end of this file).

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


# --- EAP-IG: against its definition, computed on TransformerLens -------------------------------

# auto-circuit's ``mask_gradient_prune_scores(..., integrated_grad_samples=k)`` is another
# quantity: it sums the gradients of every edge's mask at masks 0, 1/k, ..., 1 (k + 1 points),
# every edge interpolated at once between the sender's value in that run and its corrupted one.
# EAP-IG (Hanna et al. 2024) interpolates the input embeddings, ``corrupt + alpha * (clean -
# corrupt)``, and averages the gradients of the receivers' inputs over ``alpha = 1/k, ..., 1``
# (its code up to February 2025; later versions take ``alpha = 0, ..., (k - 1)/k``). The anchor
# is that definition on TransformerLens' hooks: the embeddings' hook outputs replaced by the
# interpolation, a zero added to each receiver's input to differentiate with respect to.
IG_TOL = 1e-4  # relative to the largest score; measured 7.4e-8 (log-prob), 8.4e-8 (logit diff)


def _sender(cache: Any, name: str) -> Any:
    """A hookax sender's value from a TransformerLens cache, ``(batch, pos, d_model)``."""
    if name in ("embed", "pos_embed"):
        return cache[f"hook_{name}"]
    layer, head = (int(v) for v in name[1:].split("H"))
    return cache[f"blocks.{layer}.attn.hook_result"][:, :, head]


def _receiver(name: str, n_layers: int) -> tuple[str, int | None]:
    """A hookax receiver's hook and head (None: the whole stream)."""
    if name == "logits":
        return f"blocks.{n_layers - 1}.hook_resid_post", None
    label, kind = name.split(".")
    layer, head = (int(v) for v in label[1:].split("H"))
    return f"blocks.{layer}.hook_{kind}_input", head


def _torch_metric(s: dict[str, np.ndarray], metric: str) -> Any:
    answer, wrong = tokens(s, "answer"), tokens(s, "wrong")
    rows = torch.arange(len(answer))
    if metric == "logprob":
        return lambda y: torch.log_softmax(y[:, -1], -1)[rows, answer].mean()
    return lambda y: (y[rows, -1, answer] - y[rows, -1, wrong]).mean()


def eap_ig_by_hand(
    s: dict[str, np.ndarray], metric: str, steps: int, first: int = 1
) -> dict[tuple[str, str], float]:
    """EAP-IG on TransformerLens, from its definition, with ``alpha = first/steps, ...,
    (first + steps - 1)/steps``: ``sum((s_corrupt - s_clean) * mean_alpha(d metric / d r))``
    for every edge of hookax's graph (``steps=1``: EAP)."""
    model = tl_model(s)
    n_layers = model.cfg.n_layers
    clean, corrupt = tokens(s, "clean"), tokens(s, "corrupt")
    edges = list(zip((str(x) for x in s["sources"]), (str(x) for x in s["destinations"])))
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean)
        _, corrupt_cache = model.run_with_cache(corrupt)
    hooks = sorted({_receiver(r, n_layers)[0] for _, r in edges})
    grads = {h: torch.zeros_like(clean_cache[h]) for h in hooks}
    f = _torch_metric(s, metric)
    for k in range(first, first + steps):
        alpha = k / steps
        zeros = {h: torch.zeros_like(clean_cache[h], requires_grad=True) for h in hooks}

        def mix(act: Any, hook: Any, alpha: float = alpha) -> Any:
            c = corrupt_cache[hook.name]
            return c + alpha * (clean_cache[hook.name] - c)

        def shift(act: Any, hook: Any, zeros: dict = zeros) -> Any:
            return act + zeros[hook.name]

        fwd = [("hook_embed", mix), ("hook_pos_embed", mix)] + [(h, shift) for h in hooks]
        y = model.run_with_hooks(clean, fwd_hooks=fwd)
        got = torch.autograd.grad(f(y), [zeros[h] for h in hooks])
        for h, g in zip(hooks, got):
            grads[h] += g / steps
    out = {}
    for src, dest in edges:
        delta = _sender(corrupt_cache, src) - _sender(clean_cache, src)
        hook, head = _receiver(dest, n_layers)
        g = grads[hook] if head is None else grads[hook][:, :, head]
        out[(src, dest)] = float((delta.double() * g.double()).sum())
    return out


def _relative(s: dict[str, np.ndarray], key: str, anchor: dict) -> tuple[float, float]:
    mine = {(str(a), str(b)): float(v) for a, b, v in zip(s["sources"], s["destinations"], s[key])}
    assert set(mine) == set(anchor)
    diff = max(abs(mine[e] - anchor[e]) for e in anchor)
    scale = max(abs(v) for v in anchor.values())
    return diff / scale, scale


@pytest.mark.parametrize("metric", ["logprob", "logit_diff"])
def test_eap_ig_agrees_with_its_definition_on_transformer_lens(
    saved: dict[str, np.ndarray], metric: str
) -> None:
    # the anchor with one point is EAP, which auto-circuit agrees with (above)
    relative, scale = _relative(saved, f"eap:{metric}", eap_ig_by_hand(saved, metric, 1))
    assert scale > 0.1 and relative <= REL_TOL, relative
    steps = int(saved["ig_steps"])
    anchor = eap_ig_by_hand(saved, metric, steps)
    relative, scale = _relative(saved, f"eap_ig:{metric}", anchor)
    assert scale > 0.1 and relative <= IG_TOL, (
        f"{metric}: max |anchor - hookax| EAP-IG = {relative:.3g} of the largest {scale:.3g}"
    )
    # the grids differ: EAP-IG's points are not EAP's, nor those of alpha = 0, ..., (k-1)/k
    for other in (eap_ig_by_hand(saved, metric, 1), eap_ig_by_hand(saved, metric, steps, 0)):
        assert _relative(saved, f"eap_ig:{metric}", other)[0] > 100 * IG_TOL
