"""The first call of each interpretability workflow, beside the same program written by hand.

In a notebook every new question is a first call: it traces and compiles. For two models (the
``hookax.examples.transformer`` decoder, 12 blocks, d_model 64, 64 tokens; a GPT, 3 blocks,
d_model 64, LayerNorm and GELU, 16 tokens) and five workflows, the seconds of

* ``first_s``: hookax's first call (``hand_first_s``: the first call of the equivalent
  ``jax.jit`` program written without hookax, in the same process);
* ``new_data_s``: a call with new data (a new prompt pair, new answer tokens closed over by a
  metric made anew, a new steering vector): no recompilation (min over 6 new data sets);
* ``warm_s``: the same call again (min of 6).

Workflows: ``capture`` (every block's output, ``jax.jit`` over ``hx.capture``); ``resid_grid``
(``hx.patch_grid`` over blocks x positions); ``head_grid`` (the attention's per-head output,
``heads=``, [layer, head, position]); ``attribution`` (``hx.attribution_patch`` over blocks);
``steering`` (10 greedy tokens, a Python loop over a jitted step with ``hx.intercept`` adding
a vector to block 1's output). Each (model, workflow) runs in 4 fresh processes, hand first
then hookax first, twice; the figures are the min of the four (first calls vary by 0.2-0.4 s
from process to process on a 2-core machine, Python's garbage collector included). ``cache``
measures ``hx.compilation_cache``: a new process's first residual grid with the disk cache warm
vs off, where its time goes (tracing, compiling or reading back, the rest: mostly the program's
first run), in JAX's default configuration and with XLA:CPU's YNNPACK fusions off.

    python -m benchmarks firstcall --json out.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._timing import compiled_programs, table

WORKFLOWS = ("capture", "resid_grid", "head_grid", "attribution", "steering")
MODELS = ("transformer", "gpt")
NEW_TOKENS, STEER_AT = 10, 1
PAIRS = 2  # fresh processes per (model, workflow): hand first, hookax first, PAIRS times
NEW_SETS = 6  # new prompt pairs (and answers, steering vectors) after the first
NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="  # XLA:CPU without its YNNPACK fusions


def _gpt_classes() -> Any:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Embed(nnx.Module):
        def __init__(self, vocab: int, seq: int, d: int, rngs: nnx.Rngs) -> None:
            self.tok = nnx.Embed(vocab, d, rngs=rngs)
            self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, d)))

        def __call__(self, tokens: jax.Array) -> jax.Array:
            return self.tok(tokens) + self.pos[...][: tokens.shape[1]]

    class Heads(nnx.Module):
        """Per-head attention output, (batch, pos, head, d_head): a patchable call site."""

        def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            t = q.shape[1]
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    class Attn(nnx.Module):
        def __init__(self, d: int, h: int, rngs: nnx.Rngs) -> None:
            self.n_heads = h
            self.q, self.k, self.v, self.o = (nnx.Linear(d, d, rngs=rngs) for _ in range(4))
            self.mix = Heads()

        def z(self, x: jax.Array) -> jax.Array:
            b, t, d = x.shape
            split = lambda y: y.reshape(b, t, self.n_heads, d // self.n_heads)  # noqa: E731
            return self.mix(split(self.q(x)), split(self.k(x)), split(self.v(x)))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.o(self.z(x).reshape(x.shape))

    class Block(nnx.Module):
        def __init__(self, d: int, h: int, rngs: nnx.Rngs) -> None:
            self.attn_norm, self.mlp_norm = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
            self.attn = Attn(d, h, rngs)
            self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

        def mlp(self, x: jax.Array) -> jax.Array:
            return self.down(jax.nn.gelu(self.up(x)))

        def __call__(self, x: jax.Array) -> jax.Array:
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))

    class GPT(nnx.Module):
        def __init__(self, vocab: int, seq: int, d: int, h: int, depth: int, rngs: nnx.Rngs):
            self.embed = Embed(vocab, seq, d, rngs)
            self.layers = nnx.List([Block(d, h, rngs) for _ in range(depth)])
            self.norm = nnx.LayerNorm(d, rngs=rngs)
            self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    return GPT


def _setup(name: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if name == "transformer":
        from hookax.examples import transformer

        seq, vocab = 64, 256
        cfg = transformer.Config(n_layers=12, d_model=64, seq_len=seq, vocab=vocab)
        model = transformer.make_model(nnx.Rngs(0), cfg)
        head_target = {"ops": "layers/*/attn:reshape#4", "heads": 2}
    else:
        seq, vocab = 16, 64
        model = _gpt_classes()(vocab, seq + NEW_TOKENS, 64, 4, 3, nnx.Rngs(0))
        head_target = {"where": "layers/*/attn/mix", "heads": 2}
    keys = [jax.random.key(i) for i in range(1, 2 + NEW_SETS)]
    prompts = [jax.random.randint(k, (1, seq), 0, vocab) for k in keys]
    pairs = [(p, p.at[0, seq // 3].set((p[0, seq // 3] + 1) % vocab)) for p in prompts]
    answers = [jnp.array([3 + i, 7 + 2 * i]) for i in range(1 + NEW_SETS)]
    d_model = model.embed(prompts[0]).shape[-1]
    # Steering's token buffers and vectors, made before any timing (no side pays for them).
    steer = [
        (
            jnp.zeros((1, seq + NEW_TOKENS), clean.dtype).at[:, :seq].set(clean),
            jnp.full((d_model,), 0.5 * (i + 1), jnp.float32),
        )
        for i, (clean, _) in enumerate(pairs)
    ]
    jax.block_until_ready((model(prompts[0]), steer))  # both sides start after one forward
    return {
        "model": model,
        "pairs": pairs,
        "answers": answers,
        "head": head_target,
        "seq": seq,
        "steer": steer,
    }


def _z(attn: Any, x: Any) -> Any:
    """An attention's per-head output (batch, pos, head, d_head), without hookax."""
    import jax
    import jax.numpy as jnp

    if hasattr(attn, "z"):
        return attn.z(x)
    b, t, d = x.shape
    split = lambda y: y.reshape(b, t, attn.n_heads, d // attn.n_heads)  # noqa: E731
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    return jax.nn.dot_product_attention(
        split(attn.q(x)), split(attn.k(x)), split(attn.v(x)), mask=mask[None, None]
    )


def _block_z(block: Any, x: Any, z: Any) -> Any:
    x = x + block.attn.o(z.reshape(x.shape))
    return x + block.mlp(block.mlp_norm(x))


def _readout(m: Any, x: Any) -> Any:
    return m.lm_head(m.norm(x))


def _hand(workflow: str) -> Any:
    """The hand-written program of ``workflow``: a function of (model, data) -> result."""
    import jax
    import jax.numpy as jnp

    def stack(m: Any, tokens: Any) -> list[Any]:
        x, out = m.embed(tokens), []
        for layer in m.layers:
            x = layer(x)
            out.append(x)
        return out

    def logit_diff(logits: Any, ans: Any) -> Any:
        return logits[0, -1, ans[0]] - logits[0, -1, ans[1]]

    if workflow == "capture":
        return jax.jit(lambda m, t: (_readout(m, stack(m, t)[-1]), stack(m, t)))

    if workflow == "resid_grid":

        @jax.jit
        def grid(m: Any, clean: Any, corrupt: Any, ans: Any) -> Any:
            cs, hs = stack(m, clean), stack(m, corrupt)
            pos = jnp.arange(clean.shape[1])
            rows = []
            for i in range(len(m.layers)):

                def cell(p: Any, i: int = i) -> Any:
                    x = jnp.where((pos == p)[None, :, None], cs[i], hs[i])
                    for block in m.layers[i + 1 :]:
                        x = block(x)
                    return logit_diff(_readout(m, x), ans)

                rows.append(jax.vmap(cell)(pos))
            return jnp.stack(rows)

        return grid

    if workflow == "head_grid":

        @jax.jit
        def heads(m: Any, clean: Any, corrupt: Any, ans: Any) -> Any:
            xc, xs = m.embed(clean), m.embed(corrupt)
            rows = []
            for i, block in enumerate(m.layers):
                zc = _z(block.attn, block.attn_norm(xc))
                zs = _z(block.attn, block.attn_norm(xs))
                t, h = zs.shape[1:3]

                def cell(hp: Any, i: int = i, zc: Any = zc, zs: Any = zs, x: Any = xs) -> Any:
                    t, h = zs.shape[1:3]
                    mask = ((jnp.arange(t) == hp[1])[:, None] & (jnp.arange(h) == hp[0]))[
                        None, :, :, None
                    ]
                    y = _block_z(m.layers[i], x, jnp.where(mask, zc, zs))
                    for later in m.layers[i + 1 :]:
                        y = later(y)
                    return logit_diff(_readout(m, y), ans)

                hp = jnp.stack(jnp.meshgrid(jnp.arange(h), jnp.arange(t), indexing="ij"), -1)
                rows.append(jax.vmap(jax.vmap(cell))(hp))
                xc, xs = block(xc), block(xs)
            return jnp.stack(rows)

        return heads

    if workflow == "attribution":

        @jax.jit
        def attribution(m: Any, clean: Any, corrupt: Any, ans: Any) -> Any:
            cs = stack(m, clean)

            def metric(deltas: Any) -> Any:
                x, out = m.embed(corrupt), []
                for layer, d in zip(m.layers, deltas):
                    x = layer(x) + d
                    out.append(x)
                return logit_diff(_readout(m, x), ans), out

            zeros = [jnp.zeros_like(c) for c in cs]
            grads, hs = jax.grad(metric, has_aux=True)(zeros)
            return jnp.stack([((c - h) * g).sum(-1)[0] for c, h, g in zip(cs, hs, grads)])

        return attribution

    @jax.jit
    def step(m: Any, buf: Any, pos: Any, vector: Any) -> Any:
        x = m.embed(buf)
        for i, layer in enumerate(m.layers):
            x = layer(x) + (vector if i == STEER_AT else 0.0)
        tok = jnp.argmax(_readout(m, x)[0, pos - 1], -1).astype(buf.dtype)
        return buf.at[0, pos].set(tok)

    return step


def _hookax(workflow: str, head: dict[str, Any]) -> Any:
    import jax
    import jax.numpy as jnp

    import hookax as hx

    def metric_for(ans: Any) -> Any:
        return lambda logits: logits[0, -1, ans[0]] - logits[0, -1, ans[1]]

    if workflow == "capture":
        return jax.jit(lambda m, t: hx.capture(m, where="layers/*")(t))
    if workflow == "resid_grid":
        return lambda m, c, x, a: hx.patch_grid(m, (c,), (x,), metric_for(a), where="layers/*")
    if workflow == "head_grid":
        return lambda m, c, x, a: hx.patch_grid(m, (c,), (x,), metric_for(a), **head)
    if workflow == "attribution":
        return lambda m, c, x, a: hx.attribution_patch(
            m, (c,), (x,), metric_for(a), where="layers/*"
        )

    @jax.jit
    def step(m: Any, buf: Any, pos: Any, vector: Any) -> Any:
        steer = lambda nf, a, k, c: nf(*a, **k) + vector  # noqa: E731
        with hx.intercept(steer, where=f"layers/{STEER_AT}"):
            logits = m(buf)
        tok = jnp.argmax(logits[0, pos - 1], -1).astype(buf.dtype)
        return buf.at[0, pos].set(tok)

    return step


def _call(workflow: str, fn: Any, s: dict[str, Any], i: int) -> Any:
    """One call of a workflow on data set ``i`` (0: the first prompt and answers; then new)."""
    import jax

    model, (clean, corrupt), ans = s["model"], s["pairs"][i], s["answers"][i]
    if workflow == "capture":
        return jax.block_until_ready(fn(model, corrupt if i % 2 else clean))
    if workflow != "steering":
        return jax.block_until_ready(fn(model, clean, corrupt, ans))
    seq, (buf, vector) = s["seq"], s["steer"][i]
    for pos in range(seq, seq + NEW_TOKENS):
        buf = fn(model, buf, pos, vector)
    return jax.block_until_ready(buf)


def _seconds(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def child(model_name: str, workflow: str, hand_first: bool) -> dict[str, float]:
    """One (model, workflow) in this fresh process: first calls of both sides, then new data
    and warm calls."""
    s = _setup(model_name)
    sides = {"hand": _hand(workflow), "hookax": _hookax(workflow, s["head"])}
    order = ["hand", "hookax"] if hand_first else ["hookax", "hand"]
    out: dict[str, float] = {}
    for side in order:
        out[f"{side}.first_s"] = _seconds(lambda side=side: _call(workflow, sides[side], s, 0))
    compiled_programs()  # hookax's: new data and warm calls run the compiled programs
    for side in order:
        new = [
            _seconds(lambda i=i, side=side: _call(workflow, sides[side], s, i))
            for i in range(1, 1 + NEW_SETS)
        ]
        out[f"{side}.new_data_s"] = min(new)
        warm = [
            _seconds(lambda side=side: _call(workflow, sides[side], s, NEW_SETS))
            for _ in range(NEW_SETS)
        ]
        out[f"{side}.warm_s"] = min(warm)
    return out


def _run_child(*args: str, env: dict[str, str] | None = None) -> Any:
    cmd = [sys.executable, "-m", "benchmarks.bench_firstcall", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cache_child(path: str, side: str) -> dict[str, float]:
    """A new process's first residual grid, and where its time went (JAX's monitoring events):
    tracing, compiling (with the cache warm: reading the program back), the rest (the first
    run of the program, the grid's Python)."""
    import collections

    from jax import monitoring

    import hookax as hx

    if path != "-":
        hx.compilation_cache(path)
    s = _setup("transformer")
    spent: dict[str, float] = collections.defaultdict(float)

    def listen(event: str, secs: float, **_: Any) -> None:
        spent[event.rsplit("/", 1)[-1]] += secs

    monitoring.register_event_duration_secs_listener(listen)
    fn = _hookax("resid_grid", s["head"]) if side == "hookax" else _hand("resid_grid")
    total = _seconds(lambda: _call("resid_grid", fn, s, 0))
    trace, compile_s = spent["jaxpr_trace_duration"], spent["backend_compile_duration"]
    lower = spent["jaxpr_to_mlir_module_duration"]
    warm = min(_seconds(lambda: _call("resid_grid", fn, s, 0)) for _ in range(3))
    return {
        "warm_s": warm,
        "first_s": total,
        "trace_s": trace,
        "lower_s": lower,
        "compile_s": compile_s,
        "other_s": total - trace - lower - compile_s,
    }


def main() -> dict[str, Any]:
    import jax
    import jaxlib

    results: dict[str, Any] = {}
    rows = []
    for model_name in MODELS:
        for workflow in WORKFLOWS:
            runs = [_run_child(model_name, workflow, str(h)) for h in (True, False) * PAIRS]
            best = {k: min(r[k] for r in runs) for k in runs[0]}
            fig = {
                "first_s": best["hookax.first_s"],
                "hand_first_s": best["hand.first_s"],
                "new_data_s": best["hookax.new_data_s"],
                "warm_s": best["hookax.warm_s"],
                "hand_warm_s": best["hand.warm_s"],
            }
            key = workflow if model_name == "transformer" else f"gpt.{workflow}"
            results.update({f"{key}.{k}": v for k, v in fig.items()})
            rows.append(
                (
                    f"{model_name} {workflow}",
                    f"{fig['first_s']:.2f}",
                    f"{fig['hand_first_s']:.2f}",
                    f"{fig['first_s'] / fig['hand_first_s']:.2f}",
                    f"{fig['new_data_s'] * 1e3:.0f}",
                    f"{fig['warm_s'] * 1e3:.0f}",
                    f"{fig['new_data_s'] / fig['warm_s']:.2f}",
                )
            )
    # The disk cache in JAX's default configuration (hookax's grid and the hand-written one),
    # and with XLA:CPU's YNNPACK fusions off (their set-up is part of every new program's first
    # run, cached or not).
    caches: dict[str, dict[str, Any]] = {}
    for side, flags in (("hookax", ""), ("hand", ""), ("hookax", NO_YNN)):
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        with tempfile.TemporaryDirectory() as d:
            _run_child("cache", d, side, env=env)  # fills the cache
            runs = {
                "cold": [_run_child("cache", "-", side, env=env) for _ in range(2)],
                "warm": [_run_child("cache", d, side, env=env) for _ in range(2)],
            }
        for name, got in runs.items():
            best = min(got, key=lambda r: r["first_s"])
            shown = (
                f"{side}{', YNN off' if flags else ''}, cache {'warm' if name == 'warm' else 'off'}"
            )
            caches[shown] = best
            prefix = (
                "cache"
                if side == "hookax" and not flags
                else f"cache.{side}{'.ynn_off' if flags else ''}"
            )
            results.update({f"{prefix}.{name}_{k}": v for k, v in best.items()})
    print(
        f"CPU ({os.cpu_count()} cores), JAX {jax.__version__}, jaxlib {jaxlib.__version__}; "
        f"seconds, min of {2 * PAIRS} fresh processes\n"
    )
    header = ("model workflow", "first", "hand first", "ratio", "new ms", "warm ms", "new/warm")
    print(table(rows, header))
    cold, warm = caches["hookax, cache off"], caches["hookax, cache warm"]
    no_ynn = caches["hookax, YNN off, cache warm"]
    hand_cold, hand_warm = caches["hand, cache off"], caches["hand, cache warm"]
    print(
        f"\nresid grid, new process: {cold['first_s']:.2f} s without the disk cache, "
        f"{warm['first_s']:.2f} s with hx.compilation_cache warm "
        f"({warm['first_s'] / cold['first_s']:.2f}x); with XLA_FLAGS={NO_YNN} as well, "
        f"{no_ynn['first_s']:.2f} s ({no_ynn['first_s'] / cold['first_s']:.2f}x); the hand-written "
        f"grid: {hand_cold['first_s']:.2f} s, {hand_warm['first_s']:.2f} s with the cache "
        f"({hand_warm['first_s'] / hand_cold['first_s']:.2f}x)\n"
    )
    cache_rows = [
        (
            name,
            *(f"{got[k]:.2f}" for k in ("first_s", "trace_s", "lower_s", "compile_s", "other_s")),
            f"{got['warm_s']:.3f}",
        )
        for name, got in caches.items()
    ]
    head = ("resid grid, new process", "first", "trace", "lower", "compile/read", "rest", "warm")
    print(table(cache_rows, head))
    return results


if __name__ == "__main__":
    if sys.argv[1] == "cache":
        print(json.dumps(_cache_child(sys.argv[2], sys.argv[3])))
    else:
        print(json.dumps(child(sys.argv[1], sys.argv[2], sys.argv[3] == "True")))
