"""Interleaved timing: every configuration runs in each round, so machine noise hits all alike."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable


def interleaved(
    configs: dict[str, Callable[[], object]],
    *,
    rounds: int,
    inner: dict[str, int] | int,
    around: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
    stat: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
    """Median seconds per call of each config, measured round-robin over ``rounds`` rounds.

    ``around[name]()`` gives a context entered around each of that config's rounds (set-up that
    must not be timed per call). ``stat=min`` gives the fastest round instead of the median
    (steadier on a shared machine, where other work only ever adds time).
    """
    around = around or {}
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for name, fn in configs.items():  # warm up: compile and fill every cache first
        with around.get(name, contextlib.nullcontext)():
            fn()
    for _ in range(rounds):
        for name, fn in configs.items():
            n = inner if isinstance(inner, int) else inner[name]
            with around.get(name, contextlib.nullcontext)():
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                samples[name].append((time.perf_counter() - t0) / n)
    return {name: stat(s) for name, s in samples.items()}


def best_of(fn: Callable[[], object], n: int) -> float:
    """Seconds of the fastest of ``n`` calls of ``fn``, after one call left out (warm-up)."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])


def compiled_programs() -> None:
    """Wait for the compiles hookax runs in the background (programs whose first call ran with
    NumPy), so the calls timed next run the compiled programs."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "hookax-compile":
            thread.join()  # it starts once hookax has been idle for firstcall.IDLE_S
    from hookax._engine import firstcall

    firstcall.OPS.join()  # eager programs run with NumPy first


def child_json(module: str, *args: str) -> dict[str, float]:
    """Run ``python -m benchmarks.<module> *args`` in a fresh process; its last line of output,
    read as JSON."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", f"benchmarks.{module}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
