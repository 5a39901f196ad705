"""Capture and activation-gradient costs, jitted: hookax vs NNX ``perturb`` vs plain ``nnx.grad``.

A 16-layer NNX MLP (width 512, batch 256). Gradients of every layer's output:

* ``hookax``: ``hx.value_and_grad(loss, where=Layer)`` on the unmodified model;
* ``perturb``: the model edited with a ``self.perturb(...)`` call per layer, NNX's documented way
  (``nnx.capture(..., nnx.Perturbation)`` then ``nnx.grad`` over model and perturbations);
* ``nnx.grad``: parameter gradients only (the floor).

And capture of every layer's output vs no capture. Then the same 16 layers stacked and run with
``nnx.scan`` (how deep models are written): ``hx.value_and_grad`` vs ``nnx.grad`` vs a hand-written
perturbation threaded through the scan as an extra scanned input. Median wall times over
interleaved repetitions, ratios, and compiled memory (argument + output + temp bytes from
``memory_analysis()``).

Run: ``PYTHONPATH=. python benchmarks/bench_capture.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import hookax as hx

DEPTH, WIDTH, BATCH, REPS = 16, 512, 256, 30


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(self.lin(x))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([Layer(rngs) for _ in range(DEPTH)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


class PerturbMLP(MLP):
    """The same model, edited the NNX way: one ``perturb`` call per layer output."""

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = self.perturb(f"layer{i}", layer(x))
        return x


class ScanMLP(nnx.Module):
    """The 16 layers stacked, run with ``nnx.scan``; ``perturbs`` is the hand-threaded version."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Layer:
            return Layer(rngs)

        self.layers = make(rngs)

    def __call__(self, x: jax.Array, perturbs: jax.Array | None = None) -> jax.Array:
        if perturbs is None:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x: jax.Array, layer: Layer) -> jax.Array:
                return layer(x)

            return body(x, self.layers)

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def threaded(x: jax.Array, layer: Layer, p: jax.Array) -> jax.Array:
            return layer(x) + p

        return threaded(x, self.layers, perturbs)


def loss_fn(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def build() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    model = MLP(nnx.Rngs(0))
    pmodel = PerturbMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    y = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
    _, perturbations = nnx.capture(pmodel, nnx.Perturbation)(x)

    @nnx.jit
    def hookax_step(model: Any, x: jax.Array, y: jax.Array) -> Any:
        return hx.value_and_grad(loss_fn, where=Layer)(model, x, y)

    @nnx.jit
    def perturb_step(model: Any, perturbations: Any, x: jax.Array, y: jax.Array) -> Any:
        def loss(model: Any, perturbations: Any, x: jax.Array, y: jax.Array) -> Any:
            out, _ = nnx.capture(model, nnx.Intermediate, init=perturbations)(x)
            return jnp.mean((out - y) ** 2)

        return nnx.value_and_grad(loss, argnums=(0, 1))(model, perturbations, x, y)

    @nnx.jit
    def grad_step(model: Any, x: jax.Array, y: jax.Array) -> Any:
        return nnx.value_and_grad(loss_fn)(model, x, y)

    @nnx.jit
    def capture_fwd(model: Any, x: jax.Array) -> Any:
        return hx.capture(model, where=Layer)(x)

    @nnx.jit
    def plain_fwd(model: Any, x: jax.Array) -> Any:
        return model(x)

    smodel = ScanMLP(nnx.Rngs(0))

    @nnx.jit
    def scan_hookax_step(model: Any, x: jax.Array, y: jax.Array) -> Any:
        return hx.value_and_grad(loss_fn, where=Layer)(model, x, y)

    @nnx.jit
    def scan_threaded_step(model: Any, x: jax.Array, y: jax.Array) -> Any:
        def loss(model: Any, p: jax.Array) -> Any:
            return jnp.mean((model(x, p) - y) ** 2)

        p = jnp.zeros((DEPTH, *x.shape))
        return nnx.value_and_grad(loss, argnums=(0, 1))(model, p)

    return {
        "scan: hx.value_and_grad": (scan_hookax_step, (smodel, x, y)),
        "scan: threaded perturb": (scan_threaded_step, (smodel, x, y)),
        "scan: nnx.grad": (grad_step, (smodel, x, y)),
        "hx.value_and_grad": (hookax_step, (model, x, y)),
        "perturb": (perturb_step, (pmodel, perturbations, x, y)),
        "nnx.grad": (grad_step, (model, x, y)),
        "hx.capture": (capture_fwd, (model, x)),
        "no capture": (plain_fwd, (model, x)),
    }


def memory(fn: Any, args: tuple[Any, ...]) -> int:
    m = fn.lower(*args).compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def main() -> dict[str, dict[str, float]]:
    cases = build()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn, args in cases.values():
        jax.block_until_ready(fn(*args))  # compile
    for _ in range(REPS):  # interleaved, so drift hits every case alike
        for name, (fn, args) in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    results = {}
    for name, (fn, args) in cases.items():
        results[name] = {
            "ms": statistics.median(times[name]) * 1e3,
            "MiB": memory(fn, args) / 2**20,
        }
    print(f"16-layer NNX MLP, width {WIDTH}, batch {BATCH}, jitted, median of {REPS}")
    print(f"{'':26}{'time (ms)':>10}{'memory (MiB)':>14}{'time ratio':>12}{'mem ratio':>11}")
    for group, base in (
        (("hx.value_and_grad", "perturb", "nnx.grad"), "perturb"),
        (
            ("scan: hx.value_and_grad", "scan: threaded perturb", "scan: nnx.grad"),
            "scan: threaded perturb",
        ),
        (("hx.capture", "no capture"), "no capture"),
    ):
        for name in group:
            r, b = results[name], results[base]
            print(
                f"{name:26}{r['ms']:10.2f}{r['MiB']:14.1f}"
                f"{r['ms'] / b['ms']:12.2f}{r['MiB'] / b['MiB']:11.2f}"
            )
        print()
    return results


if __name__ == "__main__":
    main()
