"""TransformerLens 3.9 (``HookedTransformer``) and hookax on the same weights: each quantity
computed both ways, as numpy arrays, for the tests (``test_transformer_lens.py``) and the report
(``python -m tests.parity.report``: the agreement table and the timings).

The model is a random seeded ``HookedTransformer`` (3 layers, d_model 64, 4 heads, LayerNorm,
biases; its biases and norms drawn at random too, as TransformerLens initialises them to zeros
and ones) and the same weights in an NNX GPT written the usual way (:mod:`.nnx_gpt`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig, patching
from transformer_lens.hook_points import HookPoint

import hookax as hx

from .nnx_gpt import GPT, INLINE_PARTS, NAMES, PARTS, InlineGPT, from_transformer_lens

CFG: dict[str, Any] = dict(
    n_layers=3, d_model=64, n_heads=4, d_head=16, d_mlp=256, d_vocab=50, n_ctx=8
)
BATCH = 2
ANSWER, WRONG = 7, 2  # the metric: logit of ANSWER minus WRONG at the last position
CACHE = ("resid_pre", "pattern", "z", "attn_out", "mlp_out")


def tl_metric(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


def hx_metric(logits: Any) -> Any:
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


@dataclasses.dataclass
class Setup:
    tl: HookedTransformer
    nnx: GPT
    clean: torch.Tensor
    corrupt: torch.Tensor

    @property
    def jclean(self) -> Any:
        return jnp.asarray(self.clean.numpy())

    @property
    def jcorrupt(self) -> Any:
        return jnp.asarray(self.corrupt.numpy())


def build(seed: int = 0, n_ctx: int | None = None, batch: int = BATCH) -> Setup:
    """The random seeded ``HookedTransformer``, the NNX GPT with its weights, and clean and
    corrupted tokens (the corrupted ones differ at positions 1 and 4); ``n_ctx`` positions
    (default ``CFG``'s) and ``batch`` sequences."""
    config = {**CFG, "n_ctx": n_ctx or CFG["n_ctx"]}
    # One thread: on a shared 2-core machine torch's second thread waits on the other processes
    # (the block sweep measured 4.7-7.8 s with two threads, 0.24-0.40 s with one).
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = HookedTransformerConfig(
        **config,
        act_fn="gelu_new",
        normalization_type="LN",
        attn_only=False,
        seed=seed,
        device="cpu",
    )
    with warnings.catch_warnings():  # 3.9 announces HookedTransformer's removal in 4.0
        warnings.filterwarnings("ignore", "HookedTransformer is deprecated", DeprecationWarning)
        tl = HookedTransformer(cfg)
    tl.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in tl.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "w":  # LayerNorm weights: around one
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif leaf == "b" or leaf.startswith("b_"):  # LayerNorm and linear biases
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    sd = {k: v.detach().numpy() for k, v in tl.state_dict().items()}
    model = from_transformer_lens(sd, config)
    clean = torch.randint(0, CFG["d_vocab"], (batch, config["n_ctx"]), generator=gen)
    corrupt = clean.clone()
    corrupt[:, 1] = (clean[:, 1] + 5) % CFG["d_vocab"]
    corrupt[:, 4] = (clean[:, 4] + 11) % CFG["d_vocab"]
    return Setup(tl, model, clean, corrupt)


def _np(x: Any) -> np.ndarray:
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


Pair = tuple[np.ndarray, np.ndarray]


def cache(s: Setup) -> dict[str, Pair]:
    """``run_with_cache``'s values against ``hx.transformer_names``' capture, every layer
    stacked on the leading axis, and the logits."""
    with torch.no_grad():
        tl_logits, tl_cache = s.tl.run_with_cache(s.clean)
    logits, acts = NAMES.capture(s.nnx, *CACHE)(s.jclean)
    out: dict[str, Pair] = {}
    for name in CACHE:
        ref = torch.stack([tl_cache[name, layer] for layer in range(CFG["n_layers"])])
        value = acts[name]
        if name == "pattern":  # nnx.MultiHeadAttention's leading group axis (one group)
            value = value[:, 0]
        out[name] = (_np(ref), _np(value))
    out["logits"] = (_np(tl_logits), _np(logits))
    return out


def _stream(s: Setup) -> tuple[Any, hx.ResidualStream]:
    with torch.no_grad():
        _, tl_cache = s.tl.run_with_cache(s.clean)
    _, acts = PARTS.capture(s.nnx)(s.jclean)
    return tl_cache, hx.ResidualStream(acts, PARTS, s.nnx)


def residual(s: Setup) -> dict[str, Pair]:
    """The residual-stream views: ``stack_head_results`` and ``decompose_resid`` (labels
    checked), ``accumulated_resid``, the final norm applied to it (frozen scale, and
    ``apply_ln=True``, which recomputes the norm's statistics for each entry), and direct logit
    attribution
    (``cache.logit_attrs`` of the decomposed stream and of the heads, at the last position)."""
    tl_cache, rs = _stream(s)
    answer, wrong = torch.full((BATCH,), ANSWER), torch.full((BATCH,), WRONG)
    with torch.no_grad():
        heads_last = tl_cache.stack_head_results(layer=-1, pos_slice=-1)
        heads, tl_labels = tl_cache.stack_head_results(layer=-1, return_labels=True)
        dec, dec_labels = tl_cache.decompose_resid(return_labels=True)
        acc, acc_labels = tl_cache.accumulated_resid(return_labels=True)
        acc_frozen = tl_cache.apply_ln_to_stack(acc, layer=-1)
        acc_ln = tl_cache.accumulated_resid(apply_ln=True)
        dec_last = tl_cache.decompose_resid(pos_slice=-1)
        dla = tl_cache.logit_attrs(dec_last, answer, wrong, pos_slice=-1)
        dla_heads = tl_cache.logit_attrs(heads_last, answer, wrong, pos_slice=-1)
    mine, mine_dec, mine_acc = rs.stack_head_results(), rs.decompose_resid(), rs.accumulated_resid()
    for got, want in [(mine, tl_labels), (mine_dec, dec_labels), (mine_acc, acc_labels)]:
        if list(got.labels) != list(want):
            raise AssertionError(f"labels differ: hookax {got.labels}, TransformerLens {want}")
    frozen = rs.apply_ln_to_stack(mine_acc, weight=False)
    ja, jw = jnp.full((BATCH,), ANSWER), jnp.full((BATCH,), WRONG)
    # weight=False: TransformerLens' apply_ln_to_stack (the norm's weight folded elsewhere)
    mine_dla = rs.logit_attrs(rs.decompose_resid(pos=-1), ja, jw, pos=-1, weight=False)
    mine_dla_heads = rs.logit_attrs(rs.stack_head_results(pos=-1), ja, jw, pos=-1, weight=False)
    return {
        "stack_head_results": (_np(heads), _np(mine.values)),
        "decompose_resid": (_np(dec), _np(mine_dec.values)),
        "accumulated_resid": (_np(acc), _np(mine_acc.values)),
        "apply_ln_to_stack": (_np(acc_frozen), _np(frozen.values)),
        "accumulated_resid(apply_ln=True)": (
            _np(acc_ln),
            _np(rs.accumulated_resid(apply_ln=True).values),
        ),
        "logit_attrs (decomposed)": (_np(dla), _np(mine_dla)),
        "logit_attrs (heads)": (_np(dla_heads), _np(mine_dla_heads)),
    }


def inline_positions(s: Setup) -> dict[str, Pair]:
    """The GPT adding its positions inline (no call site for them): hookax's ``decompose_resid``
    against TransformerLens' (whose ``pos_embed`` is hookax's ``embed_rest``), and its sum
    against the final stream."""
    with torch.no_grad():
        _, tl_cache = s.tl.run_with_cache(s.clean)
        dec, labels = tl_cache.decompose_resid(return_labels=True)
        final = tl_cache["resid_post", CFG["n_layers"] - 1]
    model = InlineGPT(s.nnx)
    _, acts = INLINE_PARTS.capture(model)(s.jclean)
    mine = hx.ResidualStream(acts, INLINE_PARTS, model).decompose_resid()
    want = ["embed_rest" if label == "pos_embed" else label for label in labels]
    if list(mine.labels) != want:
        raise AssertionError(f"labels differ: hookax {mine.labels}, TransformerLens {want}")
    return {
        "decompose_resid (positions inline)": (_np(dec), _np(mine.values)),
        "its sum (positions inline)": (_np(final), _np(mine.sum())),
    }


def tl_block_every(s: Setup) -> Any:
    with torch.no_grad():
        _, clean_cache = s.tl.run_with_cache(s.clean)
        return patching.get_act_patch_block_every(s.tl, s.corrupt, clean_cache, tl_metric)


def hx_block_every(s: Setup) -> Any:
    return hx.patch_block_every(s.nnx, (s.jclean,), (s.jcorrupt,), hx_metric, PARTS)


def block_every(s: Setup) -> dict[str, Pair]:
    """``get_act_patch_block_every`` against ``hx.patch_block_every``: ``[3, layer, pos]``."""
    return {"patch_block_every": (_np(tl_block_every(s)), _np(hx_block_every(s)))}


ATTR_HOOKS = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "attn.hook_z")


def tl_attribution(s: Setup) -> tuple[Any, Any]:
    """Attribution patching with TransformerLens' hooks: ``(clean - corrupted) * grad`` at the
    corrupted run, summed over batch and features: ``[3, layer, pos]`` (resid_pre, attn_out,
    mlp_out) and ``[layer, pos, head]`` (z)."""
    model = s.tl

    def wanted(name: str) -> bool:
        return name.endswith(ATTR_HOOKS)

    with torch.no_grad():
        _, clean = model.run_with_cache(s.clean, names_filter=wanted)
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor, *, hook: HookPoint) -> None:
        acts[str(hook.name)] = tensor.detach()

    def keep_grad(tensor: torch.Tensor, *, hook: HookPoint) -> None:
        grads[str(hook.name)] = tensor.detach()

    model.reset_hooks()
    model.add_hook(wanted, keep, "fwd")
    model.add_hook(wanted, keep_grad, "bwd")
    try:
        tl_metric(model(s.corrupt)).backward()
    finally:
        model.reset_hooks()
        model.zero_grad(set_to_none=True)

    def term(name: str) -> torch.Tensor:
        return (clean[name] - acts[name]) * grads[name]

    n = CFG["n_layers"]
    rows = [
        torch.stack([term(f"blocks.{i}.{h}").sum((0, -1)) for i in range(n)])
        for h in ATTR_HOOKS[:3]
    ]
    z = torch.stack([term(f"blocks.{i}.attn.hook_z").sum((0, -1)) for i in range(n)])
    return torch.stack(rows), z


def hx_attribution(s: Setup) -> tuple[Any, Any]:
    n = CFG["n_layers"]
    where = [str(NAMES.act(k, i)) for k in ("resid_pre", "attn_out", "mlp_out") for i in range(n)]
    args = (s.nnx, (s.jclean,), (s.jcorrupt,), hx_metric)
    block = hx.attribution_patch(*args, where=where)
    z = hx.attribution_patch(*args, where=NAMES.z, heads=NAMES.axis("z", "head"))
    # [target, head, pos] -> [layer, pos, head], as TransformerLens' by-position layout
    return block.reshape(3, n, -1), jnp.swapaxes(z, 1, 2)


def attribution(s: Setup) -> dict[str, Pair]:
    """First-order patching with TransformerLens' hooks against ``hx.attribution_patch``."""
    (tb, tz), (hb, hz) = tl_attribution(s), hx_attribution(s)
    return {
        "attribution (block)": (_np(tb), _np(hb)),
        "attribution (z, by head)": (_np(tz), _np(hz)),
    }


ALL: dict[str, Callable[[Setup], dict[str, Pair]]] = {
    "cache": cache,
    "residual": residual,
    "inline_positions": inline_positions,
    "block_every": block_every,
    "attribution": attribution,
}
