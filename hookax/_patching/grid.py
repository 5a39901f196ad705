"""``hx.patch_grid``: a patching experiment over targets x positions as batched compiled programs.

The clean run's values at the targets are captured once (``hx.capture``, jitted). The grid is
one compiled program per chunk shape: for each target, ``jax.vmap`` over a chunk of positions of
the corrupted forward inside an ``hx.patching`` block, the targets one after another (an
optimization barrier orders them, so one target's temporaries are live at a time). The vmapped
forward depends on the batched position only from the patched call site on, so everything
before it is computed once per chunk, not once per patch: the program a careful hand-written
grid would be. One program rather than one per target: XLA's fixed cost per compile is paid
once (a 12-layer grid compiled 3x faster). Programs are cached across calls (see
:mod:`.compiled`); ``chunk_size`` bounds how many patches per target one call runs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._capture.capture import capture
from .._util.errors import HookaxError
from . import compiled, targets
from .patch import PatchError, patching

__all__ = ["Plan", "patch_grid"]

WHO = "hx.patch_grid"


@dataclasses.dataclass(frozen=True)
class _GridSpec:
    rest: compiled.Static  # (fn, corrupt args) without their arrays
    metric: Any  # a static_key of the metric
    keys: tuple[str, ...]
    axis: int


@functools.partial(jax.jit, static_argnums=(0, 1))
def _clean(rest: compiled.Static, keys: tuple[str, ...], dyn: list[Any]) -> dict[str, Any]:
    fn, args = compiled.join(dyn, rest)
    _, acts = capture(fn, where=targets.selector(list(keys)))(*args)
    return acts


@functools.partial(jax.jit, static_argnums=0)
def _grid(spec: _GridSpec, dyn: list[Any], values: dict[str, Any], cols: Any) -> Any:
    """Every target's row for the patches ``cols``: one program, one vmap per target."""
    metric = compiled.value_of(spec.metric)

    def one(key: str, dyn: list[Any], col: Any, values: dict[str, Any]) -> Any:
        fn, args = compiled.join(dyn, spec.rest)  # rebuilt inside the vmap (NNX transforms)
        with patching({key: values[key]}, positions=col, axis=spec.axis):
            return metric(fn(*args))

    rows: list[Any] = []
    for key in spec.keys:
        if rows:  # one row after the other: a chunk's temporaries, not n_targets', are live
            dyn, values, cols, _ = jax.lax.optimization_barrier((dyn, values, cols, rows[-1]))
        if cols is None:
            rows.append(one(key, dyn, None, values))
        else:
            row = jax.vmap(functools.partial(one, key), in_axes=(None, 0, None))
            rows.append(row(dyn, cols, values))
    return jnp.stack(rows)


def _as_args(args: Any, name: str) -> tuple[Any, ...]:
    if not isinstance(args, tuple):
        raise HookaxError(
            f"{WHO}: {name} is the tuple of fn's positional arguments, got "
            f"{type(args).__name__}. Fix: {name}=(tokens,) for fn(tokens)."
        )
    return args


class Plan:
    """What a grid (or its attribution) needs: targets, their clean values, the columns."""

    def __init__(
        self,
        who: str,
        fn: Callable[..., Any],
        clean_args: Any,
        corrupt_args: Any,
        metric: Callable[[Any], Any],
        where: Any,
        positions: Any,
        axis: int,
    ) -> None:
        for name, f in (("fn", fn), ("metric", metric)):
            if not callable(f):
                raise HookaxError(f"{who}: {name} must be callable, got {f!r}.")
        clean_args, corrupt_args = (
            _as_args(clean_args, "clean_args"),
            _as_args(corrupt_args, "corrupt_args"),
        )
        found = targets.discover(fn, corrupt_args)
        self.keys = targets.expand(targets.parse(where, who), found, who)
        self.shapes = {k: targets.out_spec(k, found, who) for k in self.keys}
        self.axis = axis
        self.cols = targets.columns(positions, axis, self.shapes, who)
        clean_dyn, clean_rest = compiled.split((fn, clean_args))
        self.acts = _clean(clean_rest, tuple(self.keys), clean_dyn)
        self.dyn, self.rest = compiled.split((fn, corrupt_args))
        self.metric = compiled.static_key(metric)

    def spec(self) -> _GridSpec:
        return _GridSpec(self.rest, self.metric, tuple(self.keys), self.axis)

    def chunks(self, chunk_size: int | None) -> list[tuple[Any, int]]:
        """The columns cut into chunks of one size (the last padded): ``(chunk, used)``."""
        if self.cols is None:
            return [(None, 1)]
        n = self.cols.shape[0]
        c = n if chunk_size is None else min(chunk_size, n)
        out = []
        for start in range(0, n, c):
            chunk = self.cols[start : start + c]
            used = chunk.shape[0]
            if used < c:
                pad = jnp.repeat(chunk[-1:], c - used, axis=0)
                chunk = jnp.concatenate([chunk, pad])
            out.append((chunk, used))
        return out

    def grid(self, chunk_size: int | None) -> Any:
        values = {k: self.acts[k] for k in self.keys}
        if self.cols is None:
            return _grid(self.spec(), self.dyn, values, None)
        parts = [
            _grid(self.spec(), self.dyn, values, chunk)[:, :used]
            for chunk, used in self.chunks(chunk_size)
        ]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)

    def compiled(self, chunk_size: int | None) -> Any:
        """The compiled program of one chunk (for its memory analysis)."""
        chunk, _ = self.chunks(chunk_size)[0]
        values = {k: self.acts[k] for k in self.keys}
        return _grid.lower(self.spec(), self.dyn, values, chunk).compile()


def patch_grid(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    metric: Callable[[Any], Any],
    *,
    where: Any,
    positions: Any = "each",
    axis: int = 1,
    chunk_size: int | None = None,
) -> jax.Array:
    """The metric of the corrupted run with each target patched from the clean run, as a grid.

    For each target call site (a row) and each patch (a column), the corrupted run
    ``fn(*corrupt_args)`` runs with that call site's output replaced, at that patch's positions,
    by its value in the clean run ``fn(*clean_args)``, and ``metric`` of its output is the
    entry. Every call of a target is patched (a scanned stack's call site: every layer).

    The clean values are captured once; the grid is one compiled program: for each target in
    turn, ``jax.vmap`` over patches of the patched forward (what comes before the target is
    computed once per chunk), at most ``chunk_size`` patches per target per program call
    (memory grows linearly with it; ``benchmarks/bench_patching.py`` reports it). Programs are
    reused by later calls with the same structure, shapes, ``fn`` and ``metric`` (functions
    compared by code and closure, as [`hx.intercept`][hookax.intercept] compares them); pass
    the model as ``fn``, or among the arguments, rather than closed over.

    Args:
      fn: a module or a function of arrays (e.g. Linen's ``model.apply``).
      clean_args: ``fn``'s positional arguments for the clean run, a tuple.
      corrupt_args: the same for the corrupted run.
      metric: ``fn``'s output -> an array (a scalar: a logit difference, a log-probability).
      where: the targets: a call-site key, a path glob (``"layers/*"``: every match, in call
        order) or a list of them; ``"path:method"`` for a method other than ``__call__``.
      positions: ``"each"``: one column per index along ``axis``; ``None``: one patch of the
        whole output (no column axis); or an array whose leading axis lists the patches, each an
        index, indices or a boolean mask as [`hx.patching`][hookax.patching] takes them.
      axis: the position axis of the targets' outputs.
      chunk_size: the most patches per target one program call runs; default a whole row.

    Returns:
      ``[n_targets, n_columns, *metric's shape]`` (``[n_targets, *metric's shape]`` for
      ``positions=None``), targets in the order of ``where``.

    Raises:
      SelectorError: a ``where=`` entry matched no call site (the message lists those that ran).
      PatchError: a target whose output is not an array, or positions that do not fit it.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.tanh)
      >>> clean, corrupt = jnp.ones((1, 3, 2)), jnp.zeros((1, 3, 2))
      >>> grid = hx.patch_grid(model, (clean,), (corrupt,), lambda y: y[0, -1, 0], where="layers/0")
      >>> grid.shape
      (1, 3)
      >>> bool(grid[0, 2] == model(clean)[0, -1, 0]), bool(grid[0, 0] == model(corrupt)[0, -1, 0])
      (True, True)
    """
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise PatchError(f"{WHO}: chunk_size= takes a positive int or None, got {chunk_size!r}.")
    plan = Plan(WHO, fn, clean_args, corrupt_args, metric, where, positions, axis)
    return plan.grid(chunk_size)
