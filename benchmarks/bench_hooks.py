"""Cost of no-op hooks under jit: a 12-layer NNX MLP with forward, pre and backward hooks.

Prints, for the jitted forward and forward+backward, whether the optimized HLO with a no-op
forward pre-hook, forward hook, backward pre-hook and backward hook on every layer is identical
to the one without hooks, and the run-time ratio (medians of interleaved repetitions). With
PyTorch installed, also PyTorch's own ratio for the same shape with full backward hooks.

Run: ``PYTHONPATH=. python benchmarks/bench_hooks.py``
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import hookax as hx

LAYERS, WIDTH, BATCH, REPS, INNER = 12, 512, 256, 11, 10


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(LAYERS)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def _pre(module: Any, args: Any) -> None:
    return None


def _fwd(module: Any, args: Any, out: Any) -> None:
    return None


def _bpre(module: Any, grad_output: Any) -> None:
    return None


def _bwd(module: Any, grad_input: Any, grad_output: Any) -> None:
    return None


def add_noop_hooks(model: nnx.Module) -> list[hx.HookHandle]:
    return [
        hx.register_forward_pre_hook(model, _pre, where=nnx.Linear),
        hx.register_forward_hook(model, _fwd, where=nnx.Linear),
        hx.register_full_backward_pre_hook(model, _bpre, where=nnx.Linear),
        hx.register_full_backward_hook(model, _bwd, where=nnx.Linear),
    ]


def forward(model: MLP, x: jax.Array) -> jax.Array:
    return model(x)


def fwd_bwd(model: MLP, x: jax.Array) -> Any:
    return nnx.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1))(model, x)


def _strip(hlo: str) -> str:
    """HLO text without debug information: op metadata, source-location tables, module name."""
    hlo = hlo.split("\nFileNames", 1)[0]
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    return re.sub(r"^HloModule \S+", "HloModule m", hlo, flags=re.M)


def compiled(fn: Callable[..., Any], model: MLP, x: jax.Array) -> Any:
    graphdef, state = nnx.split(model)

    def pure(state: Any, x: jax.Array) -> Any:
        return fn(nnx.merge(graphdef, state), x)

    return jax.jit(pure).lower(state, x).compile(), state


def _time(run: Callable[[], Any]) -> float:
    t = time.perf_counter()
    for _ in range(INNER):
        out = run()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / INNER


def jax_rows() -> list[tuple[str, bool, bool, float, float]]:
    x = jnp.ones((BATCH, WIDTH), jnp.float32)
    rows = []
    for name, fn in (("forward", forward), ("forward+backward", fwd_bwd)):
        plain_model, hooked_model = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
        handles = add_noop_hooks(hooked_model)
        plain, state = compiled(fn, plain_model, x)
        hooked, hstate = compiled(fn, hooked_model, x)
        same_text = plain.as_text() == hooked.as_text()
        same_ops = _strip(plain.as_text()) == _strip(hooked.as_text())
        t_plain, t_hooked = [], []
        for _ in range(REPS):  # interleaved
            t_plain.append(_time(lambda: plain(state, x)))  # noqa: B023
            t_hooked.append(_time(lambda: hooked(hstate, x)))  # noqa: B023
        for h in handles:
            h.remove()
        rows.append(
            (
                name,
                same_text,
                same_ops,
                statistics.median(t_plain) * 1e3,
                statistics.median(t_hooked) * 1e3,
            )
        )
    return rows


def torch_row() -> tuple[float, float] | None:
    try:
        import torch
    except ImportError:
        return None
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.ones(BATCH, WIDTH, requires_grad=True)

    def step() -> Any:
        model.zero_grad()
        (model(x) ** 2).sum().backward()
        return x.grad

    handles: list[Any] = []

    def add() -> None:
        for m in model:
            if isinstance(m, torch.nn.Linear):
                handles.append(m.register_forward_pre_hook(lambda m, a: None))
                handles.append(m.register_forward_hook(lambda m, a, o: None))
                handles.append(m.register_full_backward_pre_hook(lambda m, g: None))
                handles.append(m.register_full_backward_hook(lambda m, gi, go: None))

    def remove() -> None:
        while handles:
            handles.pop().remove()

    t_plain, t_hooked = [], []
    for _ in range(REPS):
        remove()
        t_plain.append(_time(step))
        add()
        t_hooked.append(_time(step))
    remove()
    return statistics.median(t_plain) * 1e3, statistics.median(t_hooked) * 1e3


def main() -> None:
    print(
        f"{LAYERS}-layer NNX MLP, width {WIDTH}, batch {BATCH}, float32, backend "
        f"{jax.default_backend()}; no-op forward pre, forward, backward pre and backward hooks "
        f"on every layer vs none; medians of {REPS} interleaved repetitions of {INNER} calls."
    )
    header = ["", "HLO identical", "HLO identical w/o debug info", "no hooks", "hooks", "ratio"]
    print(" | ".join(header))
    for name, same, same_ops, t0, t1 in jax_rows():
        print(f"jax.jit {name} | {same} | {same_ops} | {t0:.3f} ms | {t1:.3f} ms | {t1 / t0:.3f}")
    row = torch_row()
    if row is None:
        print("PyTorch: not installed, skipped")
    else:
        t0, t1 = row
        print(f"PyTorch eager forward+backward | - | - | {t0:.3f} ms | {t1:.3f} ms | {t1 / t0:.3f}")


if __name__ == "__main__":
    main()
