"""The metric of a patching experiment's unpatched clean and corrupted runs, computed when first
read.

A grid's program runs only patched forwards; the two unpatched runs' metric is what a picture
is centred on and what normalising divides by. :class:`Unpatched` keeps the arrays of both runs
(the model's, the inputs', the metric's) and runs them, in one compiled program cached like the
grid's, the first time ``clean`` or ``corrupted`` is read (the forward traced when the targets
were found, where it serves: no trace of the model); then it lets go of those arrays. A
grid nobody normalises or draws costs nothing more.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._engine import firstcall

__all__ = ["Unpatched"]


@firstcall.program(static_argnums=(0, 1, 2))
def _runs(rest: Any, clean_rest: Any, metric: Any, dyn: Any, clean_dyn: Any, mdyn: Any) -> Any:
    from . import compiled, cutgrid, targets

    m = compiled.join(mdyn, metric)
    forward = targets.forward(dyn, rest, (), clean_dyn, clean_rest)
    if forward is not None and forward.clean_flat is not None:  # found the targets: no trace
        corrupted, _ = cutgrid.with_deltas(forward, {})
        clean, _ = cutgrid.with_deltas(forward._replace(flat=forward.clean_flat), {})
        return m(clean), m(corrupted)
    (fn, args), (clean_fn, clean_args) = (
        compiled.join(d, r) for d, r in ((dyn, rest), (clean_dyn, clean_rest))
    )
    return m(clean_fn(*clean_args)), m(fn(*args))


def _float(x: Any) -> float | None:
    """A metric's value as a float: None for a traced value or one that is not a scalar."""
    if x is None or isinstance(x, jax.core.Tracer) or jnp.ndim(x) != 0:
        return None
    return float(x)


class Unpatched:
    """The clean and corrupted metric: known floats, or the runs that give them (``runs``:
    ``(rest, clean_rest, metric, dyn, clean_dyn, mdyn)`` as :mod:`.compiled` splits them).
    Runs holding traced arrays (a grid computed inside ``jax.jit``) give None.

    Two are equal when they are the same object or both known with equal values; every one
    hashes alike (a pytree's static data: a grid passed into a jitted function)."""

    def __init__(self, clean: Any = None, corrupted: Any = None, runs: Any = None) -> None:
        self._known = (_float(clean), _float(corrupted))
        traced = runs is not None and any(
            isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(runs[3:])
        )
        self._runs = None if traced else runs

    def get(self) -> tuple[float | None, float | None]:
        """``(clean, corrupted)``, running the unpatched forwards on the first call."""
        if self._runs is not None:
            clean, corrupted = _runs(*self._runs)
            self._known, self._runs = (_float(clean), _float(corrupted)), None
        return self._known

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Unpatched) or self._runs is not None or other._runs is not None:
            return False
        return self._known == other._known

    def __hash__(self) -> int:
        return hash(Unpatched)
