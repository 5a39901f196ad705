"""hookax against TransformerLens 3.9 (``HookedTransformer``) on the same random weights: the
cache, the residual-stream views and direct logit attribution, the block-every patching sweep
and attribution patching agree to 1e-5 (``nox -s parity``; :mod:`.compare` computes both
sides)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformer_lens.HookedTransformer")  # removed in TransformerLens 4

from . import compare

TOL = 1e-5


@pytest.fixture(scope="module")
def setup() -> compare.Setup:
    return compare.build()


@pytest.mark.parametrize("kind", list(compare.ALL))
def test_agrees_with_transformer_lens(setup: compare.Setup, kind: str) -> None:
    pairs = compare.ALL[kind](setup)
    for name, (tl, mine) in pairs.items():
        assert tl.shape == mine.shape, (name, tl.shape, mine.shape)
        assert np.ptp(tl) > 1e-2, f"{name}: TransformerLens' values are all equal; no test"
        diff = float(np.abs(tl - mine).max())
        assert diff <= TOL, f"{name}: max |TransformerLens - hookax| = {diff:.3g}"
