"""The SAE path: reading a store for training, and harvesting one layer.

Three measurements, side by side in one run:

* **Reading** a store of ``ROWS`` rows of ``D`` bfloat16 features (written by ``hx.harvest``):
  the *plain read* (TensorStore reads of whole chunks in order into numpy, docs/harvest.md's
  recipe) against ``hx.StoreReader`` (window shuffle, device arrays of ``BATCH`` rows), rows per
  second over one epoch. *Cold*: every chunk file's pages evicted from the page cache first
  (``posix_fadvise(DONTNEED)`` on each file; it needs no root, and the store's files are clean:
  harvest writes them with ``O_DIRECT``), so the bytes come from the disk (on this VM, a virtual
  disk whose host may still cache them). *Warm*: read again, from the page cache. Target: the
  reader at >= 0.6x the plain read on a 2-core CPU, >= 0.9x on a GPU host.
* **Training** a sparse autoencoder (``D`` -> ``D_SAE``, ReLU, L1) with optax: ms per step
  on batches already on the device (cycled), against the same steps fed by the reader. The
  step takes longer than reading its batch; target: with the reader >= 0.95x the in-memory
  throughput (``step_in_memory_ms / step_with_reader_ms``).
* **Harvest of one layer**: ``hx.harvest`` of ``layers/2`` of a 12-layer unrolled MLP against
  the jitted full forward over the same batches (XLA drops the layers after 2; expected well
  under 1, target <= 0.6).

Run: ``python -m benchmarks sae [--json PATH]`` (``SAE_DIR=/path`` to write the store elsewhere
than /tmp).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hookax as hx
from benchmarks._timing import table

D, ROWS, HARVEST_BATCH = 768, 3 * 131072, 4096
BATCH, D_SAE, STEPS, ROUNDS = 1024, 1024, 48, 3
LAYERS, WIDTH, LAYER_BATCH, LAYER_BATCHES = 12, 512, 512, 16


class Identity(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return x


class _Source(nnx.Module):
    """Random bfloat16 rows, made on the device from each batch's key."""

    def __init__(self) -> None:
        self.out = Identity()

    def __call__(self, key: jax.Array) -> jax.Array:
        return self.out(jax.random.normal(key, (HARVEST_BATCH, D), jnp.bfloat16))


def make_store(path: Path) -> Any:
    keys = [jax.random.key(i) for i in range(ROWS // HARVEST_BATCH)]
    hx.harvest(_Source(), keys, where="out", store=path, progress=False)
    return hx.open_store(path)


def evict(path: Path) -> None:
    """Drop the store's file pages from the page cache (clean pages: no root needed)."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plain_read(store: Any) -> float:
    arr, chunk = store.array("out"), store.chunk_rows("out")
    t0 = time.perf_counter()
    n = 0
    for lo in range(0, store.rows, chunk):
        n += arr[lo : min(lo + chunk, store.rows)].read().result().shape[0]
    return n / (time.perf_counter() - t0)


def reader_read(reader: Any) -> float:
    """Rows/s of one epoch of ``reader``, restarted at its position (no window read ahead)."""
    reader.set_state(reader.get_state())
    t0 = time.perf_counter()
    n, last = 0, None
    for _, batch in zip(range(reader.steps_per_epoch), reader, strict=False):
        n += batch.shape[0]
        last = batch
    jax.block_until_ready(last)
    return n / (time.perf_counter() - t0)


# ---- a sparse autoencoder's training step ----


def sae_init(key: jax.Array) -> dict[str, jax.Array]:
    w = jax.random.normal(key, (D, D_SAE), jnp.float32) / np.sqrt(D)
    return {"enc": w, "b": jnp.zeros(D_SAE), "dec": w.T, "b_dec": jnp.zeros(D)}


def sae_loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    f = jax.nn.relu((x - p["b_dec"]) @ p["enc"] + p["b"])
    recon = f @ p["dec"] + p["b_dec"]
    return ((recon - x) ** 2).sum(-1).mean() + 1e-3 * jnp.abs(f).sum(-1).mean()


def make_step() -> Any:
    import optax

    opt = optax.adam(1e-3)

    @jax.jit
    def step(state: Any, x: jax.Array) -> Any:
        p, o = state
        loss, g = jax.value_and_grad(sae_loss)(p, x)
        upd, o = opt.update(g, o, p)
        return (optax.apply_updates(p, upd), o), loss

    p = sae_init(jax.random.key(0))
    return step, (p, opt.init(p))


def train(step: Any, state: Any, batches: Any) -> float:
    """ms per step over ``STEPS`` steps of ``batches``."""
    t0 = time.perf_counter()
    loss = None
    for _, x in zip(range(STEPS), batches, strict=False):
        state, loss = step(state, x)
    jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / STEPS * 1e3


# ---- harvest of one layer of an unrolled stack ----


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(self.lin(x))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([Layer(rngs) for _ in range(LAYERS)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


class ScannedMLP(nnx.Module):
    """The same layers stacked and run with ``nnx.scan``: ``"layers[2]"`` is the third's output."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Layer:
            return Layer(rngs)

        self.layers = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        def step(x: jax.Array, layer: Layer) -> jax.Array:
            return layer(x)

        return nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.layers)


def layer_vs_forward(root: Path, model: nnx.Module, where: str) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    xs = [
        jnp.asarray(rng.normal(size=(LAYER_BATCH, WIDTH)), jnp.float32)
        for _ in range(LAYER_BATCHES)
    ]
    fwd = nnx.jit(lambda m, x: m(x))

    def forward() -> float:
        t0 = time.perf_counter()
        y = None
        for x in xs:
            y = fwd(model, x)
        jax.block_until_ready(y)
        return time.perf_counter() - t0

    def harvest(i: int) -> float:
        t0 = time.perf_counter()
        hx.harvest(
            model, xs, where=where, store=root / f"{type(model).__name__}{i}", progress=False
        )
        return time.perf_counter() - t0

    forward(), harvest(0)  # compile
    f, h = [], []
    for r in range(1, ROUNDS + 2):
        f.append(forward())
        h.append(harvest(r))
    return statistics.median(h), statistics.median(f)


def main() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="hookax-bench-sae-", dir=os.environ.get("SAE_DIR")))
    try:
        return _main(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _main(root: Path) -> dict[str, Any]:
    store = make_store(root / "store")
    mb = store.rows * D * 2 / 1e6
    print(
        f"store: {store.rows:,} rows of {D} bfloat16 ({mb:.0f} MB), chunks of "
        f"{store.chunk_rows('out'):,} rows; reader batches of {BATCH}, window "
        f"{hx.StoreReader(store, 'out', BATCH).window_rows:,} rows"
    )
    plain: dict[str, list[float]] = {"cold": [], "warm": []}
    reader: dict[str, list[float]] = {"cold": [], "warm": []}
    endless = hx.StoreReader(store, "out", BATCH, seed=0)
    reader_read(endless)  # warm-up: its window buffers (fresh memory is slow on a VM), threads
    for _ in range(ROUNDS):
        for name, fn, arg in (("plain", plain_read, store), ("reader", reader_read, endless)):
            out = plain if name == "plain" else reader
            evict(root / "store")
            out["cold"].append(fn(arg))
            out["warm"].append(fn(arg))
    endless.close()
    med = {
        k: {c: statistics.median(v[c]) for c in v}
        for k, v in (("plain", plain), ("reader", reader))
    }
    rows = [
        (
            c,
            f"{med['plain'][c] / 1e6:.2f} M",
            f"{med['reader'][c] / 1e6:.2f} M",
            f"{med['reader'][c] / med['plain'][c]:.2f}x",
        )
        for c in ("cold", "warm")
    ]
    print(table(rows, ("cache", "plain read rows/s", "reader rows/s", "reader / plain")))

    step, state = make_step()
    rng = np.random.default_rng(1)
    in_memory = [jnp.asarray(rng.normal(size=(BATCH, D)), jnp.bfloat16) for _ in range(8)]

    def cycled() -> Any:
        while True:
            yield from in_memory

    train(step, state, cycled())  # compile
    endless_train = hx.StoreReader(store, "out", BATCH, seed=1)
    train(step, state, endless_train)  # its window buffers
    mem, fed = [], []
    for _ in range(ROUNDS):
        mem.append(train(step, state, cycled()))
        fed.append(train(step, state, endless_train))
    endless_train.close()
    step_mem, step_fed = statistics.median(mem), statistics.median(fed)
    read_ms = BATCH / med["reader"]["warm"] * 1e3
    print(
        f"\nSAE step ({D} -> {D_SAE}, batch {BATCH}, adam): {step_mem:.1f} ms on rows in "
        f"memory, {step_fed:.1f} ms fed by the reader ({step_mem / step_fed:.2f}x "
        f"throughput); reading a batch alone: {read_ms:.2f} ms"
    )

    layer_s, forward_s = layer_vs_forward(root, MLP(nnx.Rngs(0)), "layers/2")
    scan_s, scan_forward_s = layer_vs_forward(root, ScannedMLP(nnx.Rngs(0)), "layers[2]")
    print(f"\nharvest of layer 2 of {LAYERS} ({LAYER_BATCHES} batches of {LAYER_BATCH}x{WIDTH}):")
    print(
        table(
            [
                (
                    "unrolled (layers/2)",
                    f"{layer_s:.3f}",
                    f"{forward_s:.3f}",
                    f"{layer_s / forward_s:.2f}x",
                ),
                (
                    "nnx.scan (layers[2])",
                    f"{scan_s:.3f}",
                    f"{scan_forward_s:.3f}",
                    f"{scan_s / scan_forward_s:.2f}x",
                ),
            ],
            ("stack", "harvest s", "full forward s", "harvest / forward"),
        )
    )
    return {
        "plain_read_rows_s": med["plain"],
        "reader_rows_s": med["reader"],
        "step_in_memory_ms": step_mem,
        "step_with_reader_ms": step_fed,
        "harvest_layer_s": layer_s,
        "full_forward_s": forward_s,
        "harvest_layer_scan_s": scan_s,
        "full_forward_scan_s": scan_forward_s,
    }


if __name__ == "__main__":
    main()
