"""Scans cut after the last iteration anything reads.

XLA removes the layers an unrolled stack does not need, but it cannot shorten a ``lax.scan``: a
harvest of ``"blocks/up[2]"`` of a 12-layer ``nnx.scan`` would run all 12 iterations to keep
the third. :func:`cut_scans` traces a function to a jaxpr, inlines the ``jit`` calls that hold
a scan (the others keep their shardings and donation), removes dead code, and runs every
forward scan whose final carry nothing reads and whose stacked outputs are read only through
static slices of the first ``m`` iterations as a scan of length ``m`` over the first ``m`` rows
of its inputs. The result is the same values (the same
body runs on the same carries), computed with the FLOPs of the cut forward. A scan with effects
(``jax.debug.print``, callbacks) runs whole: every effect happens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._util.jaxcompat import (
    bind_eqn,
    closed_parts,
    core,
    eqn_context,
    invars_to_constvars,
    jaxprs_in_params,
    pe,
    scan_counts,
)

__all__ = ["cut_scans", "cuts"]

_SCAN = "scan"
_INLINE = ("pjit", "jit", "closed_call", "core_call")


def cut_scans(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every scan cut after the last iteration its results read (see the module
    docstring); the same outputs. Traces ``fn`` once per call (call it under ``jax.jit``)."""

    def cut(*args: Any) -> Any:
        flat, in_tree = jax.tree.flatten(args)
        closed, shape = jax.make_jaxpr(
            lambda *xs: fn(*jax.tree.unflatten(in_tree, xs)), return_shape=True
        )(*flat)
        out_tree = jax.tree.structure(shape)
        out = None
        if _has_scan(closed.jaxpr):
            inlined = jax.make_jaxpr(lambda *xs: _eval(closed.jaxpr, closed.consts, xs, {}, True))(
                *flat
            )
            jaxpr, lengths = cuts(inlined.jaxpr)
            if lengths:
                out = _eval(jaxpr, inlined.consts, flat, lengths, False)
        if out is None:  # nothing to cut: the program as traced, its jit calls kept
            out = _eval(closed.jaxpr, closed.consts, flat, {}, False)
        return jax.tree.unflatten(out_tree, out)

    return cut


def _has_scan(jaxpr: core.Jaxpr) -> bool:
    return any(
        eqn.primitive.name == _SCAN or any(_has_scan(j) for j in jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


def cuts(jaxpr: core.Jaxpr) -> tuple[core.Jaxpr, dict[int, int]]:
    """``jaxpr`` without dead code, and ``{index of a scan equation: new length}`` for each scan
    that can be cut."""
    n_consts = len(jaxpr.constvars)
    opened = pe.convert_constvars_jaxpr(jaxpr)
    dced, _ = pe.dce_jaxpr(opened, [True] * len(opened.outvars), instantiate=True)
    jaxpr = invars_to_constvars(dced, n_consts)
    readers: dict[core.Var, list[core.JaxprEqn]] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, core.Var):
                readers.setdefault(v, []).append(eqn)
    returned = {v for v in jaxpr.outvars if isinstance(v, core.Var)}
    lengths = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != _SCAN or eqn.params["reverse"] or eqn.effects:
            continue  # a reverse scan runs its last rows first; effects must all happen
        _, n_carry, _ = scan_counts(eqn.params)
        carry = eqn.outvars[:n_carry]
        if any(v in returned or readers.get(v) for v in carry if isinstance(v, core.Var)):
            continue
        needed = _needed(eqn.outvars[n_carry:], readers, returned)
        if needed is not None and 0 < needed < eqn.params["length"]:
            lengths[i] = needed
    return jaxpr, lengths


def _needed(
    ys: list[Any], readers: dict[core.Var, list[core.JaxprEqn]], returned: set[core.Var]
) -> int | None:
    """How many leading iterations of the stacked outputs ``ys`` their readers use: None if
    any is returned or read other than by a static slice along the iteration axis."""
    needed = 0
    for v in ys:
        if not isinstance(v, core.Var):
            continue
        if v in returned:
            return None
        for eqn in readers.get(v, ()):
            if eqn.primitive.name != "slice" or (eqn.params["strides"] or (1,))[0] != 1:
                return None
            needed = max(needed, int(eqn.params["limit_indices"][0]))
    return needed


def _eval(
    jaxpr: core.Jaxpr, consts: Any, args: Any, lengths: dict[int, int], inline: bool
) -> list[Any]:
    """``jax.core.eval_jaxpr``, with the scans of ``lengths`` cut and, if ``inline``, the
    bodies of ``jit`` calls evaluated in place."""
    env: dict[core.Var, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else env[v]

    env.update(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True))
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        # only the jit calls on the way to a scan: the others keep their settings
        # (shardings, donation), bound as they were
        inline_this = inline and eqn.primitive.name in _INLINE
        if inline_this and inner is not None and _has_scan(closed_parts(inner)[0]):
            with eqn_context(eqn):
                outs = _eval(*closed_parts(inner), invals, {}, True)
        else:
            params = eqn.params
            if i in lengths:
                m = lengths[i]
                n_consts, n_carry, _ = scan_counts(params)
                lead = n_consts + n_carry
                invals = invals[:lead] + [jax.lax.slice_in_dim(x, 0, m) for x in invals[lead:]]
                params = dict(params, length=m)
            outs = bind_eqn(eqn, invals, params)
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]
