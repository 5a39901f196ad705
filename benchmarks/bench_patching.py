"""A residual-stream patching grid, 12 layers x 64 positions, five ways side by side in one run.

The decoder of ``hookax.examples.transformer`` with 12 blocks, d_model 64, 4 heads, one sequence
of 64 tokens (the corrupted run changes token 20). The metric is the logit difference at the last
position between the clean run's top token and the corrupted run's. Every way computes all 768
cells; the hand-written ones use no hookax:

* ``loop_jit``: what a user writes today, a Python loop over (layer, position) of one
  ``jax.jit`` function (over ``nnx.split`` state) with the layer and position traced;
* ``grid``: ``hx.patch_grid(model, (clean,), (corrupt,), metric, where="layers/*")``;
* ``hand_grid``: the fastest hand-written grid: one jitted program, per layer ``vmap`` over
  positions of the forward from the patched block on (everything before it computed once);
* ``recipe``: the old ``docs/patching.md`` recipe (``nnx.jit`` with a forward hook per patch),
  a few patches timed and extrapolated to the grid;
* ``attribution``: ``hx.attribution_patch``, the grid to first order from one backward pass.

Median wall times over interleaved rounds (the first call, which compiles, left out), the ratios
of the targets (grid >= 3x the loop, <= 1.2x the hand grid, >= 10x the recipe), the largest
difference of any cell from the loop's, and the compiled memory of the grid's program per chunk
size (``memory_analysis``: temporaries + arguments + outputs).

    python -m benchmarks patching --json out.json
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks._timing import interleaved, table

LAYERS, SEQ, D, CORRUPT_AT, ROUNDS, RECIPE_PATCHES = 12, 64, 64, 20, 5, 12


def _setup() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hookax.examples import transformer

    cfg = transformer.Config(n_layers=LAYERS, d_model=D, seq_len=SEQ)
    model = transformer.make_model(nnx.Rngs(0), cfg)
    clean = jax.random.randint(jax.random.key(1), (1, SEQ), 0, cfg.vocab)
    corrupt = clean.at[0, CORRUPT_AT].set((clean[0, CORRUPT_AT] + 1) % cfg.vocab)
    a = int(model(clean)[0, -1].argmax())
    b = int(model(corrupt)[0, -1].argmax())
    b = b if b != a else (a + 1) % cfg.vocab

    def metric(logits: jax.Array) -> jax.Array:
        return logits[0, -1, a] - logits[0, -1, b]

    return {"model": model, "clean": clean, "corrupt": corrupt, "metric": metric, "jnp": jnp}


def _hand(model: Any, metric: Any) -> tuple[Any, Any, Any]:
    """The hand-written programs (no hookax): clean stack, one patched forward, the grid."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)

    def blocks(m: Any, x: jax.Array, start: int = 0) -> list[jax.Array]:
        out = []
        for layer in m.layers[start:]:
            x = layer(x)
            out.append(x)
        return out

    def readout(m: Any, x: jax.Array) -> jax.Array:
        return metric(m.lm_head(m.norm(x)))

    @jax.jit
    def clean_stack(state: Any, tokens: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, state)
        return jnp.stack(blocks(m, m.embed(tokens)))

    @jax.jit
    def one(state: Any, tokens: jax.Array, stack: jax.Array, layer: Any, pos: Any) -> Any:
        m = nnx.merge(graphdef, state)
        x = m.embed(tokens)
        mask = (jnp.arange(SEQ) == pos)[None, :, None]
        for i, block in enumerate(m.layers):
            x = jnp.where((layer == i) & mask, stack[i], block(x))
        return readout(m, x)

    @jax.jit
    def grid(state: Any, clean: jax.Array, corrupt: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, state)
        stack = blocks(m, m.embed(clean))
        hs = blocks(m, m.embed(corrupt))
        rows = []
        for layer in range(LAYERS):

            def cell(pos: jax.Array, layer: int = layer) -> jax.Array:
                x = jnp.where((jnp.arange(SEQ) == pos)[None, :, None], stack[layer], hs[layer])
                for block in m.layers[layer + 1 :]:
                    x = block(x)
                return readout(m, x)

            rows.append(jax.vmap(cell)(jnp.arange(SEQ)))
        return jnp.stack(rows)

    return (
        (lambda t: clean_stack(state, t)),
        (lambda *a: one(state, *a)),
        (lambda c, x: grid(state, c, x)),
    )


def _recipe(model: Any, clean: Any, corrupt: Any, metric: Any) -> float:
    """Seconds per patch of docs/patching.md's old recipe (nnx.jit + a forward hook per patch)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import hookax as hx

    @nnx.jit(static_argnames="site")
    def patched(model: Any, tokens: jax.Array, site: str, value: jax.Array, mask: jax.Array) -> Any:
        def hook(module: Any, args: tuple, output: jax.Array) -> jax.Array:
            return jnp.where(mask[None, :, None], value, output)

        with hx.hooks(forward=hook, where=site):
            return metric(model(tokens))

    run = nnx.jit(lambda m, t: hx.capture(m, where="layers/*")(t))
    _, acts = run(model, clean)
    cells = [(f"layers/{i % LAYERS}", i % SEQ) for i in range(RECIPE_PATCHES)]
    for site, _ in cells[:LAYERS]:  # compile each site's program first
        patched(model, corrupt, site, acts[site][0], jnp.arange(SEQ) == 0).block_until_ready()
    t0 = time.perf_counter()
    for site, pos in cells:
        patched(model, corrupt, site, acts[site][0], jnp.arange(SEQ) == pos).block_until_ready()
    return (time.perf_counter() - t0) / len(cells)


def _bytes(compiled: Any) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def main() -> dict[str, Any]:
    import jax
    import numpy as np

    import hookax as hx
    from hookax._patching.grid import Plan

    s = _setup()
    model, clean, corrupt, metric, jnp = s["model"], s["clean"], s["corrupt"], s["metric"], s["jnp"]
    clean_stack, one, hand_grid = _hand(model, metric)
    cells = [(layer, pos) for layer in range(LAYERS) for pos in range(SEQ)]
    args = (model, (clean,), (corrupt,), metric)

    def loop() -> Any:
        stack = clean_stack(clean)
        out = [one(corrupt, stack, jnp.int32(layer), jnp.int32(pos)) for layer, pos in cells]
        return jax.block_until_ready(jnp.stack(out).reshape(LAYERS, SEQ))

    fns = {
        "loop_jit": loop,
        "grid": lambda: jax.block_until_ready(hx.patch_grid(*args, where="layers/*")),
        "hand_grid": lambda: jax.block_until_ready(hand_grid(clean, corrupt)),
        "attribution": lambda: jax.block_until_ready(hx.attribution_patch(*args, where="layers/*")),
    }
    first = {}
    for name, fn in fns.items():  # the first call traces and compiles
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    inner = {"loop_jit": 1, "grid": 2, "hand_grid": 2, "attribution": 10}
    times = interleaved(fns, rounds=ROUNDS, inner=inner)
    recipe = _recipe(model, clean, corrupt, metric) * len(cells)

    results = {name: np.asarray(fn()) for name, fn in fns.items()}
    diff = float(np.abs(results["grid"] - results["loop_jit"]).max())
    hand_diff = float(np.abs(results["hand_grid"] - results["loop_jit"]).max())
    m_corrupt = float(metric(model(corrupt)))
    corr = float(
        np.corrcoef(results["attribution"].ravel(), (results["grid"] - m_corrupt).ravel())[0, 1]
    )

    plan = Plan("bench", model, (clean,), (corrupt,), metric, "layers/*", "each", 1)
    by_chunk = {c: _bytes(plan.compiled(c)) for c in (8, 16, 32, 64)}

    print(
        f"{LAYERS} layers x {SEQ} positions = {len(cells)} patches, d_model {D}, on "
        f"{jax.devices()[0].device_kind} ({ROUNDS} interleaved rounds, medians)"
    )
    rows = [
        (
            name,
            f"{times[name] * 1e3:.1f}",
            f"{times['loop_jit'] / times[name]:.2f}",
            f"{first[name]:.2f}",
        )
        for name in fns
    ]
    rows.append(
        ("recipe (extrapolated)", f"{recipe * 1e3:.1f}", f"{times['loop_jit'] / recipe:.2f}", "")
    )
    print(table(rows, ("", "ms per grid", "speed-up vs loop", "first call s")))
    ratios = {
        "grid_vs_loop": times["loop_jit"] / times["grid"],
        "grid_over_hand_grid": times["grid"] / times["hand_grid"],
        "grid_vs_recipe": recipe / times["grid"],
    }
    print(
        f"targets: grid {ratios['grid_vs_loop']:.2f}x faster than the loop (>= 3), "
        f"{ratios['grid_over_hand_grid']:.2f}x the hand grid's time (<= 1.2), "
        f"{ratios['grid_vs_recipe']:.1f}x faster than the recipe (>= 10)"
    )
    print(
        f"largest |grid - loop| {diff:.2e} (hand grid {hand_diff:.2e}); attribution vs "
        f"grid - metric(corrupt): correlation {corr:.3f}"
    )
    print(
        "the grid's program, memory by chunk size (patches per target per call): "
        + ", ".join(f"{c}: {b / 2**20:.1f} MiB" for c, b in by_chunk.items())
    )
    return {
        "loop_jit_ms": times["loop_jit"] * 1e3,
        "grid_ms": times["grid"] * 1e3,
        "hand_grid_ms": times["hand_grid"] * 1e3,
        "recipe_ms": recipe * 1e3,
        "attribution_ms": times["attribution"] * 1e3,
        "max_abs_diff": diff,
        "peak_bytes": by_chunk[64],
        "peak_bytes_by_chunk": by_chunk,
        "first_call_s": first,
        "attribution_correlation": corr,
        **ratios,
    }


if __name__ == "__main__":
    main()
