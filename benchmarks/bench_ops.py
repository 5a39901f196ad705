"""Operations inside call sites: what ``hx.ops``, ``ops=`` capture and op edits cost.

On the example transformer (``hookax.examples.transformer``: 2 blocks, d_model 64, 4 heads,
input i32[2,32]), in one run:

1. listing: ``hx.ops(model, x)`` (every operation of every call site, abstractly) next to
   ``jax.make_jaxpr`` of the same forward and ``hx.summary`` (best of 5 each);
2. ``hx.ops`` of a Llama-7B-shaped decoder (``transformer.LLAMA_7B``, made with
   ``nnx.eval_shape``, input i32[1,2048]), abstractly: operations, wall time, peak RSS;
3. under ``nnx.jit``: the forward alone, with a no-op ``hx.intercept_op`` on every softmax and
   matmul (optimized HLO compared without debug metadata), and ``hx.capture`` of both layers'
   attention probabilities; run time (interleaved medians) and trace + compile time.

    python -m benchmarks ops
"""

from __future__ import annotations

import re
import time
from typing import Any

from benchmarks._timing import best_of, interleaved, table


def _hlo(compiled: Any) -> str:
    text = compiled.as_text().split("\nFileNames")[0]
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("HloModule"))


def main() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import hookax as hx
    from hookax.examples import transformer

    model = transformer.make_model(nnx.Rngs(0))
    (spec,) = transformer.example_inputs()
    x = jnp.zeros(spec.shape, spec.dtype)
    n_ops = len(hx.ops(model, x))
    listing = {
        "jax.make_jaxpr (forward)": best_of(lambda: jax.make_jaxpr(lambda x: model(x))(x), 5),
        "hx.summary": best_of(lambda: hx.summary(model, x), 5),
        "hx.ops (every call site)": best_of(lambda: hx.ops(model, x), 5),
        "hx.ops (where=layers/0/attn)": best_of(lambda: hx.ops(model, x, where="layers/0/attn"), 5),
    }
    base = listing["jax.make_jaxpr (forward)"]
    print(f"listing the {n_ops} operations of the example transformer (best of 5):")
    print(
        table(
            [(k, f"{v * 1e3:.1f}", f"{v / base:.2f}") for k, v in listing.items()],
            ("", "ms", "vs make_jaxpr"),
        )
    )

    llama_7b()

    noop_ops = ["**:softmax", "**:dot_general#*"]
    capture_ops = "layers/*/attn:softmax"

    def plain(m: Any, x: jax.Array) -> Any:
        return m(x)

    def noop(m: Any, x: jax.Array) -> Any:
        with hx.intercept_op(lambda v, op: None, ops=noop_ops):
            return m(x)

    def captured(m: Any, x: jax.Array) -> Any:
        return hx.capture(m, ops=capture_ops)(x)

    fns = {"forward": plain, "no-op intercept_op": noop, "capture(ops=softmax)": captured}
    compile_s, jitted = {}, {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        compiled = nnx.jit(f).lower(model, x).compile()
        compile_s[name] = time.perf_counter() - t0
        jitted[name] = (nnx.jit(f), compiled)
    same = _hlo(jitted["forward"][1]) == _hlo(jitted["no-op intercept_op"][1])
    times = interleaved(
        {name: (lambda j=j: jax.block_until_ready(j(model, x))) for name, (j, _) in jitted.items()},
        rounds=15,
        inner=20,
    )
    print(f"\nunder nnx.jit (no-op edit compiles to the same optimized HLO: {same}):")
    rows = [
        (
            name,
            f"{times[name] * 1e3:.3f}",
            f"{times[name] / times['forward']:.2f}",
            f"{compile_s[name]:.2f}",
        )
        for name in fns
    ]
    print(table(rows, ("", "ms/forward", "ratio", "trace+compile s")))


def llama_7b() -> None:
    import resource
    import sys

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import hookax as hx
    from hookax._cli.ops import _abstract_call
    from hookax.examples import transformer

    model = nnx.eval_shape(lambda: transformer.Decoder(transformer.LLAMA_7B, rngs=nnx.Rngs(0)))
    fn, args = _abstract_call(model, (jax.ShapeDtypeStruct((1, 2048), jnp.int32),), {}, False)
    t0 = time.perf_counter()
    table = hx.ops(fn, *args)
    listed = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.make_jaxpr(fn)(*args)
    traced = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mib = peak / 2**20 if sys.platform == "darwin" else peak / 2**10
    print(
        f"\nLlama-7B-shaped decoder, abstract: {len(table)} operations in "
        f"{len({r.key for r in table.rows})} call sites listed in {listed:.2f} s "
        f"(jax.make_jaxpr: {traced:.2f} s); peak RSS of the process {peak_mib:.0f} MiB"
    )
