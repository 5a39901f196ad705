"""``hx.path_patch``: a sender's effect on the metric only through chosen receivers.

Path patching (Wang et al. 2022; Goldowsky-Dill et al. 2023) from the clean run: the receivers
read the sender's corrupted value in place of its clean one, every other path keeps its clean
value, and everything after the receivers is recomputed. In the residual graph that is the
clean run with the edges from the sender to the receivers corrupted, which
:mod:`hookax._circuits.circuit`'s rewiring runs; a grid of senders x receivers is one compiled
program, the patched runs mapped over their keep matrices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import firstcall
from .._interp.components import Components
from .._patching import compiled
from .._patching.labelled import LabelledArray, Unpatched
from .._util.errors import HookaxError
from ..frameworks._functions import as_program
from .graph import Rewire, Spec, check, discover, rewired

__all__ = ["path_patch"]

WHO = "hx.path_patch"


@firstcall.program(static_argnums=0)
def _grid(spec: Spec, dyn: list[Any], keeps: Any) -> Any:
    fn, _, corrupt_args, _ = compiled.join(dyn, spec.rest)
    _, corrupt = rewired(fn, spec.parts, Rewire(spec.graph), WHO)(*corrupt_args)

    def one(keep: Any) -> Any:
        # joined here: an NNX model's transforms (nnx.scan) take modules made in their trace
        fn, clean_args, _, metric = compiled.join(dyn, spec.rest)
        rw = Rewire(spec.graph, corrupt=corrupt.values, keep=keep)
        y, _ = rewired(fn, spec.parts, rw, WHO)(*clean_args)
        return jnp.asarray(metric(y), jnp.float32)

    return jax.lax.map(one, keeps)


def _labels(given: Any, known: Sequence[str], what: str) -> list[tuple[str, ...]]:
    """Each entry of ``senders=``/``receivers=`` as a tuple of labels (a group)."""
    items = [given] if isinstance(given, str) else list(given)
    out = []
    for item in items:
        group = (item,) if isinstance(item, str) else tuple(item)
        unknown = [g for g in group if g not in known]
        if not group or unknown:
            raise HookaxError(
                f"{WHO}: {what}= names {unknown or item!r}, not among this model's "
                f"{what}: {', '.join(known)}."
            )
        out.append(group)
    return out


def path_patch(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    metric: Callable[[Any], Any],
    components: Components,
    *,
    senders: Any,
    receivers: Any,
) -> LabelledArray:
    """The metric with each sender's value corrupted only on its way into chosen receivers:
    a ``[sender, receiver]`` grid.

    Path patching from the clean run (Wang et al. 2022): entry ``[i, j]`` is the metric of the
    clean run in which the receivers of ``receivers[j]`` read ``senders[i]``'s corrupted
    value in place of its clean one (the edge is corrupted; every other path keeps its clean
    value, and everything after the receivers is recomputed). Its difference from the clean
    metric is the sender's effect through those receivers alone. Labels are those of
    [`hx.edge_attribution`][hookax.edge_attribution]'s graph; a group of labels (a tuple)
    patches them together (``("L1H0.q", "L1H0.k", "L1H0.v")``: every input of a head). An
    entry with no edge from the sender into the group is ``nan``. One compiled program for the
    whole grid.

    The other convention, from the corrupted run (every other path keeps its corrupted value,
    the receivers read the sender's clean value), is the same call with the runs swapped:
    ``hx.path_patch(fn, corrupt_args, clean_args, ...)``.

    Args:
      fn: the model or function, ``fn(*clean_args)``.
      clean_args: the clean run's arguments.
      corrupt_args: the corrupted run's arguments, the same shapes.
      metric: ``fn``'s output -> a scalar.
      components: the model's parts, as for [`hx.edge_attribution`][hookax.edge_attribution].
      senders: sender labels (``"L0H3"``, ``"embed"``).
      receivers: receiver labels (``"L1H2.k"``, ``"logits"``) or groups of them.

    Returns:
      A float32 [`hx.LabelledArray`][hookax.LabelledArray] ``[len(senders), len(receivers)]``
      (an array, its rows named by the senders and its columns by the receivers, a group's
      labels joined by ``+``; its ``clean`` and ``corrupted`` the metric of the unpatched
      runs); [`plot`][hookax.LabelledArray.plot] draws it.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> from hookax.examples import induction
      >>> cfg = induction.Config(vocab=8, d_model=8, n_heads=2, half=3)
      >>> model = induction.AttnOnly(cfg, rngs=nnx.Rngs(0))
      >>> clean, corrupt = jnp.array([[1, 2, 3, 1, 2, 3]]), jnp.array([[1, 2, 3, 4, 5, 6]])
      >>> grid = hx.path_patch(model, (clean,), (corrupt,), lambda y: y[0, -1, 1],
      ...                      induction.components(), senders=["L0H0", "L0H1"],
      ...                      receivers=["L1H0.k", "L1H1.k", ("L1H0.q", "L1H1.q"), "L0H0.q"])
      >>> grid.shape, bool(jnp.isnan(grid[:, 3]).all())
      ((2, 4), True)
      >>> grid.rows, grid.columns
      (('L0H0', 'L0H1'), ('L1H0.k', 'L1H1.k', 'L1H0.q+L1H1.q', 'L0H0.q'))
    """
    parts = check(components, WHO)
    fn = as_program(fn)
    graph = discover(fn, tuple(clean_args), parts, WHO)
    rows = _labels(senders, graph.senders, "senders")
    cols = _labels(receivers, graph.receivers, "receivers")
    if any(len(g) != 1 for g in rows):
        raise HookaxError(f"{WHO}: senders= takes labels, one sender each; got {senders!r}.")
    allowed = graph.allowed()
    keeps = np.ones((len(rows), len(cols), *allowed.shape), np.float32)
    empty = np.zeros((len(rows), len(cols)), bool)
    for a, (s,) in enumerate(rows):
        i = graph.senders.index(s)
        for b, group in enumerate(cols):
            js = [graph.receivers.index(r) for r in group if allowed[i, graph.receivers.index(r)]]
            keeps[a, b, i, js] = 0
            empty[a, b] = not js

    def run() -> Any:
        dyn, rest = compiled.split((fn, tuple(clean_args), tuple(corrupt_args), metric))
        flat = jnp.asarray(keeps.reshape(-1, *allowed.shape))
        return _grid(Spec(rest, parts, graph), dyn, flat)

    grid = compiled.retrying(WHO, (fn, metric), run).reshape(len(rows), len(cols))
    values = jnp.where(jnp.asarray(empty), jnp.nan, grid)
    dyn, rest = compiled.split((fn, tuple(corrupt_args)))
    clean_dyn, clean_rest = compiled.split((fn, tuple(clean_args)))
    mdyn, mrest = compiled.split(metric, ints=True)
    return LabelledArray(
        values,
        ("sender", "receiver"),
        ([s for (s,) in rows], ["+".join(g) for g in cols]),
        unpatched=Unpatched(runs=(rest, clean_rest, mrest, dyn, clean_dyn, mdyn)),
        title="path-patched metric",
    )
