"""What hooks cost when used: per call, per forward, and against depth.

Rows, measured side by side in one run (round-robin, medians, see ``_timing.interleaved``):

* per-call cost of a no-op scoped hook (``hx.hooks(forward=...)``) vs a no-op interceptor
  (``hx.intercept``) vs idle, eager, on a chain of trivial NNX modules (each returns its input:
  what is left is hookax's own cost per call site; goal: scoped hook within 1.5x of an
  interceptor);
* an eager forward of a 24-layer NNX MLP with a no-op forward hook registered on every
  ``nnx.Linear`` (``hx.register_forward_hook``) vs idle (goal: at most 1.10x);
* the per-call cost of the scoped hook and of per-module hooks at depth 6, 24 and 96 (goal:
  flat: no cost grows with the size of the model).

Run: ``python -m benchmarks hookcost``.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from ._timing import interleaved, table

WIDTH, BATCH = 64, 8


def noop_interceptor(next_fun, args, kwargs, context):
    return next_fun(*args, **kwargs)


def noop_forward(module, args, out):
    return None


def _chain(depth: int):
    """A root holding ``depth`` trivial modules; the forward calls each once."""
    from flax import nnx

    class Step(nnx.Module):
        def __call__(self, x):
            return x

    class Chain(nnx.Module):
        def __init__(self) -> None:
            self.layers = nnx.List([Step() for _ in range(depth)])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Chain()


def _per_call(depths: tuple[int, ...], rounds: int) -> dict[int, dict[str, float]]:
    """Microseconds per module call (the root's call spread over the ``depth`` leaves)."""
    import hookax as hx

    out = {}
    for depth in depths:
        model = _chain(depth)
        registered = _chain(depth)
        for layer in registered.layers:
            hx.register_forward_hook(layer, noop_forward)
        configs = {
            "idle": lambda m=model: m(1.0),
            "interceptor": lambda m=model: m(1.0),
            "scoped hook": lambda m=model: m(1.0),
            "module hooks": lambda m=registered: m(1.0),
        }
        around = {
            "interceptor": lambda: hx.intercept(noop_interceptor),
            "scoped hook": lambda: hx.hooks(forward=noop_forward),
        }
        inner = max(1, 2000 // depth)
        t = interleaved(configs, rounds=rounds, inner=inner, around=around)
        out[depth] = {k: v / (depth + 1) * 1e6 for k, v in t.items()}
    return out


def _mlp_forward(rounds: int) -> dict[str, float]:
    """Milliseconds per eager forward of a 24-layer MLP: idle vs a no-op hook on every layer."""
    from flax import nnx

    import hookax as hx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(24)])

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    plain, hooked = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
    for layer in hooked.layers:
        hx.register_forward_hook(layer, noop_forward)
    x = jnp.ones((BATCH, WIDTH))
    configs = {
        "idle": lambda: plain(x).block_until_ready(),
        "forward hook on every layer": lambda: hooked(x).block_until_ready(),
        "one no-op interceptor": lambda: plain(x).block_until_ready(),
        "one no-op scoped hook": lambda: plain(x).block_until_ready(),
    }
    around = {
        "one no-op interceptor": lambda: hx.intercept(noop_interceptor),
        "one no-op scoped hook": lambda: hx.hooks(forward=noop_forward),
    }
    t = interleaved(configs, rounds=rounds, inner=5, around=around)
    # Drop the hooked model's hooks again (so the idle fast path of later benchmarks is intact).
    for layer in hooked.layers:
        hx.remove_hooks(layer)
    return {k: v * 1e3 for k, v in t.items()}


def main(rounds: int = 15) -> dict[str, float]:
    import hookax as hx

    with hx.intercept(noop_interceptor):
        pass  # install the NNX adapter before timing
    per_call = _per_call((6, 24, 96), rounds)
    rows = []
    for depth, t in per_call.items():
        idle = t["idle"]
        for name in ("idle", "interceptor", "scoped hook", "module hooks"):
            extra = t[name] - idle
            ratio = "" if name == "idle" else f"{t[name] / t['interceptor']:.2f}"
            rows.append((str(depth), name, f"{t[name]:.2f}", f"{extra:+.2f}", ratio))
    print("Per module call, eager, trivial modules (us; cost = minus idle):")
    print(table(rows, ("depth", "configuration", "us/call", "cost", "ratio to interceptor")))
    mlp = _mlp_forward(rounds)
    rows = [(k, f"{v:.3f}", f"{v / mlp['idle']:.2f}x") for k, v in mlp.items()]
    print("\nEager forward, 24-layer NNX MLP (ms):")
    print(table(rows, ("configuration", "ms/forward", "ratio to idle")))
    result = {f"per_call/{d}/{k}": v for d, t in per_call.items() for k, v in t.items()}
    result.update({f"mlp/{k}": v for k, v in mlp.items()})
    return result


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
