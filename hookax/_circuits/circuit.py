"""``hx.run_circuit`` and ``hx.faithfulness``: the model with only a circuit's edges clean.

One compiled program runs the corrupted forward (the senders' corrupted values), then the clean
input with every receiver reading, for each edge not in the circuit, the sender's corrupted
value in place of its value in this run (as auto-circuit patches edges). The keep matrix
(``[sender, receiver]``) is an argument: every circuit of a model shares the program.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._engine import firstcall
from .._interp.components import Components
from .._patching import compiled
from .._util.errors import HookaxError
from ..frameworks._functions import as_program
from .edges import Edges
from .graph import Graph, Rewire, Spec, check, discover, rewired

__all__ = ["faithfulness", "prune_edges", "run_circuit"]

WHO = "hx.run_circuit"


@firstcall.program(static_argnums=0)
def _run(spec: Spec, dyn: list[Any], keep: Any) -> Any:
    fn, clean_args, corrupt_args = compiled.join(dyn, spec.rest)
    _, corrupt = rewired(fn, spec.parts, Rewire(spec.graph), WHO)(*corrupt_args)
    rw = Rewire(spec.graph, corrupt=corrupt.values, keep=keep)
    return rewired(fn, spec.parts, rw, WHO)(*clean_args)[0]


def _keep(graph: Graph, edges: Iterable[tuple[str, str]]) -> np.ndarray:
    """The ``[sender, receiver]`` matrix: 1 for each edge given."""
    keep = np.zeros((len(graph.senders), len(graph.receivers)), np.float32)
    allowed = graph.allowed()
    s_index = {s: i for i, s in enumerate(graph.senders)}
    r_index = {r: j for j, r in enumerate(graph.receivers)}
    for edge in edges:
        if not (isinstance(edge, tuple) and len(edge) == 2):
            raise HookaxError(
                f"{WHO}: edges= takes an hx.Edges or (source, destination) pairs, got "
                f"{edge!r} among them."
            )
        s, r = edge
        i, j = s_index.get(s), r_index.get(r)
        if i is None or j is None or not allowed[i, j]:
            raise HookaxError(
                f"{WHO}: {s} -> {r} is no edge of this model's graph; its senders are "
                f"{', '.join(graph.senders)}; its receivers {', '.join(graph.receivers)} "
                f"(each reads the senders written before it)."
            )
        keep[i, j] = 1
    return keep


def _parts(edges: Any, components: Components | None) -> Components:
    parts = components or getattr(edges, "components", None)
    if parts is None:
        raise HookaxError(
            f"{WHO}: give components=hx.Components(...) for edges that are not an hx.Edges "
            "(an hx.Edges carries the components it was found with)."
        )
    return check(parts, WHO)


def run_circuit(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    edges: Edges | Iterable[tuple[str, str]],
    components: Components | None = None,
) -> Any:
    """``fn``'s output on the clean input with only ``edges`` clean: every other edge of the
    residual graph (see [`hx.edge_attribution`][hookax.edge_attribution]) corrupted.

    Each receiver reads its input in this run plus, for each sender whose edge to it is not in
    the circuit, ``sender_corrupt - sender_here``: the sender's value in the corrupted run in
    place of its value in this run. Every edge given: the clean output (the corrections are
    multiplied by 0; equal to ``jax.jit(fn)``'s output, and to eager ``fn``'s up to float
    rounding); none: the corrupted output (up to rounding). One compiled program for every
    circuit of the same model and shapes.

    Args:
      fn: the model or function.
      clean_args: the clean run's arguments.
      corrupt_args: the corrupted run's arguments, the same shapes.
      edges: the circuit: an [`hx.Edges`][hookax.Edges] (``edges.top(k)``) or
        ``(source, destination)`` pairs as its labels name them.
      components: the model's parts; default the ones the ``hx.Edges`` carries.

    Returns:
      ``fn``'s output with only the circuit clean.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> from hookax.examples import induction
      >>> cfg = induction.Config(vocab=8, d_model=8, n_heads=2, half=3)
      >>> model = induction.AttnOnly(cfg, rngs=nnx.Rngs(0))
      >>> clean, corrupt = jnp.array([[1, 2, 3, 1, 2, 3]]), jnp.array([[1, 2, 3, 4, 5, 6]])
      >>> parts = induction.components()
      >>> y = hx.run_circuit(model, (clean,), (corrupt,), [], parts)  # no edge clean
      >>> bool(jnp.allclose(y, model(corrupt), atol=1e-5))
      True
    """
    parts = _parts(edges, components)
    fn = as_program(fn)
    graph = discover(fn, tuple(clean_args), parts, WHO)
    keep = jnp.asarray(_keep(graph, list(edges)))

    def run() -> Any:
        dyn, rest = compiled.split((fn, tuple(clean_args), tuple(corrupt_args)))
        return _run(Spec(rest, parts, graph), dyn, keep)

    return compiled.retrying(WHO, (fn,), run)


def faithfulness(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    metric: Callable[[Any], Any],
    edges: Edges | Iterable[tuple[str, str]],
    components: Components | None = None,
) -> float:
    """How much of the clean metric a circuit recovers, from the corrupted baseline:
    ``(metric(circuit) - metric(corrupt)) / (metric(clean) - metric(corrupt))``.

    ``metric(circuit)`` is the metric of [`hx.run_circuit`][hookax.run_circuit]'s output: 1
    for every edge, 0 for none.

    Args:
      fn: as [`hx.run_circuit`][hookax.run_circuit].
      clean_args: as [`hx.run_circuit`][hookax.run_circuit].
      corrupt_args: as [`hx.run_circuit`][hookax.run_circuit].
      metric: ``fn``'s output -> a scalar.
      edges: as [`hx.run_circuit`][hookax.run_circuit].
      components: as [`hx.run_circuit`][hookax.run_circuit].

    Returns:
      The faithfulness, a float (``nan`` where clean and corrupted metrics are equal).
    """
    circuit = float(metric(run_circuit(fn, clean_args, corrupt_args, edges, components)))
    clean, corrupt = float(metric(fn(*clean_args))), float(metric(fn(*corrupt_args)))
    return (circuit - corrupt) / (clean - corrupt) if clean != corrupt else float("nan")


def prune_edges(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    metric: Callable[[Any], Any],
    edges: Edges,
    *,
    target: float = 0.9,
) -> tuple[Edges, float]:
    """The fewest top-scored edges whose circuit reaches a faithfulness of ``target``.

    The edges are taken by absolute score (``edges.top(k)``) and ``k`` found by bisection
    between 0 and every edge: the smallest ``k`` at which the faithfulness
    ([`hx.faithfulness`][hookax.faithfulness]) is at least ``target`` where it grows with ``k``
    (it need not, everywhere: bisection then gives a ``k`` that reaches the target with one
    edge fewer that does not). About ``log2(len(edges))`` runs of one compiled program.

    Args:
      fn: as [`hx.run_circuit`][hookax.run_circuit].
      clean_args: as [`hx.run_circuit`][hookax.run_circuit].
      corrupt_args: as [`hx.run_circuit`][hookax.run_circuit].
      metric: ``fn``'s output -> a scalar.
      edges: scored edges, as [`hx.edge_attribution`][hookax.edge_attribution] gives them.
      target: the faithfulness to reach.

    Returns:
      ``(circuit, faithfulness)``: the top ``k`` edges and their faithfulness (every edge,
      faithfulness 1, when no smaller ``k`` reaches the target).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> from hookax.examples import induction
      >>> cfg = induction.Config(vocab=8, d_model=8, n_heads=2, half=3)
      >>> model = induction.AttnOnly(cfg, rngs=nnx.Rngs(0))
      >>> clean, corrupt = jnp.array([[1, 2, 3, 1, 2, 3]]), jnp.array([[4, 5, 6, 1, 2, 3]])
      >>> metric = lambda y: y[0, -2, 3]
      >>> edges = hx.edge_attribution(model, (clean,), (corrupt,), metric,
      ...                             induction.components())
      >>> circuit, f = hx.prune_edges(model, (clean,), (corrupt,), metric, edges, target=0.8)
      >>> f >= 0.8, len(circuit) < len(edges)
      (True, True)
    """
    ranked = edges.top(len(edges))
    clean, corrupt = float(metric(fn(*clean_args))), float(metric(fn(*corrupt_args)))

    def reached(k: int) -> float:
        y = run_circuit(fn, clean_args, corrupt_args, ranked.top(k))
        return (float(metric(y)) - corrupt) / (clean - corrupt) if clean != corrupt else 1.0

    seen: dict[int, float] = {}
    lo, hi = 0, len(ranked)  # the target is reached at hi, and not below lo
    while lo < hi:
        mid = (lo + hi) // 2
        seen[mid] = reached(mid)
        if seen[mid] >= target:
            hi = mid
        else:
            lo = mid + 1
    return ranked.top(hi), seen[hi] if hi in seen else reached(hi)
