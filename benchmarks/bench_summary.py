"""Summarise a Llama-7B-shaped decoder, abstractly: wall time and peak RSS.

32 layers, d_model 4096, 32 heads, MLP 11008, vocab 32000 (untied), bfloat16 parameters, made
with ``nnx.eval_shape`` and summarised on a ``(1, 2048)`` int32 input.

    PYTHONPATH=. python -m benchmarks.bench_summary
"""

from __future__ import annotations

import resource
import sys
import time


def _peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB else


def main() -> dict[str, float]:
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
        "rows": len(s.rows),
        "build_s": t1 - t0,
        "summary_s": t2 - t1,
        "render_s": t3 - t2,
        "peak_rss_mib_before": rss_before,
        "peak_rss_mib": _peak_rss_mib(),
    }
    print(text.splitlines()[-3])
    print(f"{'params':>22}: {result['params']:,}")
    print(f"{'FLOPs':>22}: {result['flops']:,}")
    print(f"{'rows':>22}: {result['rows']}")
    print(f"{'nnx.eval_shape build':>22}: {result['build_s']:.2f} s")
    print(f"{'hx.summary':>22}: {result['summary_s']:.2f} s")
    print(f"{'render table':>22}: {result['render_s']:.2f} s")
    print(f"{'peak RSS before':>22}: {result['peak_rss_mib_before']:.0f} MiB (after imports)")
    print(f"{'peak RSS':>22}: {result['peak_rss_mib']:.0f} MiB")
    return result


if __name__ == "__main__":
    main()
