"""What importing hookax costs unmodified Linen code: a per-step closure interceptor.

The common Linen pattern: each step makes a fresh dict and an interceptor closing over it, enters
``nn.intercept_methods`` and runs the model, eagerly or through a function jitted once outside the
block. Each configuration runs in its own process (importing hookax cannot be undone), and the
processes run round-robin, so machine noise hits all alike:

* ``no hookax``: Linen alone;
* ``hookax imported``: the default, Linen's interceptors left as Linen has them;
* ``hookax keyed``: after ``hx.key_linen_interceptors()`` (the opt-in; this was the default
  before: every block keyed by its interceptor, so a fresh dict is a new key each step);
* ``hookax at PATH``: only when ``HOOKAX_BEFORE=PATH`` names another checkout (e.g. an older
  version) to compare with.

Also counted: how many steps' dicts are still alive after the steps (kept by JAX's caches).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEPTH, WIDTH, BATCH = 24, 64, 8
ROOT = Path(__file__).resolve().parent.parent


def child(mode: str) -> None:
    """Time the steps in this process and print one JSON line."""
    import warnings
    import weakref

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    if mode != "no hookax":
        import hookax as hx

        warnings.simplefilter("ignore", getattr(hx, "StaleTraceWarning", UserWarning))
        if mode == "hookax keyed":
            hx.key_linen_interceptors()

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(DEPTH):
                x = jax.nn.relu(nn.Dense(WIDTH)(x))
            return x

    class Acts(dict):
        pass

    def collector(acts):
        def record(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            acts.setdefault(context.module.name, out)
            return out

        return record

    model, x = MLP(), jnp.ones((BATCH, WIDTH))
    params = model.init(jax.random.key(0), x)
    forward = jax.jit(model.apply)
    forward(params, x)

    def step(fn):
        acts = Acts()
        with nn.intercept_methods(collector(acts)):
            fn(params, x).block_until_ready()
        return weakref.ref(acts)

    slow = mode in ("hookax keyed",) or mode.startswith("hookax at")
    result = {}
    for name, fn in (("eager", model.apply), ("jit", forward)):
        # Enough steps for a stable median; a keyed step retraces and recompiles (slow).
        n = 4 if slow else (15 if name == "eager" else 300)
        step(fn)  # warm-up
        times, refs = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            refs.append(step(fn))
            times.append(time.perf_counter() - t0)
        result[name] = min(times)  # the least disturbed by other processes on the machine
        result[f"{name} alive"] = f"{sum(r() is not None for r in refs)}/{n}"
    print(json.dumps(result))


def _run(mode: str, path: Path) -> dict:
    """``child(mode)`` in a fresh process whose ``hookax`` is the one under ``path``."""
    env = dict(os.environ, PYTHONPATH=str(path))
    code = f"import runpy; runpy.run_path({__file__!r})['child']({mode!r})"
    with tempfile.TemporaryDirectory() as cwd:  # not a checkout: `-c` puts the cwd first
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd
        )
    if out.returncode:
        raise RuntimeError(f"{mode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(rounds: int = 5) -> dict:
    from ._timing import table

    modes = {"no hookax": ROOT, "hookax imported": ROOT, "hookax keyed": ROOT}
    before = os.environ.get("HOOKAX_BEFORE")
    if before:
        modes[f"hookax at {before}"] = Path(before)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, path in modes.items():
            runs[mode].append(_run(mode, path))
    med = {
        m: {k: statistics.median(r[k] for r in rs) for k in ("eager", "jit")}
        for m, rs in runs.items()
    }
    base = med["no hookax"]
    rows = [
        (
            m,
            f"{med[m]['eager'] * 1e3:.2f}",
            f"{med[m]['eager'] / base['eager']:.2f}",
            runs[m][-1]["eager alive"],
            f"{med[m]['jit'] * 1e3:.2f}",
            f"{med[m]['jit'] / base['jit']:.2f}",
            runs[m][-1]["jit alive"],
        )
        for m in modes
    ]
    print(
        f"Linen {DEPTH}-layer MLP (width {WIDTH}, batch {BATCH}), a fresh dict + interceptor "
        f"per step; ms/step, median of {rounds} processes (each the fastest of its steps)"
    )
    header = ("configuration", "eager", "ratio", "dicts alive", "jit", "ratio", "dicts alive")
    print(table(rows, header))
    return med


if __name__ == "__main__":
    main()
