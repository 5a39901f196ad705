"""Harvest throughput: rows per second of the forward pass alone vs ``hx.harvest``, side by side.

An NNX MLP (``DEPTH`` layers of width ``WIDTH``, batches of ``BATCH`` rows); harvest stores every
layer's output (float32) to a fresh store in a temporary folder. Four runs over the same batches:

* ``forward``: ``nnx.jit`` of the model, every batch dispatched, the last one waited for;
* ``capture + host copy``: the same with ``hx.capture`` of every layer and the values copied to
  the host (what harvest computes and moves, without the disk);
* ``harvest, overlap off``: each batch written before the next is computed (``overlap=False``);
* ``harvest, overlap on``: the writer thread writes while the next batches compute.

Each run is repeated ``ROUNDS`` times, interleaved; medians of wall time (rows/s) and of the
process's CPU time (user + system, all threads). The goal: harvest with overlap at 90%
or more of forward-only throughput (writing hidden behind compute). Compilation is excluded (one
warm-up batch set per configuration first).

Run: ``python -m benchmarks harvest`` (``HARVEST_DIR=/path`` to write somewhere else than /tmp).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

import hookax as hx
from benchmarks._timing import table

DEPTH, WIDTH, BATCH, BATCHES, ROUNDS = 8, 1024, 512, 16, 5


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


def _forward(model: Any, batches: list[Any]) -> float:
    step = _forward.step  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    y = None
    for x in batches:
        y = step(model, x)
    jax.block_until_ready(y)
    return time.perf_counter() - t0


def _capture(model: Any, batches: list[Any]) -> float:
    step = _capture.step  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for x in batches:
        _, acts = step(model, x)
        for (v,) in acts.values():
            v.copy_to_host_async()
        for (v,) in acts.values():
            np.asarray(v)
    return time.perf_counter() - t0


def _harvest(model: Any, batches: list[Any], store: str, overlap: bool) -> tuple[float, int]:
    t0 = time.perf_counter()
    h = hx.harvest(model, batches, where=Layer, store=store, overlap=overlap, progress=False)
    return time.perf_counter() - t0, h.bytes


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    model = MLP(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batches = [
        jax.device_put(rng.normal(size=(BATCH, WIDTH)).astype(np.float32)) for _ in range(BATCHES)
    ]
    _forward.step = nnx.jit(lambda m, x: m(x))  # type: ignore[attr-defined]
    capture = nnx.jit(lambda m, x: hx.capture(m, where=Layer)(x))
    _capture.step = capture  # type: ignore[attr-defined]
    root = tempfile.mkdtemp(prefix="hookax-bench-", dir=os.environ.get("HARVEST_DIR"))
    names = ("forward", "capture + host copy", "harvest, overlap off", "harvest, overlap on")
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    written = 0
    try:
        for r in range(ROUNDS + 1):  # round 0 warms up (compiles); not counted
            for n in names:
                overlap = n.endswith("on")
                store = os.path.join(root, f"acts-{overlap}")
                shutil.rmtree(store, ignore_errors=True)  # not timed
                c0 = _cpu()
                if n == "forward":
                    seconds = _forward(model, batches)
                elif n.startswith("capture"):
                    seconds = _capture(model, batches)
                else:
                    seconds, written = _harvest(model, batches, store, overlap)
                if r:
                    times[n].append(seconds)
                    cpu[n].append(_cpu() - c0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = BATCH * BATCHES
    base = statistics.median(times["forward"])
    out = []
    for n in names:
        s = statistics.median(times[n])
        mbs = f"{written / 1e6 / s:.0f}" if n.startswith("harvest") else ""
        c = f"{statistics.median(cpu[n]):.2f}"
        out.append((n, f"{rows / s:,.0f}", mbs, c, f"{base / s:.2f}"))
    print(
        f"{DEPTH}-layer MLP, width {WIDTH}, {BATCHES} batches of {BATCH} rows; every layer's "
        f"output stored as float32 ({written / 1e6:.0f} MB per run); {jax.devices()[0].platform}"
    )
    print(table(out, ("run", "rows/s", "MB/s written", "CPU s", "vs forward")))


if __name__ == "__main__":
    main()
