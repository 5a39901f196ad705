"""First calls beside TransformerLens: the question a notebook asks for the first time.

TransformerLens 3.9 (PyTorch, eager: nothing to trace or compile) and hookax on the same
weights (the parity tests' random GPT: 3 layers, d_model 64, 4 heads, LayerNorm, GELU; 16
positions, batch 1), each workflow in fresh processes, both sides in the same process, after
each model ran one forward:

* ``cache``: ``run_with_cache`` (every hook) / ``hx.transformer_names(...).capture`` (every
  name), eagerly;
* ``resid grid``: ``patching.get_act_patch_resid_pre`` / ``hx.patch_grid`` over
  ``resid_pre`` (3 x 16);
* ``head grid``: ``get_act_patch_attn_head_out_all_pos`` / heads, every position at once (3 x 4);
* ``head x position``: ``get_act_patch_attn_head_out_by_pos`` / heads x positions (3 x 16 x 4);
* ``attribution``: TransformerLens' hooks (a clean cache, one corrupted forward and backward)
  / ``hx.attribution_patch`` over resid_pre, attn_out, mlp_out and z by head;
* ``steering``: 10 greedy tokens with a vector added to block 1's output: a hook on
  ``blocks.1.hook_resid_post`` / ``hx.intercept`` in a ``jax.jit`` step.

A second table gives JAX's own costs on the same model without hookax (:data:`FLOORS`): the
eager forward, one trace of the forward and of its gradient, and ``jax.jit``'s first call.

hookax runs with its first calls as the user's session has them (``hx.first_call("auto")``:
small programs run with NumPy while XLA compiles) and, in other processes, compiled
(``"compile"``). Figures: first call, and the warm call (min of 5), milliseconds; min over
``PAIRS`` process pairs (TransformerLens first in one, hookax first in the other). torch on one
thread, as the parity report runs it. Needs torch and transformer-lens (``nox -s parity``'s
venv): ``.nox/parity/bin/python -m benchmarks firstcall_tl``; elsewhere it says so and skips.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from typing import Any

from benchmarks._timing import child_json, compiled_programs, table

WORKFLOWS = ("cache", "resid grid", "head grid", "head x position", "attribution", "steering")
MODES = ("auto", "compile")
PAIRS = 2
N_CTX, NEW_TOKENS, STEER_AT, WARM = 16, 10, 1, 5


def _sides(workflow: str) -> tuple[Any, Any, Any]:
    """``(setup, transformer_lens(s), hookax(s))`` for one workflow."""
    import jax
    import jax.numpy as jnp
    import torch
    from transformer_lens import patching

    import hookax as hx
    from tests.parity import compare
    from tests.parity.nnx_gpt import NAMES

    s = compare.build(n_ctx=N_CTX + NEW_TOKENS, batch=1)
    clean, corrupt = s.clean[:, :N_CTX], s.corrupt[:, :N_CTX]
    s = compare.Setup(s.tl, s.nnx, clean, corrupt)
    jc, jx = s.jclean, s.jcorrupt
    with torch.no_grad():
        s.tl(clean)
    jax.block_until_ready(s.nnx(jc))
    heads = NAMES.axis("z", "head")

    def tl_metric(logits: Any) -> Any:
        return logits[0, -1, compare.ANSWER] - logits[0, -1, compare.WRONG]

    hx_metric = tl_metric
    if workflow == "cache":
        return s, lambda: s.tl.run_with_cache(clean)[1], lambda: NAMES.capture(s.nnx)(jc)[1]
    if workflow == "attribution":
        return s, lambda: compare.tl_attribution(s), lambda: compare.hx_attribution(s)
    if workflow == "steering":
        vector_t = torch.full((64,), 0.5)
        vector_j = jnp.full((64,), 0.5)

        def steer(resid: Any, hook: Any) -> Any:
            return resid + vector_t

        def tl_generate() -> Any:
            tokens = clean
            with torch.no_grad():
                for _ in range(NEW_TOKENS):
                    logits = s.tl.run_with_hooks(
                        tokens, fwd_hooks=[(f"blocks.{STEER_AT}.hook_resid_post", steer)]
                    )
                    tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], 1)
            return tokens

        @jax.jit
        def step(m: Any, buf: Any, pos: Any, vector: Any) -> Any:
            add = lambda nf, a, k, c: nf(*a, **k) + vector  # noqa: E731
            with hx.intercept(add, where=f"blocks/{STEER_AT}"):
                logits = m(buf)
            tok = jnp.argmax(logits[0, pos - 1], -1).astype(buf.dtype)
            return buf.at[0, pos].set(tok)

        def hx_generate() -> Any:
            buf = jnp.zeros((1, N_CTX + NEW_TOKENS), jc.dtype).at[:, :N_CTX].set(jc)
            for pos in range(N_CTX, N_CTX + NEW_TOKENS):
                buf = step(s.nnx, buf, pos, vector_j)
            return buf

        jax.block_until_ready(jnp.zeros((1, N_CTX + NEW_TOKENS), jc.dtype).at[:, :N_CTX].set(jc))
        return s, tl_generate, hx_generate

    def tl_cache() -> Any:
        with torch.no_grad():
            return s.tl.run_with_cache(clean)[1]

    get = {
        "resid grid": patching.get_act_patch_resid_pre,
        "head grid": patching.get_act_patch_attn_head_out_all_pos,
        "head x position": patching.get_act_patch_attn_head_out_by_pos,
    }[workflow]
    target: dict[str, Any] = {"where": NAMES.resid_pre}
    if workflow != "resid grid":
        target = {"where": NAMES.z, "heads": heads}
        if workflow == "head grid":
            target["positions"] = None

    def tl() -> Any:
        with torch.no_grad():
            return get(s.tl, corrupt, tl_cache(), tl_metric)

    return s, tl, lambda: hx.patch_grid(s.nnx, (jc,), (jx,), hx_metric, **target)


FLOORS = {
    "eager forward (warm)": "an eager capture",
    "make_jaxpr(forward)": "any traced question",
    "make_jaxpr(grad)": "attribution (a gradient's trace)",
    "jax.jit(forward) first call": "a jax.jit step (steering)",
}


def floors() -> dict[str, float]:
    """JAX's own costs on the same model, without hookax (seconds): what a JAX first call of
    each kind cannot go under."""
    import jax
    from flax import nnx

    from tests.parity import compare

    s = compare.build(n_ctx=N_CTX + NEW_TOKENS, batch=1)
    jc = s.jclean[:, :N_CTX]
    model = s.nnx
    graphdef, state = nnx.split(model)

    def forward(st: Any, x: Any) -> Any:
        return nnx.merge(graphdef, st)(x)

    def diff(st: Any, x: Any) -> Any:
        logits = forward(st, x)
        return logits[0, -1, compare.ANSWER] - logits[0, -1, compare.WRONG]

    jax.block_until_ready(model(jc))

    def best(fn: Any, n: int = 5) -> float:
        out = float("inf")
        for _ in range(n):
            t = time.perf_counter()
            _ready(fn())
            out = min(out, time.perf_counter() - t)
        return out

    return {
        "eager forward (warm)": best(lambda: model(jc)),
        # a new function each time: a trace, not JAX's trace cache
        "make_jaxpr(forward)": best(
            lambda: jax.make_jaxpr(lambda a, b: forward(a, b))(state, jc).consts
        ),
        "make_jaxpr(grad)": best(
            lambda: jax.make_jaxpr(jax.grad(lambda a, b: diff(a, b)))(state, jc).consts
        ),
        "jax.jit(forward) first call": best(lambda: jax.jit(forward)(state, jc), 1),
    }


def _ready(x: Any) -> Any:
    import jax

    return jax.block_until_ready(x)


def child(workflow: str, mode: str, tl_first: bool) -> dict[str, float]:
    import contextlib
    import io

    import hookax as hx

    _, tl, mine = _sides(workflow)
    order = [("tl", tl), ("hookax", mine)]
    if not tl_first:
        order.reverse()
    out: dict[str, float] = {}
    quiet = io.StringIO()
    with hx.first_call(mode), contextlib.redirect_stderr(quiet):  # TransformerLens' tqdm bars
        for side, fn in order:
            t = time.perf_counter()
            _ready(fn())
            out[f"{side}.first_s"] = time.perf_counter() - t
        compiled_programs()
        for side, fn in order:
            _ready(fn())
            best = float("inf")
            for _ in range(WARM):
                t = time.perf_counter()
                _ready(fn())
                best = min(best, time.perf_counter() - t)
            out[f"{side}.warm_s"] = best
    return out


def _run_child(*args: str) -> dict[str, float]:
    return child_json("bench_firstcall_tl", *args)


def main() -> dict[str, Any] | None:
    if not all(importlib.util.find_spec(m) for m in ("torch", "transformer_lens")):
        print(
            "skipped: needs torch and transformer-lens; run it in the parity venv "
            "(nox -s parity --install-only; .nox/parity/bin/python -m benchmarks firstcall_tl)"
        )
        return None
    import jax

    results: dict[str, Any] = {}
    rows = []
    for workflow in WORKFLOWS:
        best: dict[str, dict[str, float]] = {}
        for mode in MODES:
            runs = [_run_child(workflow, mode, str(f)) for f in (True, False) * PAIRS]
            best[mode] = {k: min(r[k] for r in runs) for k in runs[0]}
        tl_first = min(best[m]["tl.first_s"] for m in MODES)
        tl_warm = min(best[m]["tl.warm_s"] for m in MODES)
        auto, compiled = best["auto"], best["compile"]
        fig = {
            "tl_first_ms": tl_first * 1e3,
            "first_ms": auto["hookax.first_s"] * 1e3,
            "compiled_first_ms": compiled["hookax.first_s"] * 1e3,
            "tl_warm_ms": tl_warm * 1e3,
            "warm_ms": min(auto["hookax.warm_s"], compiled["hookax.warm_s"]) * 1e3,
        }
        results[workflow] = fig
        rows.append(
            (
                workflow,
                f"{fig['tl_first_ms']:.0f}",
                f"{fig['first_ms']:.0f}",
                f"{fig['first_ms'] / fig['tl_first_ms']:.1f}",
                f"{fig['compiled_first_ms']:.0f}",
                f"{fig['tl_warm_ms']:.1f}",
                f"{fig['warm_ms']:.1f}",
            )
        )
    print(
        f"CPU ({os.cpu_count()} cores), JAX {jax.__version__}, torch "
        f"{importlib.metadata.version('torch')} (1 thread), TransformerLens "
        f"{importlib.metadata.version('transformer-lens')}; milliseconds, min of {2 * PAIRS} "
        "fresh processes\n"
    )
    head = ("workflow", "TL first", "hookax first", "ratio", "compiled", "TL warm", "warm")
    print(table(rows, head))
    runs = [_run_child("floors", "-", "-") for _ in range(2 * PAIRS)]
    floor = {k: min(r[k] for r in runs) * 1e3 for k in FLOORS}
    results["jax floors"] = floor
    print(f"\nJAX alone on the same model (no hookax), ms, min of {2 * PAIRS} processes:\n")
    print(table([(k, f"{v:.1f}", FLOORS[k]) for k, v in floor.items()], ("", "ms", "a floor for")))
    return results


if __name__ == "__main__":
    if sys.argv[1] == "floors":
        print(json.dumps(floors()))
    else:
        print(json.dumps(child(sys.argv[1], sys.argv[2], sys.argv[3] == "True")))
