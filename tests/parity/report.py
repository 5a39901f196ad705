"""The agreement table and the side-by-side timings of the parity tests, as Markdown:
``nox -s parity -- report`` (or ``python -m tests.parity.report [--runs N]`` where torch and
TransformerLens are installed).

Agreement: the largest ``|TransformerLens - hookax|`` of each quantity (:mod:`.compare`).
Timings: warm (after a first call that compiles), the minimum of ``--runs`` calls, for the
block-every sweep (TransformerLens: the clean ``run_with_cache`` and
``get_act_patch_block_every``) and attribution patching (TransformerLens: its hooks, a clean
cache and one corrupted forward and backward). torch runs on one thread (:func:`.compare.build`),
its faster setting on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from . import compare


def _ready(x: Any) -> Any:
    return jax.block_until_ready(x)


def _time(fn: Callable[[compare.Setup], Any], s: compare.Setup, runs: int) -> tuple[float, float]:
    """The first call's time and the warm minimum, in seconds."""
    t = time.perf_counter()
    _ready(fn(s))
    first = time.perf_counter() - t
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        _ready(fn(s))
        best = min(best, time.perf_counter() - t)
    return first, best


def agreement(s: compare.Setup) -> list[str]:
    rows = ["| quantity | shape | max abs difference |", "| --- | --- | --- |"]
    for fn in compare.ALL.values():
        for name, (tl, mine) in fn(s).items():
            diff = float(np.abs(tl - mine).max())
            rows.append(f"| {name} | {tuple(tl.shape)} | {diff:.1e} |")
    return rows


def timings(s: compare.Setup, runs: int) -> list[str]:
    pairs = [
        ("block-every sweep", compare.tl_block_every, compare.hx_block_every),
        ("attribution patching", compare.tl_attribution, compare.hx_attribution),
    ]
    rows = [
        "| | TransformerLens, warm | hookax, warm | TransformerLens, first call | hookax, "
        "first call (compiles) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, tl, mine in pairs:
        tl_first, tl_warm = _time(tl, s, runs)
        hx_first, hx_warm = _time(mine, s, runs)
        rows.append(
            f"| {label} | {tl_warm * 1e3:.1f} ms | {hx_warm * 1e3:.1f} ms | "
            f"{tl_first * 1e3:.0f} ms | {hx_first * 1e3:.0f} ms |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="warm calls per timing (min taken)")
    opts = parser.parse_args()
    s = compare.build()
    c = compare.CFG
    print(
        f"TransformerLens {importlib.metadata.version('transformer-lens')}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), jax {jax.__version__}, "
        f"{platform.processor() or platform.machine()}; {c['n_layers']} layers, d_model "
        f"{c['d_model']}, {c['n_heads']} heads, batch {compare.BATCH}, {c['n_ctx']} positions\n"
    )
    print("\n".join(timings(s, opts.runs)))  # first: hookax's first calls compile
    print()
    print("\n".join(agreement(s)))


if __name__ == "__main__":
    main()
