"""``hx.summary`` next to ``nnx.tabulate``, and a Llama-7B-shaped decoder summarised abstractly.

1. The example transformer and ResNet, in one run: ``hx.summary`` (forward and backward FLOPs,
   memory estimate, every collection) vs ``nnx.tabulate(compute_flops=True)`` and
   ``nnx.tabulate(compute_flops=True, compute_vjp_flops=True)``, wall time of each (best of 3;
   the first call of each, which compiles JAX's own helpers, is left out).
2. Llama-7B: 32 layers, d_model 4096, 32 heads, MLP 11008, vocab 32000 (untied), bfloat16
   parameters, made with ``nnx.eval_shape`` and summarised on a ``(1, 2048)`` int32 input:
   wall time and peak RSS.

    PYTHONPATH=. python -m benchmarks summary
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks._timing import best_of


def _peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB else


def versus_tabulate() -> dict[str, float]:
    import jax.numpy as jnp
    from flax import nnx

    import hookax as hx
    from hookax.examples import load

    result = {"hx.summary": 0.0, "tabulate flops": 0.0, "tabulate flops+vjp": 0.0}
    for name in ("transformer", "resnet"):
        ex = load(name)
        abstract = nnx.eval_shape(lambda ex=ex: ex.make_model(nnx.Rngs(0)))
        model = ex.make_model(nnx.Rngs(0))
        specs = ex.example_inputs()
        arrays = [jnp.zeros(s.shape, s.dtype) for s in specs]
        runs: dict[str, Callable[[], Any]] = {
            "hx.summary": lambda a=abstract, s=specs: hx.summary(a, *s),
            "tabulate flops": lambda m=model, x=arrays: nnx.tabulate(m, *x, compute_flops=True),
            "tabulate flops+vjp": lambda m=model, x=arrays: nnx.tabulate(
                m, *x, compute_flops=True, compute_vjp_flops=True
            ),
        }
        for key, run in runs.items():
            result[key] += best_of(run, 3)
    print("transformer + resnet examples, seconds (best of 3):")
    for key, value in result.items():
        print(f"{key:>22}: {value:.2f} s")
    ratio = result["hx.summary"] / result["tabulate flops+vjp"]
    print(f"{'ratio':>22}: {ratio:.2f} of nnx.tabulate with both FLOP options")
    return result


def llama_7b() -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import hookax as hx
    from hookax.examples import transformer

    cfg = transformer.LLAMA_7B
    rss_before = _peak_rss_mib()
    t0 = time.perf_counter()
    model = nnx.eval_shape(lambda: transformer.Decoder(cfg, rngs=nnx.Rngs(0)))
    t1 = time.perf_counter()
    s = hx.summary(model, jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32))
    t2 = time.perf_counter()
    text = str(s)
    t3 = time.perf_counter()
    assert s.totals.params == cfg.params() == 6_738_415_616, s.totals.params
    result = {
        "params": s.totals.params,
        "flops": s.totals.flops or 0,
        "vjp_flops": s.totals.vjp_flops or 0,
        "rows": len(s.rows),
        "build_s": t1 - t0,
        "summary_s": t2 - t1,
        "render_s": t3 - t2,
        "peak_rss_mib_before": rss_before,
        "peak_rss_mib": _peak_rss_mib(),
    }
    print("\nLlama-7B-shaped decoder, abstract:")
    print(f"{'params':>22}: {result['params']:,}")
    print(f"{'FLOPs':>22}: {result['flops']:,}")
    print(f"{'FLOPs fwd+bwd':>22}: {result['vjp_flops']:,}")
    print(f"{'rows':>22}: {result['rows']}")
    print(f"{'nnx.eval_shape build':>22}: {result['build_s']:.2f} s")
    print(f"{'hx.summary':>22}: {result['summary_s']:.2f} s")
    print(f"{'render table':>22}: {result['render_s']:.2f} s")
    print(f"{'peak RSS before':>22}: {result['peak_rss_mib_before']:.0f} MiB (after imports)")
    print(f"{'peak RSS':>22}: {result['peak_rss_mib']:.0f} MiB")
    print(text.splitlines()[-1])
    return result


def main() -> dict[str, float]:
    return {**versus_tabulate(), **llama_7b()}


if __name__ == "__main__":
    main()
