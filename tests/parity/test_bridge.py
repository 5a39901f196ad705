"""hookax against the current TransformerLens (4.x), whose one model class is
``TransformerBridge`` (``HookedTransformer`` was removed): a random seeded tiny GPT-2 is made with
``transformers``, saved to a folder and booted as a bridge offline, and an NNX GPT holds the
same weights (:func:`.nnx_gpt.from_gpt2`). The logits, the bridge's ``run_with_cache`` and the
block-every patching sweep agree with hookax to 1e-5 (``nox -s parity_bridge``).

The bridge runs with Hugging Face's numerics (no ``enable_compatibility_mode()``, which folds
the norms and centres the weights as ``HookedTransformer`` did), so every activation is the
unfolded model's, as hookax sees it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformer_lens.model_bridge")
if int(importlib.metadata.version("transformer-lens").split(".")[0]) < 4:
    # TransformerLens 3.9 has a bridge too, next to HookedTransformer: ``nox -s parity`` checks
    # HookedTransformer there, and this check runs on 4.x (``nox -s parity_bridge``).
    pytest.skip("the bridge check runs on TransformerLens 4", allow_module_level=True)

import jax.numpy as jnp
import torch
from transformer_lens import patching
from transformer_lens.model_bridge import TransformerBridge
from transformers import GPT2Config, GPT2LMHeadModel

import hookax as hx

from .nnx_gpt import GPT, NAMES, PARTS, from_gpt2

TOL = 1e-5
LAYERS, D, HEADS, VOCAB, N_POS, SEQ, BATCH = 3, 64, 4, 50, 16, 8, 2
ANSWER, WRONG = 7, 2  # the metric: logit of ANSWER minus WRONG at the last position
# hookax's transformer names -> the bridge's hook, per layer
HOOKS = {
    "resid_pre": "hook_resid_pre",
    "pattern": "attn.hook_pattern",
    "z": "attn.hook_z",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
}


def _metric(logits: Any) -> Any:
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


def _gpt2(seed: int) -> GPT2LMHeadModel:
    """A random GPT-2 with no dropout; its biases and norms drawn at random too (GPT-2
    initialises them to zeros and ones)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=LAYERS,
        n_embd=D,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=N_POS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.1,
    )
    model = GPT2LMHeadModel(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


class Setup:
    def __init__(self, folder: Path, seed: int = 0) -> None:
        torch.set_num_threads(1)  # see compare.build
        hf = _gpt2(seed)
        hf.save_pretrained(folder)  # no tokenizer: the bridge gets token ids
        sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
        self.nnx: GPT = from_gpt2(sd, HEADS)
        self.bridge = TransformerBridge.boot_transformers(str(folder), device="cpu")
        self.bridge.eval()
        gen = torch.Generator().manual_seed(seed + 2)
        self.clean = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        self.corrupt = self.clean.clone()
        self.corrupt[:, 1] = (self.clean[:, 1] + 5) % VOCAB
        self.corrupt[:, 4] = (self.clean[:, 4] + 11) % VOCAB
        self.jclean = jnp.asarray(self.clean.numpy())
        self.jcorrupt = jnp.asarray(self.corrupt.numpy())


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("gpt2"))


def _check(name: str, tl: Any, mine: Any) -> float:
    tl, mine = np.asarray(tl), np.asarray(mine)
    assert tl.shape == mine.shape, (name, tl.shape, mine.shape)
    assert np.ptp(tl) > 1e-2, f"{name}: TransformerLens' values are all equal; no test"
    diff = float(np.abs(tl - mine).max())
    assert diff <= TOL, f"{name}: max |TransformerBridge - hookax| = {diff:.3g}"
    return diff


def cache_pairs(s: Setup) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The bridge's logits and ``run_with_cache`` values (every layer stacked on the leading
    axis) against the NNX GPT's and ``hx.transformer_names``' capture."""
    with torch.no_grad():
        tl_logits, tl_cache = s.bridge.run_with_cache(s.clean)
    logits, acts = NAMES.capture(s.nnx, *HOOKS)(s.jclean)
    out = {"logits": (tl_logits.numpy(), np.asarray(logits))}
    for name, hook in HOOKS.items():
        ref = torch.stack([tl_cache[f"blocks.{i}.{hook}"] for i in range(LAYERS)]).numpy()
        value = np.asarray(acts[name])
        if name == "pattern":  # nnx.MultiHeadAttention's leading group axis (one group)
            value = value[:, 0]
        out[name] = (ref, value)
    return out


def block_every_pair(s: Setup) -> tuple[np.ndarray, np.ndarray]:
    """``patching.get_act_patch_block_every`` on the bridge against ``hx.patch_block_every``:
    ``[3, layer, pos]``."""
    with torch.no_grad():
        _, clean_cache = s.bridge.run_with_cache(s.clean)
        tl = patching.get_act_patch_block_every(s.bridge, s.corrupt, clean_cache, _metric)
    mine = hx.patch_block_every(s.nnx, (s.jclean,), (s.jcorrupt,), _metric, PARTS)
    return tl.numpy(), np.asarray(mine)


@pytest.mark.parametrize("name", ["logits", *HOOKS])
def test_cache_agrees_with_bridge(setup: Setup, name: str) -> None:
    _check(name, *cache_pairs(setup)[name])


def test_block_every_agrees_with_bridge(setup: Setup) -> None:
    _check("patch_block_every", *block_every_pair(setup))
