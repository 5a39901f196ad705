"""Statistics of every layer inside a jitted optax train step: what they cost.

Two models, each trained by one ``jax.jit`` step (``nnx.split`` state in, new state out,
donated; optax adam):

* ``mlp``: 12 blocks of Linear(256 -> 256) + relu, batch 64 (a small MLP);
* ``transformer``: a 12-layer decoder (``hookax.examples.transformer.Block``: RMSNorm, causal
  attention, SwiGLU) stacked with ``nnx.vmap`` and run with ``nnx.scan``; d=64, 4 heads,
  sequence 32, batch 16.

Configurations, timed in interleaved rounds in one process (the ratios come from one run), each
as ten steps dispatched back to back and waited for once (as a training loop runs):

* ``plain``: ``nnx.value_and_grad`` and the update;
* ``stats``: ``hx.value_grad_and_stats`` (norm, mean, max |x|, fraction of zeros, non-finite
  count) of every layer's output and of its gradient, every step;
* ``every10``: the statistics step once and the plain step nine times, per step;
* ``hand_taps``: no hookax: the model's own code edited to pass each layer's output through a
  ``custom_vjp`` identity whose backward reduces the cotangent into a dummy's cotangent, the
  dummies threaded through the scan by hand (the best hand-written method, DESIGN.md point 19);
* (transformer) ``stats_all``: the statistics of every call site (norms, attention, its four
  projections, the MLP and its three, each block), not only the layers.

Memory: ``temp_size_in_bytes`` of each compiled step (``memory_analysis``). Targets (a
2-core CPU): ``stats`` <= 1.03x ``plain`` on the transformer; ``every10`` <= 1.02x on the
MLP; ``stats`` <= 1.02x ``hand_taps`` on both, with no extra temporary memory.

Run: ``python -m benchmarks train [--json PATH]``.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import hookax as hx
from benchmarks._timing import table
from hookax.examples import transformer as tfm

LAYERS, D, BATCH = 12, 256, 64
CFG = tfm.Config(vocab=256, d_model=64, n_heads=4, n_layers=LAYERS, d_ff=172, seq_len=32)
T_BATCH = 16
PERIOD = 10  # steps per timed call, in every configuration (the dispatch pipelines alike)
ROUNDS = {"mlp": 40, "transformer": 16}
STATS = ("norm", "mean", "max_abs", "frac_zero", "nonfinite")


# ---- hand-written taps (no hookax) -----------------------------------------------------------


def _reduce(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return jnp.stack(
        [
            jnp.sqrt(jnp.sum(x * x)),
            jnp.mean(x),
            jnp.max(jnp.abs(x)),
            jnp.mean((x == 0).astype(jnp.float32)),
            jnp.sum((~jnp.isfinite(x)).astype(jnp.float32)),
        ]
    )


@jax.custom_vjp
def tap(x: jax.Array, dummy: jax.Array) -> jax.Array:
    return x


def _tap_fwd(x: jax.Array, dummy: jax.Array) -> Any:
    return x, _reduce(x)


def _tap_bwd(forward: jax.Array, ct: jax.Array) -> Any:
    return ct, jnp.concatenate([forward, _reduce(ct)])


tap.defvjp(_tap_fwd, _tap_bwd)


# ---- the models ------------------------------------------------------------------------------


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(self.lin(x))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([Layer(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(D, 10, rngs=rngs)

    def __call__(self, x: jax.Array, taps: jax.Array | None = None) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if taps is not None:
                x = tap(x, taps[i])
        return self.head(x)


class ScannedDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(CFG.vocab, CFG.d_model, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> tfm.Block:
            return tfm.Block(CFG, rngs=rngs)

        self.blocks = make(rngs)
        self.norm = nnx.RMSNorm(CFG.d_model, rngs=rngs)
        self.head = nnx.Linear(CFG.d_model, CFG.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, taps: jax.Array | None = None) -> jax.Array:
        x = self.embed(tokens)
        if taps is None:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x: jax.Array, block: tfm.Block) -> jax.Array:
                return block(x)

            x = body(x, self.blocks)
        else:

            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
            def tapped(x: jax.Array, block: tfm.Block, dummy: jax.Array) -> jax.Array:
                return tap(block(x), dummy)

            x = tapped(x, self.blocks, taps)
        return self.head(self.norm(x))


def mlp_loss(model: Any, x: jax.Array, y: jax.Array, taps: Any = None) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x, taps), y).mean()


def lm_loss(model: Any, tokens: jax.Array, targets: jax.Array, taps: Any = None) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens, taps), targets).mean()


# ---- the train steps -------------------------------------------------------------------------


def steps(model: Any, loss_fn: Callable[..., Any], where: Any) -> dict[str, Callable[..., Any]]:
    """The jitted steps ``(params, opt_state, x, y) -> (params, opt_state, loss, extra)``."""
    graphdef = nnx.graphdef(model)
    tx = optax.adam(1e-3)

    def update(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def plain(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, params), x, y)
        return (*update(params, opt_state, nnx.state(grads)), loss, None)

    def with_stats(where: Any, params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        vgs = hx.value_grad_and_stats(loss_fn, where=where, stats=STATS)
        loss, grads, stats = vgs(nnx.merge(graphdef, params), x, y)
        return (*update(params, opt_state, nnx.state(grads)), loss, stats)

    def hand(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        dummies = jnp.zeros((LAYERS, 2 * len(STATS)), jnp.float32)
        vg = nnx.value_and_grad(loss_fn, argnums=(0, 3))
        loss, (grads, stats) = vg(nnx.merge(graphdef, params), x, y, dummies)
        return (*update(params, opt_state, nnx.state(grads)), loss, stats)

    jit = functools.partial(jax.jit, donate_argnums=(0, 1))
    out = {
        "plain": jit(plain),
        "stats": jit(functools.partial(with_stats, where)),
        "hand_taps": jit(hand),
    }
    if where is not None:
        out["stats_all"] = jit(functools.partial(with_stats, None))
    return out


class Runner:
    """One configuration's own parameters and optimizer state, stepped in place."""

    def __init__(self, model: Any, fns: list[Callable[..., Any]], x: Any, y: Any) -> None:
        params = nnx.state(model)
        self.state = (jax.tree.map(jnp.copy, params), optax.adam(1e-3).init(params))
        self.fns, self.x, self.y = fns, x, y

    def __call__(self) -> None:
        for fn in self.fns:
            params, opt_state, loss, extra = fn(*self.state, self.x, self.y)
            self.state = (params, opt_state)
        jax.block_until_ready((self.state, loss, extra))


def paired(configs: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each config in each round; every config runs once a round, in an order that
    rotates from round to round (so no config always follows the same one)."""
    names = list(configs)
    for fn in configs.values():  # compile, warm every cache
        fn()
    samples: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            configs[k]()
            samples[k].append(time.perf_counter() - t0)
    return samples


def _ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of ``a / b`` measured in the same round: a shared slow-down of the
    machine (other processes on its cores) cancels out."""
    return statistics.median(x / y for x, y in zip(a, b))


def measure(
    name: str, model: Any, loss_fn: Any, where: Any, x: Any, y: Any, rounds: int
) -> dict[str, float]:
    fns = steps(model, loss_fn, where)
    params = nnx.state(model)
    opt_state = optax.adam(1e-3).init(params)
    temp = {
        k: fn.lower(params, opt_state, x, y).compile().memory_analysis().temp_size_in_bytes
        for k, fn in fns.items()
    }
    configs = {k: Runner(model, [fn] * PERIOD, x, y) for k, fn in fns.items()}
    configs["every10"] = Runner(model, [fns["stats"]] + [fns["plain"]] * (PERIOD - 1), x, y)
    samples = paired(configs, rounds)
    ms = {k: statistics.median(v) * 1e3 / PERIOD for k, v in samples.items()}
    ratio = {k: _ratio(samples[k], samples["plain"]) for k in samples}
    rows = [(k, f"{ms[k]:.3f}", f"{ratio[k]:.3f}x", f"{temp.get(k, temp['plain']):,}") for k in ms]
    print(f"\n{name}")
    print(table(rows, ("step", "ms", "vs plain", "temp bytes")))
    print(
        f"stats / hand_taps: {_ratio(samples['stats'], samples['hand_taps']):.3f}x; "
        f"temp memory over plain: stats {temp['stats'] - temp['plain']:+,} B, "
        f"hand taps {temp['hand_taps'] - temp['plain']:+,} B"
    )
    out = {
        "plain_ms": ms["plain"],
        "stats_ms": ms["stats"],
        "every10_ms": ms["every10"],
        "hand_taps_ms": ms["hand_taps"],
        "temp_bytes_plain": temp["plain"],
        "temp_bytes_stats": temp["stats"],
        "temp_bytes_hand_taps": temp["hand_taps"],
        "stats_ratio": ratio["stats"],
        "every10_ratio": ratio["every10"],
        "hand_taps_ratio": ratio["hand_taps"],
        "stats_vs_hand_taps": _ratio(samples["stats"], samples["hand_taps"]),
    }
    if "stats_all" in ms:
        out |= {"stats_all_ms": ms["stats_all"], "temp_bytes_stats_all": temp["stats_all"]}
    return out


def main() -> dict[str, dict[str, float]]:
    print(f"{jax.devices()[0].device_kind}; ms: medians of interleaved rounds of {PERIOD} steps;")
    print("ratios: medians of the ratios measured in the same round; statistics:")
    print(f"  {', '.join(STATS)} of each layer's output and of its gradient")
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (BATCH, D))
    y = jax.random.randint(keys[1], (BATCH,), 0, 10)
    results = {
        "mlp": measure(
            "mlp: 12 x Linear(256)+relu, batch 64",
            MLP(nnx.Rngs(0)),
            mlp_loss,
            "layers/*",
            x,
            y,
            ROUNDS["mlp"],
        )
    }
    tokens = jax.random.randint(keys[2], (T_BATCH, CFG.seq_len + 1), 0, CFG.vocab)
    results["transformer"] = measure(
        "transformer: 12 scanned blocks, d=64, seq 32, batch 16",
        ScannedDecoder(nnx.Rngs(0)),
        lm_loss,
        "blocks",
        tokens[:, :-1],
        tokens[:, 1:],
        ROUNDS["transformer"],
    )
    return results


if __name__ == "__main__":
    main()
