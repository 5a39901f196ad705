"""``hx.edge_attribution``: every edge of the residual graph scored from gradients (EAP, EAP-IG).

Edge attribution patching (Syed et al. 2023) estimates the effect of corrupting one edge, the
sender's value replaced by its corrupted value in what one receiver reads, to first order:
``(sender_corrupt - sender_clean) . d metric / d (receiver's input)``, the gradient at the
clean run. One compiled program runs the corrupted forward (the senders' corrupted values), and
the clean forward and backward with zero shifts on every receiver's input (their gradients).
With ``steps > 1`` (EAP-IG, Hanna et al. 2024) the gradient is the mean over ``steps`` runs
whose embeddings are ``corrupt + alpha * (clean - corrupt)``, ``alpha = 1/steps, ..., 1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import firstcall
from .._interp.components import Components
from .._patching import compiled
from .._patching.patch import scalar_metric
from .._util.errors import HookaxError
from ..frameworks._functions import as_program
from .edges import Edges
from .graph import Graph, Rewire, check, discover, rewired

__all__ = ["edge_attribution"]

WHO = "hx.edge_attribution"


@dataclasses.dataclass(frozen=True)
class _Spec:
    rest: compiled.Static
    parts: Components
    graph: Graph
    steps: int


def _scalar(m: Any) -> Any:
    return scalar_metric(m, WHO, HookaxError)


@firstcall.program(static_argnums=0)
def _attribute(spec: _Spec, dyn: list[Any]) -> Any:
    fn, _, corrupt_args, _ = compiled.join(dyn, spec.rest)
    graph, parts = spec.graph, spec.parts
    _, corrupt = rewired(fn, parts, Rewire(graph), WHO)(*corrupt_args)
    embeds = {k: corrupt.values[k] for k in corrupt.embeds}

    def loss(shifts: Any, alpha: Any) -> tuple[Any, Any]:
        # joined here: an NNX model's transforms (nnx.scan) take modules made in their trace
        fn, clean_args, _, metric = compiled.join(dyn, spec.rest)
        rw = Rewire(graph, shifts=shifts)
        if spec.steps > 1:
            rw.alpha, rw.corrupt_embeds = alpha, embeds
        y, run = rewired(fn, parts, rw, WHO)(*clean_args)
        return _scalar(metric(y)).astype(jnp.float32), run.values

    zeros = {r: jnp.zeros(s, jnp.float32) for r, s in zip(graph.receivers, graph.shapes)}
    grad = jax.grad(loss, has_aux=True)
    if spec.steps == 1:
        grads, clean = grad(zeros, None)
    else:
        alphas = jnp.arange(1, spec.steps + 1, dtype=jnp.float32) / spec.steps
        _, clean = loss(zeros, jnp.float32(1))
        grads = jax.lax.map(lambda a: grad(zeros, a)[0], alphas)
        grads = jax.tree.map(lambda g: g.mean(0), grads)
    rows = []
    for s, r in graph.edges():
        delta = (corrupt.values[s] - clean[s]).astype(jnp.float32)
        rows.append(jnp.sum(jnp.broadcast_to(delta, grads[r].shape) * grads[r]))
    return jnp.stack(rows)


def edge_attribution(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    metric: Callable[[Any], Any],
    components: Components,
    *,
    steps: int = 1,
) -> Edges:
    """Every edge of the residual graph, scored by edge attribution patching (EAP), or with
    integrated gradients (EAP-IG) for ``steps > 1``.

    The graph's senders are the embeddings (named by their call sites, ``"embed"``,
    ``"pos_embed"``), each head's output after the output projection without its bias
    (``"L{layer}H{head}"``) and each MLP's output (``"MLP{layer}"``); its receivers each head's
    query, key and value inputs (``"L1H0.q"``, ``".k"``, ``".v"``: the input of the
    ``components.qkv`` projections, one copy per head), each MLP's input (``"MLP{layer}"``)
    and the readout (``"logits"``: the input of ``final_norm``, else of ``unembed``). Each
    sender has an edge to every receiver that reads the stream after it is written: blocks are
    taken as sequential, and each receiver reads the stream itself, or through the norms
    ``components.norms`` names (pre-norm blocks: each head's query, key and value read the
    norm of a copy of their own). The projections are affine; each head reads its own copy of
    their input (head ``h`` of ``proj(x) + linear(shift)``, the projection linearized). Flax
    NNX, Linen, Equinox and Haiku models and plain programs; layers in a Python loop or a
    scan over stacked layers (``nnx.scan``, ``nn.scan``, ``lax.scan``: run unrolled here,
    each iteration labelled by its layer, its call sites named by suffix,
    ``"blocks/attn/query"``); parts inside ``jax.vmap``s the model applies (Equinox's over
    the positions, ``jax.vmap(model)`` over the batch: senders' values recorded whole,
    each receiver shifted by its element's slice). A part inside another transform of the
    model's own (``jax.checkpoint``, a ``cond`` or ``while_loop`` on traced values) raises.

    The score of edge ``(s, r)`` is ``sum((s_corrupt - s_clean) * g_r)`` over every batch
    element and position, where ``g_r`` is the gradient of the metric with respect to
    ``r``'s input at the clean run (``steps=1``), or its mean over ``steps`` runs of the
    clean input whose embeddings are ``corrupt + alpha * (clean - corrupt)`` for ``alpha =
    1/steps, 2/steps, ..., 1`` (Hanna et al.'s points; ``nox -s parity_circuits`` checks it
    against that definition computed with TransformerLens' hooks). It estimates ``metric``
    with that edge corrupted minus ``metric`` clean (the first-order term; exact when the
    metric is linear in ``r``'s input). One compiled program: the corrupted forward, and the
    clean forward and backward (``steps`` of them for EAP-IG).

    Args:
      fn: the model or function, ``fn(*clean_args)``.
      clean_args: the clean run's arguments.
      corrupt_args: the corrupted run's arguments, the same shapes.
      metric: ``fn``'s output -> a scalar.
      components: an [`hx.Components`][hookax.Components] with ``embed``, ``heads`` (the
        output projection), ``qkv``, ``mlp`` (None for attention only), ``unembed`` or
        ``final_norm``, and in pre-norm blocks ``norms`` and ``n_heads``.
      steps: 1 for EAP; more for EAP-IG with that many points.

    Returns:
      An [`hx.Edges`][hookax.Edges] of every edge, receiver by receiver in the order the run
      reads them, senders in the order it writes them. Its scores are numpy values: call it
      outside ``jax.jit`` (it compiles its own program); [`hx.run_circuit`][hookax.run_circuit]
      and [`hx.path_patch`][hookax.path_patch] return arrays and trace inside one.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import hookax as hx
      >>> from hookax.examples import induction
      >>> cfg = induction.Config(vocab=8, d_model=8, n_heads=2, half=3)
      >>> model = induction.AttnOnly(cfg, rngs=__import__("flax").nnx.Rngs(0))
      >>> clean = jnp.array([[1, 2, 3, 1, 2, 3]])
      >>> corrupt = jnp.array([[1, 2, 3, 4, 5, 6]])
      >>> edges = hx.edge_attribution(model, (clean,), (corrupt,),
      ...                             lambda y: y[0, -1, 1], induction.components())
      >>> len(edges), edges.sources[:3], edges.destinations[0]
      (42, ('embed', 'pos_embed', 'embed'), 'L0H0.q')
    """
    check(components, WHO)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise HookaxError(f"{WHO}: steps= takes a positive int, got {steps!r}.")
    fn = as_program(fn)
    dyn, _ = compiled.split((fn, tuple(clean_args), tuple(corrupt_args), metric))
    if any(isinstance(x, jax.core.Tracer) for x in dyn):
        raise HookaxError(
            f"{WHO}: called inside jax.jit (or another transform): its arguments are traced, "
            f"and the hx.Edges it returns holds concrete scores (numpy) to rank, print and "
            f"draw. Fix: call it outside jax.jit; it compiles its own program (the model may "
            f"be jitted elsewhere). hx.run_circuit and hx.path_patch trace inside jax.jit."
        )
    graph = discover(fn, tuple(clean_args), components, WHO)

    def run() -> Any:
        dyn, rest = compiled.split((fn, tuple(clean_args), tuple(corrupt_args), metric))
        return _attribute(_Spec(rest, components, graph, steps), dyn)

    scores = compiled.retrying(WHO, (fn, metric), run)
    edges = graph.edges()
    sources, dests = tuple(e[0] for e in edges), tuple(e[1] for e in edges)
    return Edges(sources, dests, np.asarray(scores, np.float32), components)
