"""Eager code under hookax: the first calls of workflows that run the user's model outside
``jax.jit``.

An eager ``hx.value_and_grad`` (or ``hx.value_grad_and_stats``, or a capture at a length the
model has not run) runs its operations one by one, each a program JAX compiles the first time
it meets it (with these shapes) in a process: about 140 compiles for the 3-layer GPT's
gradient. Under ``hx.first_call("auto")`` each such program's first call runs with NumPy while
one background thread compiles them; ``"compile"`` waits for each compile, as JAX does.

Model: the parity tests' random GPT (3 layers, d_model 64, 4 heads, MLP 256, vocabulary 50),
16 tokens, batch 1, after one plain eager forward. Rows: ``hx.value_and_grad`` of a
log-softmax loss; ``hx.value_grad_and_stats`` of it; ``hx.capture`` of every TransformerLens
name on 20 tokens (a length the model has not run); and, for scale, ``nnx.value_and_grad``
without hookax (JAX's own eager gradient, which hookax leaves as it is). Each in fresh
processes (min of ``RUNS``), both modes: the first call, the second (made at once: in "auto"
the compiles are still under way and it runs with NumPy again), and the call after the
background compiles ended (JAX's own dispatch; "compile": the third call). Seconds.
``python -m benchmarks eager_first``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from benchmarks._timing import child_json, table

WORKFLOWS = ("value_and_grad", "value_grad_and_stats", "capture, new length", "nnx (no hookax)")
MODES = ("auto", "compile")
RUNS = 2


def child(workflow: str, mode: str) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import hookax as hx
    from hookax._engine import firstcall
    from tests.parity.nnx_gpt import GPT, NAMES

    model = GPT(vocab=50, n_ctx=32, d=64, heads=4, d_head=16, d_mlp=256, depth=3, rngs=nnx.Rngs(0))
    tokens = jnp.arange(16)[None] % 50
    longer = jnp.arange(20)[None] % 50
    jax.block_until_ready(model(tokens))

    def loss(m: Any, x: Any) -> Any:
        return jnp.mean(jax.nn.log_softmax(m(x))[..., 0])

    fn = {
        "value_and_grad": lambda: hx.value_and_grad(loss)(model, tokens),
        "value_grad_and_stats": lambda: hx.value_grad_and_stats(loss)(model, tokens),
        "capture, new length": lambda: NAMES.capture(model)(longer),
        "nnx (no hookax)": lambda: nnx.value_and_grad(loss)(model, tokens),
    }[workflow]

    def timed() -> float:
        t = time.perf_counter()
        jax.block_until_ready(jax.tree.leaves(fn()))
        return time.perf_counter() - t

    with hx.first_call(mode):
        first, second = timed(), timed()
        firstcall.OPS.join()
        timed()  # fills JAX's C++ dispatch cache with the compiled programs
        warm = min(timed() for _ in range(3))
    return {"first_s": first, "second_s": second, "warm_s": warm}


def _run_child(*args: str) -> dict[str, float]:
    return child_json("bench_eager_first", *args)


def main() -> dict[str, Any]:
    import jax

    results: dict[str, Any] = {}
    rows = []
    for workflow in WORKFLOWS:
        fig: dict[str, float] = {}
        for mode in MODES:
            runs = [_run_child(workflow, mode) for _ in range(RUNS)]
            for k in runs[0]:
                fig[f"{mode}.{k}"] = min(r[k] for r in runs)
        results[workflow] = fig
        rows.append(
            (
                workflow,
                f"{fig['auto.first_s']:.2f}",
                f"{fig['compile.first_s']:.2f}",
                f"{fig['compile.first_s'] / fig['auto.first_s']:.1f}x",
                f"{fig['auto.second_s']:.2f}",
                f"{fig['compile.second_s']:.2f}",
                f"{fig['auto.warm_s']:.3f}",
                f"{fig['compile.warm_s']:.3f}",
            )
        )
    print(
        f"CPU ({os.cpu_count()} cores), JAX {jax.__version__}; seconds, min of {RUNS} fresh "
        "processes per mode\n"
    )
    head = (
        "workflow",
        "1st auto",
        "1st comp",
        "gain",
        "2nd auto",
        "2nd comp",
        "warm auto",
        "warm comp",
    )
    print(table(rows, head))
    return results


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
