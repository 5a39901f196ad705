"""What a traced call costs: XLA's FLOPs (loops counted per iteration), its VJP, its memory.

Everything works on abstract values: a function and ``jax.ShapeDtypeStruct`` arguments are traced
(``jax.jit(fn).trace``) and lowered, never compiled or run.

* **FLOPs** are XLA's HLO cost analysis of the lowered program. That analysis counts the body of
  a loop once; :func:`flops` adds ``(trip count - 1)`` times the body of every ``scan`` (found in
  the traced program, nested scans included), so a model that scans 32 layers counts 32.
* **VJP FLOPs** are the same count of ``jax.vjp`` of the function followed by its pullback
  applied to the outputs (the forward and the backward pass, as ``nnx.tabulate``'s
  ``compute_vjp_flops`` counts), differentiating every floating-point leaf of the arguments.
* **Activation memory** is what the backward pass keeps: the residuals of ``jax.vjp`` (the
  values its pullback closes over) that are not the arguments themselves, in bytes.
* **Trip counts**: :func:`site_trips` reads, from the traced program, how many times each call
  site runs per call: the product of the lengths of the scans around it (``None`` inside a
  ``while`` loop, whose count is not static).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = [
    "SCOPE",
    "diff_split",
    "flops",
    "nbytes",
    "site_trips",
    "vjp_fn",
]

SCOPE = "hookax_site_"  # the name scope the summary's recorder wraps call site n in
_SCOPE_RE = re.compile(SCOPE + r"(\d+)")


def nbytes(x: Any) -> int:
    """Bytes of one array-like leaf (PRNG keys by their key data, as ``nnx.tabulate``)."""
    n = int(np.prod(x.shape, dtype=np.int64))
    return n * int(x.dtype.itemsize)


def _inexact(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    try:
        return dtype is not None and bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def diff_split(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The floating-point leaves of ``tree``, and how to put other values in their place."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = [_inexact(x) for x in leaves]

    def rebuild(diff: list[Any]) -> Any:
        it = iter(diff)
        return jax.tree.unflatten(treedef, [next(it) if m else x for x, m in zip(leaves, mask)])

    return [x for x, m in zip(leaves, mask) if m], rebuild


def _differentiable(fn: Callable[..., Any], args: tuple) -> tuple[Callable[..., Any], list]:
    """``fn(*args)`` as a function of the floating-point leaves of ``args`` only."""
    diff, rebuild = diff_split(args)

    def f(diff: list[Any]) -> list[Any]:
        out = fn(*rebuild(diff))
        return [y for y in jax.tree.leaves(out) if _inexact(y)]

    return f, diff


def vjp_fn(fn: Callable[..., Any], residuals: list[int] | None = None) -> Callable[..., Any]:
    """``fn``'s forward and backward pass: its pullback applied to its own outputs.

    While it is traced, the bytes the pullback keeps (its residuals that are not arguments,
    each counted once) are appended to ``residuals``.
    """

    def run(*args: Any) -> Any:
        f, diff = _differentiable(fn, args)
        outs, pullback = jax.vjp(f, diff)
        if residuals is not None:
            given = {id(x) for x in jax.tree.leaves(args)}
            kept = {id(r): r for r in jax.tree.leaves(pullback) if id(r) not in given}
            residuals.append(sum(nbytes(r) for r in kept.values() if hasattr(r, "dtype")))
        return pullback(outs)

    return run


def flops(traced: Any) -> int | None:
    """XLA's FLOPs of a traced function (``jax.jit(f).trace(...)``), scans counted per trip.

    0 for a program that does no arithmetic; None where the backend has no cost analysis.
    """
    base = _xla_flops(traced.lower())
    if base is None:
        return None
    # XLA counts -1 for each sharding annotation (a custom call of unknown cost) of a model
    # that shards its activations (EasyDeL, MaxText): added back.
    base += _count(traced.jaxpr.jaxpr, "sharding_constraint")
    extra = _scan_extra(traced.jaxpr.jaxpr)
    return base if extra is None else base + extra


def _count(jaxpr: Any, name: str) -> int:
    """How many equations of primitive ``name`` the program holds, sub-programs included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for sub in _subjaxprs(eqn):
            n += _count(sub, name)
    return n


def _xla_flops(lowered: Any) -> int | None:
    try:
        cost = lowered.cost_analysis()
    except Exception:  # pragma: no cover - a backend without cost analysis
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    if cost is None:
        return None
    return round(cost.get("flops", 0.0))


def _subjaxprs(eqn: Any) -> Iterator[Any]:
    from .._util.jaxcompat import jaxprs_in_params

    yield from jaxprs_in_params(eqn.params)


def _scan_extra(jaxpr: Any) -> int | None:
    """FLOPs XLA's count misses: ``(length - 1) x body`` for each scan, nested ones included."""
    from .._util.jaxcompat import jaxpr_as_fun

    extra = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body = eqn.params["jaxpr"]
            closed = jaxpr_as_fun(body)
            avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]
            try:
                per_trip = flops(jax.jit(closed).trace(*avals))
            except Exception:  # pragma: no cover - a body that does not lower alone
                return None
            if per_trip is None:
                return None
            extra += (eqn.params["length"] - 1) * per_trip
            # the nested scans of the body are in per_trip already, once per trip
            continue
        for sub in _subjaxprs(eqn):
            inner = _scan_extra(sub)
            if inner is None:
                return None
            extra += inner
    return extra


def site_trips(jaxpr: Any) -> dict[int, int | None]:
    """Call site number -> how many times it runs per call, for the sites in the program.

    Read from the name scopes :data:`SCOPE` ``n`` in the traced program: a site inside scans runs
    the product of their lengths, inside a ``while`` loop an unknown number (None), elsewhere
    once. A site that is absent did no work, or ran in a trace the program does not use (Linen's
    ``nn.scan`` traces its body once more to learn its shapes).
    """
    trips: dict[int, int | None] = {}
    _walk(jaxpr, 1, trips)
    return trips


def _walk(jaxpr: Any, factor: int | None, trips: dict[int, int | None]) -> None:
    for eqn in jaxpr.eqns:
        for n in _SCOPE_RE.findall(str(eqn.source_info.name_stack)):
            trips.setdefault(int(n), factor)
        name = eqn.primitive.name
        if name == "scan":
            inner = None if factor is None else factor * eqn.params["length"]
        elif name == "while":
            inner = None
        else:
            inner = factor
        for sub in _subjaxprs(eqn):
            _walk(sub, inner, trips)
