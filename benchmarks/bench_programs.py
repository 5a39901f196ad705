"""Programs without modules and Haiku: what hookax costs a program it did not write.

Models: the plain-function Llama of ``tests/models/jaxllm_like.py`` (functions over a weight
pytree, ``jax.named_scope`` blocks, a Python loop over layers; its ``lax.scan`` twin over stacked
layers for the HLO check): 4 layers, d_model 128, 4 query heads / 2 key-value heads of 32, MLP
256, vocabulary 256; and, where this hookax has its Haiku adapter, a Haiku decoder written with
``hk.transform`` (4 pre-norm blocks of ``hk.MultiHeadAttention`` and a GELU MLP, d_model 128, 4
heads, learned positions), its blocks a Python list (``block_0`` ... ``block_3``) or one
``hk.layer_stack`` (``layers/block[i]``). One prompt of 32 tokens, float32. Each measurement is
against the same program without hookax, side by side in one run:

1. ``hlo``: the program under ``jax.jit`` with a no-op ``hx.intercept`` (and with ``hx.hooks``
   holding a forward hook that returns None) active (the Llama through ``hx.program(forward)``)
   lowers to the same StableHLO and compiles to the same optimized HLO as ``jax.jit`` of the
   program alone (texts without debug information; with it, the differing lines are counted:
   source locations, whose call stacks name hookax's frames where hookax ran the code).
2. ``grid``: ``hx.patch_grid`` over each layer's residual output by position (the Llama's
   ``forward_layer/*.0``, Haiku's ``block_*`` and ``layers/block[0:4]``) against the same grid
   written by hand: one ``jax.jit`` program, per layer the corrupted forward with that layer's
   output at position p replaced by the clean run's, ``jax.vmap`` over p; warm calls,
   round-robin, the fastest of 14 rounds, wall-clock and CPU time (goal: <= 1.2x).
3. ``first``: the first call (trace + compile + run) of ``jax.jit`` over
   ``hx.capture(forward, where=...)`` (every layer's output) against a hand-written ``jax.jit``
   forward returning the same values, each in fresh processes, hand first then hookax first,
   twice; min of the four (goal: <= 1.3x).
4. ``idle``: the eager Llama forward (no jit) in processes that never import hookax against
   processes that import it and enter and leave a no-op ``hx.intercept`` first (alternated,
   3 of each; the median of each process's fastest call), with a scalar addition's eager
   dispatch as a finer probe; and ``hx.program(forward)`` called outside any hookax block
   against ``forward``, in one process, round-robin, the fastest of 14 rounds (goal: <= 1.03x).

Run: ``python -m benchmarks programs --json out.json``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._timing import table

ROOT = Path(__file__).resolve().parent.parent
SEQ = 32
PAIRS = 2  # fresh processes per first-call figure: hand first, hookax first, PAIRS times
IDLE_PROCS = 3  # fresh processes per side of the import cost
IDLE_SAMPLES = 40  # eager forwards timed per process (and as many runs of OPS scalar additions)
OPS = 200


def _jl() -> Any:
    """``tests/models/jaxllm_like.py`` (a test model, not a package of its own)."""
    models = str(ROOT / "tests" / "models")
    if models not in sys.path:
        sys.path.insert(0, models)
    import jaxllm_like

    return jaxllm_like


def _llama() -> dict[str, Any]:
    import jax

    jl = _jl()
    cfg = jl.Config(
        embed=128,
        ffw_size=256,
        q_heads=4,
        kv_heads=2,
        num_layers=4,
        head_dim=32,
        vocab_size=256,
        max_seq_len=SEQ,
    )
    weights = jl.init_weights(jax.random.key(0), cfg)
    clean = jax.random.randint(jax.random.key(1), (1, SEQ), 0, cfg.vocab_size)
    corrupt = clean.at[:, SEQ // 3].set((clean[:, SEQ // 3] + 1) % cfg.vocab_size)
    seg = jl.segments(clean)
    jax.block_until_ready((weights, clean, corrupt, seg))
    return {
        "jl": jl,
        "cfg": cfg,
        "weights": weights,
        "clean": clean,
        "corrupt": corrupt,
        "seg": seg,
    }


def timed(configs: dict[str, Any], rounds: int, inner: int) -> dict[str, dict[str, float]]:
    """Per config the fastest round's seconds per call, wall-clock (``wall``) and this
    process's CPU time (``cpu``: every thread's, so XLA's own threads count; on a machine shared
    with other work it is the steadier of the two, since waiting for a core costs no CPU time).
    Round-robin over ``rounds`` rounds of ``inner`` calls, after one call of each."""
    for fn in configs.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in configs}
    cpu: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(rounds):
        for name, fn in configs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                fn()
            wall[name].append((time.perf_counter() - t0) / inner)
            cpu[name].append((time.process_time() - c0) / inner)
    return {k: {"wall": min(wall[k]), "cpu": min(cpu[k])} for k in configs}


def noop_interceptor(next_fun: Any, args: tuple, kwargs: dict, context: Any) -> Any:
    return next_fun(*args, **kwargs)


def noop_forward(module: Any, args: tuple, out: Any) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# 1. No-op hooks under jax.jit: the same program


def _strip_hlo(hlo: str) -> str:
    """Optimized HLO text without debug information: op metadata, source-location tables,
    module name."""
    hlo = hlo.split("\nFileNames", 1)[0]
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    return re.sub(r"^HloModule \S+", "HloModule m", hlo, flags=re.M)


def _diff(a: str, b: str) -> int:
    """Lines added or removed between two texts."""
    return sum(
        1
        for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    )


def compare_programs(plain: Any, hooked: Any) -> dict[str, Any]:
    """``jax.stages.Lowered`` of the program without and with hookax: whether the StableHLO
    and the optimized HLO are the same (without debug information), and how many lines differ
    with it."""
    a, b = plain.as_text(), hooked.as_text()
    da, db = plain.as_text(debug_info=True), hooked.as_text(debug_info=True)
    ca, cb = plain.compile().as_text(), hooked.compile().as_text()
    return {
        "stablehlo_same": a == b,
        "stablehlo_diff_lines": _diff(a, b),
        "hlo_same": _strip_hlo(ca) == _strip_hlo(cb),
        "hlo_diff_lines": _diff(_strip_hlo(ca), _strip_hlo(cb)),
        "debug_info_diff_lines": _diff(da, db) + _diff(ca, cb),
    }


def llama_hlo(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import jax

    import hookax as hx

    jl, cfg, w = s["jl"], s["cfg"], s["weights"]
    args = (s["clean"], s["seg"])
    out: dict[str, dict[str, Any]] = {}
    for name, fn, weights in (
        ("llama loop", jl.forward, w),
        ("llama scan", jl.forward_scan, jl.stack_layers(w)),
    ):
        prog = hx.program(fn)
        plain = jax.jit(lambda t, g, w, fn=fn: fn(t, g, w, cfg)).lower(*args, weights)
        for scope, block in (
            ("intercept", lambda: hx.intercept(noop_interceptor)),
            ("hooks", lambda: hx.hooks(forward=noop_forward)),
        ):
            with block():
                hooked = jax.jit(lambda t, g, w, p=prog: p(t, g, w, cfg)).lower(*args, weights)
            out[f"{name}, {scope}"] = compare_programs(plain, hooked)
    return out


# ---------------------------------------------------------------------------------------------
# 2. A patch grid against the same grid written by hand


def _hand_layers(jl: Any, cfg: Any, tokens: Any, seg: Any, weights: Any, edit: Any = None) -> Any:
    """``forward`` written out with ``forward_layer`` called by hand: ``(logits, keys/values)``
    and every layer's ``(residual, (keys, values))``; ``edit(i, x)`` replaces layer ``i``'s
    residual where the next layer reads it."""
    x, sin, cos = jl.ref_embed_and_positions(tokens, seg, weights, cfg, None)
    outs = []
    for idx, layer in enumerate(weights.layers):
        x, kv = jl.forward_layer(x, layer, seg, sin, cos, idx, cfg)
        if edit is not None:
            x = edit(idx, x)
        outs.append((x, kv))
    logits = jl.einsum("btd,dv->btv", jl.rms_norm(x, weights.gamma_final, cfg.norm_eps),
                       weights.lm_head)  # fmt: skip
    return (logits, [kv for _, kv in outs]), outs


def hand_grid(jl: Any, cfg: Any) -> Any:
    """``(weights, clean, corrupt) -> [layer, position]``: one jitted program, per layer a
    ``vmap`` over positions of the corrupted forward with that layer's residual at the
    position replaced by the clean run's."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def grid(weights: Any, clean: Any, corrupt: Any) -> Any:
        seg = jl.segments(clean)
        _, clean_outs = _hand_layers(jl, cfg, clean, seg, weights)
        pos = jnp.arange(clean.shape[1])
        rows = []
        for layer in range(cfg.num_layers):

            def cell(p: Any, layer: int = layer) -> Any:
                def edit(i: int, x: Any) -> Any:
                    if i != layer:
                        return x
                    return jnp.where((pos == p)[None, :, None], clean_outs[i][0], x)

                return jl.metric(_hand_layers(jl, cfg, corrupt, seg, weights, edit)[0])

            rows.append(jax.vmap(cell)(pos))
        return jnp.stack(rows)

    return grid


def llama_grid(s: dict[str, Any], rounds: int) -> dict[str, float]:
    import jax
    import numpy as np

    import hookax as hx

    jl, cfg, w = s["jl"], s["cfg"], s["weights"]
    clean_args = (s["clean"], s["seg"], w, cfg)
    corrupt_args = (s["corrupt"], s["seg"], w, cfg)
    hand = hand_grid(jl, cfg)

    def hookax_grid() -> Any:
        return jax.block_until_ready(
            hx.patch_grid(
                jl.forward, clean_args, corrupt_args, jl.metric, where="forward_layer/*.0"
            )
        )

    def hand_run() -> Any:
        return jax.block_until_ready(hand(w, s["clean"], s["corrupt"]))

    got, want = np.asarray(hookax_grid()), np.asarray(hand_run())
    assert got.shape == want.shape == (cfg.num_layers, SEQ), (got.shape, want.shape)
    t = timed({"hookax": hookax_grid, "hand": hand_run}, rounds=2 * rounds, inner=2)
    return {
        "grid_s": t["hookax"]["wall"],
        "hand_grid_s": t["hand"]["wall"],
        "ratio": t["hookax"]["wall"] / t["hand"]["wall"],
        "cpu_ratio": t["hookax"]["cpu"] / t["hand"]["cpu"],
        "max_abs_diff": float(np.max(np.abs(got - want))),
    }


# ---------------------------------------------------------------------------------------------
# 3. First calls, each in fresh processes


def _seconds(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def first_child(model: str, hand_first: bool) -> dict[str, float]:
    """In this fresh process: the first call of the hand-written jitted forward and of
    ``jax.jit`` over ``hx.capture``, in the order asked."""
    import jax
    import jax.numpy as jnp

    import hookax as hx

    if model != "llama":
        return _haiku_first(model, hand_first)
    s = _llama()
    jl, cfg = s["jl"], s["cfg"]
    args = (s["clean"], s["seg"], s["weights"])
    jax.block_until_ready(jnp.ones(3) + 1)  # the backend is up for both sides
    sides = {
        "hand": jax.jit(lambda t, g, w: _hand_layers(jl, cfg, t, g, w)),
        "hookax": jax.jit(
            lambda t, g, w: hx.capture(jl.forward, where="forward_layer/*")(t, g, w, cfg)
        ),
    }
    out: dict[str, float] = {}
    for side in ("hand", "hookax") if hand_first else ("hookax", "hand"):
        out[f"{side}.first_s"] = _seconds(
            lambda side=side: jax.block_until_ready(sides[side](*args))
        )
    for side in sides:
        out[f"{side}.warm_s"] = min(
            _seconds(lambda side=side: jax.block_until_ready(sides[side](*args))) for _ in range(5)
        )
    return out


def _run_child(*args: str) -> Any:
    cmd = [sys.executable, "-m", "benchmarks.bench_programs", *args]
    # This process's hookax and benchmarks first (its PYTHONPATH, its working directory).
    paths = [os.environ.get("PYTHONPATH", ""), os.getcwd(), str(ROOT)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_calls(model: str) -> dict[str, float]:
    runs = [_run_child("first", model, str(h)) for h in (True, False) * PAIRS]
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    return {
        "first_s": best["hookax.first_s"],
        "hand_first_s": best["hand.first_s"],
        "ratio": best["hookax.first_s"] / best["hand.first_s"],
        "warm_s": best["hookax.warm_s"],
        "hand_warm_s": best["hand.warm_s"],
    }


# ---------------------------------------------------------------------------------------------
# 4. The eager program while hookax is idle


def idle_child(mode: str) -> dict[str, float]:
    """The fastest eager forward in this process: ``plain`` never imports hookax; ``imported``
    imports it and enters and leaves a no-op ``hx.intercept`` first."""
    import jax
    import jax.numpy as jnp

    if mode == "imported":
        import hookax as hx

        with hx.intercept(noop_interceptor):
            pass
    s = _llama()
    jl, cfg = s["jl"], s["cfg"]
    args = (s["clean"], s["seg"], s["weights"], cfg)

    def call() -> None:
        jax.block_until_ready(jl.forward(*args))

    x = jnp.float32(1.0)

    def ops() -> None:
        y = x
        for _ in range(OPS):
            y = y + 1.0
        jax.block_until_ready(y)

    for _ in range(3):
        call()
        ops()
    t = timed({"eager": call, "op": ops}, rounds=IDLE_SAMPLES, inner=1)
    return {
        "eager_s": t["eager"]["wall"],
        "eager_cpu_s": t["eager"]["cpu"],
        "op_s": t["op"]["wall"] / OPS,
        "op_cpu_s": t["op"]["cpu"] / OPS,
    }


def idle_costs(s: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The import cost (fresh processes, alternated; the median of each process's fastest
    call) and ``hx.program(forward)`` idle vs ``forward`` (one process, round-robin, min)."""
    import jax

    import hookax as hx

    runs: dict[str, list[dict[str, float]]] = {"plain": [], "imported": []}
    for _ in range(IDLE_PROCS):
        for mode in runs:
            runs[mode].append(_run_child("idle", mode))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    jl, cfg = s["jl"], s["cfg"]
    args = (s["clean"], s["seg"], s["weights"], cfg)
    prog = hx.program(jl.forward)
    t = timed(
        {
            "forward": lambda: jax.block_until_ready(jl.forward(*args)),
            "hx.program(forward)": lambda: jax.block_until_ready(prog(*args)),
        },
        rounds=rounds,
        inner=2,
    )
    f, p = t["forward"], t["hx.program(forward)"]
    return {
        "not_imported_s": med["plain"]["eager_s"],
        "imported_s": med["imported"]["eager_s"],
        "import_ratio": med["imported"]["eager_s"] / med["plain"]["eager_s"],
        "import_cpu_ratio": med["imported"]["eager_cpu_s"] / med["plain"]["eager_cpu_s"],
        "import_ratios_by_process": [
            i["eager_s"] / p["eager_s"] for i, p in zip(runs["imported"], runs["plain"])
        ],
        "op_not_imported_s": med["plain"]["op_s"],
        "op_imported_s": med["imported"]["op_s"],
        "op_ratio": med["imported"]["op_s"] / med["plain"]["op_s"],
        "op_cpu_ratio": med["imported"]["op_cpu_s"] / med["plain"]["op_cpu_s"],
        "forward_s": f["wall"],
        "program_s": p["wall"],
        "program_ratio": p["wall"] / f["wall"],
        "program_cpu_ratio": p["cpu"] / f["cpu"],
    }


# ---------------------------------------------------------------------------------------------
# Haiku: a small decoder written with hk.transform, its layers a Python list or hk.layer_stack

HK_D, HK_HEADS, HK_LAYERS, HK_VOCAB = 128, 4, 4, 256
HAIKU_MODELS = ("haiku list", "haiku layer_stack")


def haiku_supported() -> bool:
    """Whether this hookax sees Haiku's modules (its Haiku adapter exists)."""
    import importlib.util

    try:
        return importlib.util.find_spec("haiku") is not None and (
            importlib.util.find_spec("hookax.frameworks._haiku") is not None
        )
    except ImportError:
        return False


def _haiku(model: str) -> dict[str, Any]:
    """The decoder's forward (``hk.transform``) and its hand-edited twin: ``edit(i, x)``
    replaces layer ``i``'s output (``i`` an int for the list, the traced layer index in the
    layer stack), and the twin returns every layer's output after the logits."""
    import haiku as hk
    import jax
    import jax.numpy as jnp

    class Block(hk.Module):
        def __call__(self, x: jax.Array) -> jax.Array:
            t = x.shape[1]
            mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
            h = hk.LayerNorm(-1, True, True, name="ln_attn")(x)
            init = hk.initializers.VarianceScaling(1.0)
            h = hk.MultiHeadAttention(HK_HEADS, HK_D // HK_HEADS, w_init=init, name="attn")(
                h, h, h, mask=mask
            )
            x = x + h
            h = hk.LayerNorm(-1, True, True, name="ln_mlp")(x)
            h = hk.Linear(HK_D, name="down")(jax.nn.gelu(hk.Linear(2 * HK_D, name="up")(h)))
            return x + h

    def embed(tokens: jax.Array) -> jax.Array:
        pos = hk.Embed(SEQ, HK_D, name="pos_embed")(jnp.arange(tokens.shape[1]))
        return hk.Embed(HK_VOCAB, HK_D, name="embed")(tokens) + pos

    def readout(x: jax.Array) -> jax.Array:
        return hk.Linear(HK_VOCAB, name="unembed")(hk.LayerNorm(-1, True, True, name="ln_f")(x))

    stack = model == "haiku layer_stack"

    def forward(tokens: jax.Array) -> jax.Array:
        x = embed(tokens)
        if stack:
            x = hk.layer_stack(HK_LAYERS, name="layers")(lambda x: Block(name="block")(x))(x)
        else:
            for i in range(HK_LAYERS):
                x = Block(name=f"block_{i}")(x)
        return readout(x)

    def hand(tokens: jax.Array, edit: Any = None) -> tuple[jax.Array, Any]:
        x = embed(tokens)
        if stack:

            def layer(x: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
                x = Block(name="block")(x)
                x = x if edit is None else edit(i, x)
                return x, x

            stacked = hk.layer_stack(HK_LAYERS, with_per_layer_inputs=True, name="layers")
            x, outs = stacked(layer)(x, jnp.arange(HK_LAYERS))
        else:
            outs = []
            for i in range(HK_LAYERS):
                x = Block(name=f"block_{i}")(x)
                x = x if edit is None else edit(i, x)
                outs.append(x)
        return readout(x), outs

    fwd, hand_t = hk.transform(forward), hk.transform(hand)
    clean = jax.random.randint(jax.random.key(1), (1, SEQ), 0, HK_VOCAB)
    corrupt = clean.at[:, SEQ // 3].set((clean[:, SEQ // 3] + 1) % HK_VOCAB)
    params = fwd.init(jax.random.key(0), clean)
    want = jax.tree.structure(hand_t.init(jax.random.key(0), clean))
    assert str(jax.tree.structure(params)) == str(want), "the hand twin's parameters differ"
    where = f"layers/block[0:{HK_LAYERS}]" if stack else "block_*"
    jax.block_until_ready((params, clean, corrupt))
    return {
        "forward": fwd,
        "hand": hand_t,
        "params": params,
        "clean": clean,
        "corrupt": corrupt,
        "where": where,
        "stack": stack,
    }


def _logit_diff(logits: Any) -> Any:
    return logits[0, -1, 1] - logits[0, -1, 2]


def haiku_hlo(h: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import jax

    import hookax as hx

    apply, params, x = h["forward"].apply, h["params"], h["clean"]
    plain = jax.jit(apply).lower(params, None, x)
    out = {}
    for scope, block in (
        ("intercept", lambda: hx.intercept(noop_interceptor)),
        ("hooks", lambda: hx.hooks(forward=noop_forward)),
    ):
        with block():
            hooked = jax.jit(apply).lower(params, None, x)
        out[scope] = compare_programs(plain, hooked)
    return out


def haiku_hand_grid(h: dict[str, Any]) -> Any:
    import jax
    import jax.numpy as jnp

    hand = h["hand"]

    @jax.jit
    def grid(params: Any, clean: Any, corrupt: Any) -> Any:
        _, clean_outs = hand.apply(params, None, clean)
        pos = jnp.arange(clean.shape[1])
        rows = []
        for layer in range(HK_LAYERS):
            target = clean_outs[layer]

            def cell(p: Any, layer: int = layer, target: Any = target) -> Any:
                def edit(i: Any, x: Any) -> Any:
                    hit = (pos == p)[None, :, None] & (i == layer)
                    return jnp.where(hit, target, x)

                return _logit_diff(hand.apply(params, None, corrupt, edit)[0])

            rows.append(jax.vmap(cell)(pos))
        return jnp.stack(rows)

    return grid


def haiku_grid(h: dict[str, Any], rounds: int) -> dict[str, float]:
    import jax
    import numpy as np

    import hookax as hx

    params, clean, corrupt = h["params"], h["clean"], h["corrupt"]
    apply = h["forward"].apply
    hand = haiku_hand_grid(h)

    def fn(p: Any, x: Any) -> Any:
        return apply(p, None, x)

    def hookax_grid() -> Any:
        return jax.block_until_ready(
            hx.patch_grid(fn, (params, clean), (params, corrupt), _logit_diff, where=h["where"])
        )

    def hand_run() -> Any:
        return jax.block_until_ready(hand(params, clean, corrupt))

    got, want = np.asarray(hookax_grid()), np.asarray(hand_run())
    assert got.shape == want.shape == (HK_LAYERS, SEQ), (got.shape, want.shape)
    t = timed({"hookax": hookax_grid, "hand": hand_run}, rounds=2 * rounds, inner=2)
    return {
        "grid_s": t["hookax"]["wall"],
        "hand_grid_s": t["hand"]["wall"],
        "ratio": t["hookax"]["wall"] / t["hand"]["wall"],
        "cpu_ratio": t["hookax"]["cpu"] / t["hand"]["cpu"],
        "max_abs_diff": float(np.max(np.abs(got - want))),
    }


def _haiku_first(model: str, hand_first: bool) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    import hookax as hx

    h = _haiku(model)
    fwd, hand, where = h["forward"], h["hand"], h["where"]
    args = (h["params"], h["clean"])
    jax.block_until_ready(jnp.ones(3) + 1)
    sides = {
        "hand": jax.jit(lambda p, x: hand.apply(p, None, x)),
        "hookax": jax.jit(lambda p, x: hx.capture(fwd.apply, where=where)(p, None, x)),
    }
    out: dict[str, float] = {}
    for side in ("hand", "hookax") if hand_first else ("hookax", "hand"):
        out[f"{side}.first_s"] = _seconds(
            lambda side=side: jax.block_until_ready(sides[side](*args))
        )
    for side in sides:
        out[f"{side}.warm_s"] = min(
            _seconds(lambda side=side: jax.block_until_ready(sides[side](*args))) for _ in range(5)
        )
    return out


# ---------------------------------------------------------------------------------------------


def main(rounds: int = 7) -> dict[str, Any]:
    import flax
    import jax

    versions = f"jax {jax.__version__}, flax {flax.__version__}"
    haiku = haiku_supported()
    if haiku:
        import haiku as hk

        versions += f", dm-haiku {hk.__version__}"
    print(f"CPU ({os.cpu_count()} cores), {versions}; load average {os.getloadavg()[0]:.1f}")
    if not haiku:
        print("(no Haiku rows: this hookax has no Haiku adapter, or Haiku is not installed)")
    results: dict[str, Any] = {}
    s = _llama()
    hks = {m: _haiku(m) for m in HAIKU_MODELS} if haiku else {}
    hlo = llama_hlo(s)
    for m, h in hks.items():
        hlo.update({f"{m}, {k}": v for k, v in haiku_hlo(h).items()})
    results.update({f"hlo.{k}.{f}": v for k, r in hlo.items() for f, v in r.items()})
    rows: list[tuple[str, ...]] = [
        (
            name,
            "identical" if r["stablehlo_same"] else f"{r['stablehlo_diff_lines']} lines differ",
            "identical" if r["hlo_same"] else f"{r['hlo_diff_lines']} lines differ",
            str(r["debug_info_diff_lines"]),
        )
        for name, r in hlo.items()
    ]
    print("\n1. a no-op hookax block under jax.jit vs the program without hookax")
    print(table(rows, ("program, block", "StableHLO", "optimized HLO", "debug-info lines")))

    names = {"llama": "llama (functions)", **{m: m for m in hks}}
    grids = {"llama": llama_grid(s, rounds)}
    grids.update({m: haiku_grid(h, rounds) for m, h in hks.items()})
    load_grid = os.getloadavg()[0]
    firsts = {m: first_calls(m) for m in names}
    load_first = os.getloadavg()[0]
    idle = idle_costs(s, 2 * rounds)
    load_idle = os.getloadavg()[0]
    for m in names:
        key = m.replace(" ", "_")
        results.update({f"grid.{key}.{k}": v for k, v in grids[m].items()})
        results.update({f"first.{key}.{k}": v for k, v in firsts[m].items()})
    results.update({f"idle.llama.{k}": v for k, v in idle.items()})
    results["load"] = {"grid": load_grid, "first": load_first, "idle": load_idle}

    ratio_rows: list[tuple[str, ...]] = []
    for m, label in names.items():
        g = grids[m]
        ratio_rows.append(
            ("patch grid / hand vmapped grid", label, f"{g['grid_s'] * 1e3:.1f} ms",
             f"{g['hand_grid_s'] * 1e3:.1f} ms", f"{g['ratio']:.2f}", f"{g['cpu_ratio']:.2f}",
             "<= 1.2")
        )  # fmt: skip
    for m, label in names.items():
        f = firsts[m]
        ratio_rows.append(
            ("first call: jit(capture) / hand jit", label, f"{f['first_s']:.2f} s",
             f"{f['hand_first_s']:.2f} s", f"{f['ratio']:.2f}", "-", "<= 1.3")
        )  # fmt: skip
    ratio_rows += [
        ("eager: hookax imported / not", names["llama"], f"{idle['imported_s'] * 1e3:.2f} ms",
         f"{idle['not_imported_s'] * 1e3:.2f} ms", f"{idle['import_ratio']:.3f}",
         f"{idle['import_cpu_ratio']:.3f}", "<= 1.03"),
        ("eager scalar add: imported / not", "-", f"{idle['op_imported_s'] * 1e6:.1f} us",
         f"{idle['op_not_imported_s'] * 1e6:.1f} us", f"{idle['op_ratio']:.3f}",
         f"{idle['op_cpu_ratio']:.3f}", "<= 1.03"),
        ("eager: hx.program(f) idle / f", names["llama"], f"{idle['program_s'] * 1e3:.2f} ms",
         f"{idle['forward_s'] * 1e3:.2f} ms", f"{idle['program_ratio']:.3f}",
         f"{idle['program_cpu_ratio']:.3f}", "<= 1.03"),
    ]  # fmt: skip
    print(
        f"\n2-4. ratios (load average {load_grid:.1f} after the grids, {load_first:.1f} after "
        f"the first calls, {load_idle:.1f} after the idle runs)"
    )
    print(
        table(
            ratio_rows, ("measure", "model", "hookax", "without", "ratio", "CPU-time ratio", "goal")
        )
    )
    print(
        "grids: largest |hookax - hand| "
        + ", ".join(f"{m} {g['max_abs_diff']:.1e}" for m, g in grids.items())
        + "; warm first-call programs (hookax / hand): "
        + ", ".join(
            f"{m} {f['warm_s'] * 1e3:.2f} / {f['hand_warm_s'] * 1e3:.2f} ms"
            for m, f in firsts.items()
        )
        + "; import ratio by process pair: "
        + ", ".join(f"{r:.2f}" for r in idle["import_ratios_by_process"])
    )
    return results


if __name__ == "__main__":
    if sys.argv[1] == "first":
        print(json.dumps(first_child(sys.argv[2], sys.argv[3] == "True")))
    elif sys.argv[1] == "idle":
        print(json.dumps(idle_child(sys.argv[2])))
    else:
        main()
