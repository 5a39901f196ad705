"""How marked values leave (reap) and probes enter (plant) each higher-order primitive.

Each rule gets the :class:`HarvestTrace` that met the primitive, re-traces the inner
jaxpr(s) through a child session (:func:`reap_jaxpr`, :func:`plant_jaxpr`), binds the primitive on
the trace's parent with the extra outputs or inputs, and hands the collected records up, each
tagged with the axis the primitive added (``scan`` stacks, ``cond`` selects, ``while`` keeps the
last iteration, or, with a session's ``while_steps``, stacks its iterations into a buffer of that
many rows carried through the loop).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._util.errors import HookaxError
from .._util.jaxcompat import (
    ClosedJaxpr,
    ad_checkpoint,
    ad_util,
    conditionals,
    core,
    ft_flatten,
    ft_pack,
    loops,
    lu,
    pe,
    pjit,
    scan_params,
)
from .tags import _LOCAL, ForwardingTrace, Record, Session, tag_p

__all__ = ["RULES", "HarvestTrace", "has_marks", "plant_jaxpr", "reap_jaxpr", "run"]

_DEBUG = lu.DebugInfo("hookax", "<hookax retrace>", None, None)


# ---- finding marks -------------------------------------------------------------------------


def _jaxprs_in(params: dict) -> list[Any]:
    out = []
    for v in params.values():
        if isinstance(v, ClosedJaxpr | core.Jaxpr):
            out.append(v)
        elif isinstance(v, tuple):
            out.extend(x for x in v if isinstance(x, ClosedJaxpr | core.Jaxpr))
    return out


_MARKS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _sids(jaxpr: Any) -> frozenset[int]:
    """The sessions whose marks ``jaxpr`` holds, at any depth (memoized per jaxpr object)."""
    j = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    hit = _MARKS.get(j)
    if hit is not None:
        return hit
    found: set[int] = set()
    for eqn in j.eqns:
        if eqn.primitive is tag_p:
            found.add(eqn.params["sid"])
        for sub in _jaxprs_in(eqn.params):
            found |= _sids(sub)
    result = frozenset(found)
    _MARKS[j] = result
    return result


def has_marks(prim: Any, params: dict, sid: int) -> bool:
    return any(sid in _sids(j) for j in _jaxprs_in(params))


# ---- re-tracing inner jaxprs ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Meta:
    """A record collected inside a re-traced jaxpr, without its values: key, spec, leaf avals."""

    key: str
    spec: Any
    avals: tuple[Any, ...]
    axes: tuple[tuple[str, Any], ...]


def _trace(fn: Callable[..., list[Any]], in_avals: list[Any]) -> ClosedJaxpr:
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=_DEBUG), in_avals)
    return ClosedJaxpr(jaxpr, consts)


def _eval(closed: Any, args: list[Any]) -> list[Any]:
    if isinstance(closed, ClosedJaxpr):
        return core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    return core.eval_jaxpr(closed, (), *args)


def _in_avals(closed: Any) -> list[Any]:
    if isinstance(closed, ClosedJaxpr):
        return list(closed.in_avals)
    return [v.aval for v in closed.invars]


# jaxpr -> {(sid, who, mode): rewritten}: held only while the jaxpr lives (JAX's own caches hold
# the jaxprs of jitted functions), so a function called in capture again reuses its rewrite and
# its compiled program, and nothing here keeps a dropped function's constants alive.
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _cached(key: tuple, jaxpr: Any, make: Callable[[], Any]) -> Any:
    per = _CACHE.setdefault(jaxpr, {})
    if key not in per:
        per[key] = make()
    return per[key]


def reap_jaxpr(closed: Any, session: Session) -> tuple[ClosedJaxpr, tuple[Meta, ...]]:
    """``closed`` with the values of ``session``'s marks appended to its outputs."""

    def make() -> tuple[ClosedJaxpr, tuple[Meta, ...]]:
        metas: list[Meta] = []

        def body(*args: Any) -> list[Any]:
            child = Session(session.sid, session.who, "reap", while_steps=session.while_steps)
            with core.set_current_trace(HarvestTrace(core.trace_ctx.trace, child)):
                outs = _eval(closed, list(args))
            metas[:] = [
                Meta(r.key, r.spec, tuple(core.typeof(v) for v in r.values), r.axes)
                for r in child.records
            ]
            return [*outs, *(v for r in child.records for v in r.values)]

        new = _trace(body, _in_avals(closed))
        return new, tuple(metas)

    return _cached((session.sid, session.who, "reap", session.while_steps), closed, make)


def _probe_avals(metas: tuple[Meta, ...]) -> list[list[Any]]:
    """Per record, the avals of its probes (None for leaves that are not inexact)."""
    return [[a if jnp.issubdtype(a.dtype, jnp.inexact) else None for a in m.avals] for m in metas]


def _flat(probes: list[list[Any]]) -> list[Any]:
    return [p for ps in probes for p in ps if p is not None]


def _unflat(flat: list[Any], like: list[list[Any]]) -> list[list[Any]]:
    it = iter(flat)
    return [[None if a is None else next(it) for a in ps] for ps in like]


def plant_jaxpr(closed: Any, session: Session, metas: tuple[Meta, ...]) -> ClosedJaxpr:
    """``closed`` taking one more input per inexact leaf of each mark: added to the marked value."""
    like = _probe_avals(metas)

    def make() -> ClosedJaxpr:
        n = len(_in_avals(closed))

        def body(*args: Any) -> list[Any]:
            probes = _unflat(list(args[n:]), like)
            child = Session(session.sid, session.who, "plant", probes=probes)
            with core.set_current_trace(HarvestTrace(core.trace_ctx.trace, child)):
                outs = _eval(closed, list(args[:n]))
            if child.used != len(probes):
                raise HookaxError(
                    f"{session.who}: an inner transform ran {child.used} marked call sites while "
                    f"differentiating but {len(probes)} when its outputs were measured."
                )
            return outs

        return _trace(body, [*_in_avals(closed), *_flat(like)])

    return _cached((session.sid, session.who, "plant", len(metas)), closed, make)


def deliver(session: Session, metas: tuple[Meta, ...], values: list[Any], axis: Any) -> None:
    """Hand the records of an inner jaxpr, now values of this trace, to ``session``."""
    it = iter(values)
    for m in metas:
        vals = [next(it) for _ in m.avals]
        axes = m.axes if axis is None else (*m.axes, axis)
        session.records.append(Record(m.key, m.spec, vals, axes))


def _bind(trace: HarvestTrace, prim: Any, args: list[Any], params: dict) -> list[Any]:
    return prim.bind_with_trace(trace.parent, args, [core.typeof(a) for a in args], params)


def _take(session: Session, metas: tuple[Meta, ...]) -> list[Any]:
    """The probes of this trace's session for ``metas``, flattened (plant)."""
    key = metas[0].key if metas else "?"
    return _flat(session.take_probes(len(metas), key, metas[0].spec if metas else None))


# ---- rules ---------------------------------------------------------------------------------


def _jit(trace: HarvestTrace, args: Any, params: dict) -> Any:
    s = trace.session
    jaxpr = params["jaxpr"]
    n_out = len(jaxpr.out_avals)
    reaped, metas = reap_jaxpr(jaxpr, s)
    if s.mode == "reap":
        k = len(reaped.out_avals) - n_out
        p = dict(
            params,
            jaxpr=reaped,
            out_shardings=(*params["out_shardings"], *[pjit.UNSPECIFIED] * k),
            out_layouts=(*params["out_layouts"], *[None] * k),
        )
        outs = _bind(trace, pjit.jit_p, list(args), p)
        deliver(s, metas, outs[n_out:], None)
        return outs[:n_out]
    probes = _take(s, metas)
    k = len(probes)
    p = dict(
        params,
        jaxpr=plant_jaxpr(jaxpr, s, metas),
        in_shardings=(*params["in_shardings"], *[pjit.UNSPECIFIED] * k),
        in_layouts=(*params["in_layouts"], *[None] * k),
        donated_invars=(*params["donated_invars"], *[False] * k),
    )
    return _bind(trace, pjit.jit_p, [*args, *probes], p)


def _closed_to_consts(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """Move a closed jaxpr's constants to leading inputs (for primitives that take no consts)."""
    return ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ()), list(closed.consts)


def _scan(trace: HarvestTrace, args: Any, params: dict) -> Any:
    s = trace.session
    jaxpr = params["jaxpr"]
    n_out = len(jaxpr.out_avals)
    reaped, metas = reap_jaxpr(jaxpr, s)
    if s.mode == "reap":
        body, consts = _closed_to_consts(reaped)
        k = len(reaped.out_avals) - n_out
        p = scan_params(params, body, consts=len(consts), ys=k)
        outs = _bind(trace, loops.scan_p, [*consts, *args], p)
        deliver(s, metas, outs[n_out:], ("scan", params["length"]))
        return outs[:n_out]
    probes = _take(s, metas)
    body, consts = _closed_to_consts(plant_jaxpr(jaxpr, s, metas))
    p = scan_params(params, body, consts=len(consts), xs=len(probes))
    return _bind(trace, loops.scan_p, [*consts, *args, *probes], p)


def _fill(aval: Any) -> Any:
    """What a slot holds where its call site did not run: NaN, or the dtype's minimum."""
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        return jnp.full(aval.shape, jnp.nan, aval.dtype)
    if jnp.issubdtype(aval.dtype, jnp.integer):
        return jnp.full(aval.shape, jnp.iinfo(aval.dtype).min, aval.dtype)
    return jnp.zeros(aval.shape, aval.dtype)


def _while(trace: HarvestTrace, args: Any, params: dict) -> Any:
    s = trace.session
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    if s.sid in _sids(cond):
        raise HookaxError(
            f"{s.who}: a selected call site or operation runs in the condition of a "
            "jax.lax.while_loop; hookax cannot carry its value out. Leave it out of where=/ops=."
        )
    reaped, metas = reap_jaxpr(body, s)
    if s.mode == "plant":
        raise HookaxError(
            f"{s.who} cannot differentiate with respect to {metas[0].spec.what(metas[0].key)}: "
            "it runs inside a jax.lax.while_loop (or a fori_loop without static bounds), which "
            "JAX cannot differentiate in reverse mode. Use jax.lax.scan or fori_loop with static "
            f"bounds, or {metas[0].spec.exclude}."
        )
    avals = [a for m in metas for a in m.avals]
    if s.while_steps is not None:
        return _while_stacked(trace, args, params, reaped, metas, s.while_steps)
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    k = len(avals)
    n_carry = len(body.out_avals)

    def new_body(*a: Any) -> list[Any]:
        return _eval(reaped, list(a[: bn + n_carry]))

    def new_cond(*a: Any) -> list[Any]:
        return _eval(cond, list(a[: cn + n_carry]))

    new_cond_j = _trace(new_cond, [*cond.in_avals, *avals])
    p, new_args = while_with(params, new_cond_j, _trace(new_body, [*body.in_avals, *avals]), args)
    with core.set_current_trace(trace.parent):
        init = [_fill(a) for a in avals]
    outs = _bind(trace, loops.while_p, [*new_args, *init], p)
    deliver(s, metas, outs[len(outs) - k :], ("while", None))
    return outs[: len(outs) - k]


def _while_stacked(
    trace: HarvestTrace, args: Any, params: dict, reaped: Any, metas: tuple[Meta, ...], n: int
) -> Any:
    """The ``while`` rule with a bound: iteration ``i``'s marked values go to row ``i`` of
    buffers of ``n`` rows carried through the loop (rows from ``n`` on are dropped), and the
    iteration counter, carried too, is appended to each record's values.

    A loop under ``vmap`` whose condition depends on the mapped values has a batched predicate
    of shape ``P``: JAX then keeps each element's carry once its predicate is false, so every
    extra carry leads with ``P`` (each element counts and writes its own rows); the rows axis is
    moved in front afterwards, as a scan under ``vmap`` stacks.
    """
    s = trace.session
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    n_carry = len(body.out_avals)
    batch = tuple(cond.out_avals[0].shape)
    avals = [a for m in metas for a in m.avals]
    for m in metas:
        if any(tuple(a.shape[: len(batch)]) != batch for a in m.avals):
            raise HookaxError(
                f"{s.who}: {m.spec.what(m.key)} runs in a jax.lax.while_loop under jax.vmap "
                f"whose condition depends on the mapped values, but its value does not lead "
                f"with the batch axes {batch}; hookax cannot stack its iterations per element. "
                f"Fix: {m.spec.exclude}, or capture inside the vmapped function."
            )
    nb = len(batch)
    bufs = [core.ShapedArray((*batch, n, *a.shape[nb:]), a.dtype) for a in avals]
    counter = core.ShapedArray(batch, jnp.dtype("int32"))

    def new_body(*a: Any) -> list[Any]:
        outs = _eval(reaped, list(a[: bn + n_carry]))
        i, old = a[bn + n_carry], a[bn + n_carry + 1 :]
        new = [_write(b, v, i, nb) for b, v in zip(old, outs[n_carry:])]
        return [*outs[:n_carry], i + 1, *new]

    def new_cond(*a: Any) -> list[Any]:
        return _eval(cond, list(a[: cn + n_carry]))

    p, new_args = while_with(
        params,
        _trace(new_cond, [*cond.in_avals, counter, *bufs]),
        _trace(new_body, [*body.in_avals, counter, *bufs]),
        args,
    )
    with core.set_current_trace(trace.parent):
        init = [jnp.zeros(batch, jnp.int32), *[_fill(b) for b in bufs]]
    outs = _bind(trace, loops.while_p, [*new_args, *init], p)
    count, stacked = outs[len(outs) - len(bufs) - 1], outs[len(outs) - len(bufs) :]
    if nb:
        with core.set_current_trace(trace.parent):
            stacked = [jnp.moveaxis(b, nb, 0) for b in stacked]
    it = iter(stacked)
    for m in metas:
        values = [next(it) for _ in m.avals]
        s.records.append(Record(m.key, m.spec, [*values, count], (*m.axes, ("while", n))))
    return outs[: len(outs) - len(bufs) - 1]


def _write(buf: Any, value: Any, i: Any, nb: int = 0) -> Any:
    """``buf`` with row ``i`` set to ``value``; unchanged when ``i`` is past its last row (a
    row-sized select, so the update stays in place). With ``nb`` leading batch axes, each
    element writes its own row ``i[b]``."""
    if nb:
        size = int(np.prod(buf.shape[:nb]))
        flat = jax.vmap(_write)(
            buf.reshape(size, *buf.shape[nb:]),
            value.reshape(size, *value.shape[nb:]),
            i.reshape(size),
        )
        return flat.reshape(buf.shape)
    n = buf.shape[0]
    last = jax.lax.dynamic_index_in_dim(buf, n - 1, keepdims=False)
    row = jnp.where(i < n, value.astype(buf.dtype), last)
    return jax.lax.dynamic_update_index_in_dim(buf, row, jnp.minimum(i, n - 1), 0)


def while_with(params: dict, cond: Any, body: Any, args: Any) -> tuple[dict, list[Any]]:
    """``while`` with new (closed) cond and body jaxprs: their constants become leading consts
    inputs. The new params and arguments (``args``: the old ones)."""
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    ncond, cconsts = _closed_to_consts(cond)
    nbody, bconsts = _closed_to_consts(body)
    p = dict(
        params,
        cond_jaxpr=ncond,
        body_jaxpr=nbody,
        cond_nconsts=cn + len(cconsts),
        body_nconsts=bn + len(bconsts),
    )
    cargs, bargs, carry = args[:cn], args[cn : cn + bn], args[cn + bn :]
    return p, [*cconsts, *cargs, *bconsts, *bargs, *carry]


def _slots(all_metas: list[tuple[Meta, ...]]) -> list[tuple[str, int, Meta]]:
    """The union of the branches' records, aligned by (key, occurrence)."""
    slots: dict[tuple[str, int], Meta] = {}
    for metas in all_metas:
        seen: dict[str, int] = {}
        for m in metas:
            i = seen.get(m.key, 0)
            seen[m.key] = i + 1
            prev = slots.setdefault((m.key, i), m)
            if prev.avals != m.avals or prev.spec != m.spec:
                raise HookaxError(
                    f"hookax: {m.spec.what(m.key)} returns different shapes or structures in the "
                    f"branches of a jax.lax.cond/switch ({prev.avals} vs {m.avals}); its values "
                    f"cannot share one entry. Fix: {m.spec.exclude}."
                )
    return [(k, i, m) for (k, i), m in slots.items()]


def _positions(metas: tuple[Meta, ...], slots: list[tuple[str, int, Meta]]) -> list[int]:
    """For each record of one branch, the index of its slot."""
    index = {(k, i): j for j, (k, i, _) in enumerate(slots)}
    seen: dict[str, int] = {}
    out = []
    for m in metas:
        i = seen.get(m.key, 0)
        seen[m.key] = i + 1
        out.append(index[(m.key, i)])
    return out


def _cond(trace: HarvestTrace, args: Any, params: dict) -> Any:
    s = trace.session
    branches = params["branches"]
    reaped = [reap_jaxpr(b, s) for b in branches]
    slots = _slots([m for _, m in reaped])
    metas = tuple(m for _, _, m in slots)
    n_out = len(branches[0].out_avals)
    index, ops = args[0], list(args[1:])
    if s.mode == "reap":
        new = []
        for b, (r, bm) in zip(branches, reaped):
            pos = _positions(bm, slots)

            def branch_reap(*a: Any, r: Any = r, bm: Any = bm, pos: list[int] = pos) -> list[Any]:
                outs = _eval(r, list(a))
                it = iter(outs[n_out:])
                got = {j: [next(it) for _ in m.avals] for j, m in zip(pos, bm)}
                extra = [
                    v
                    for j, (_, _, m) in enumerate(slots)
                    for v in (got[j] if j in got else [_fill(a) for a in m.avals])
                ]
                return [*outs[:n_out], *extra]

            new.append(_trace(branch_reap, list(b.in_avals)))
        outs = _bind(trace, conditionals.cond_p, [index, *ops], dict(params, branches=tuple(new)))
        deliver(s, metas, outs[n_out:], ("cond", None))
        return outs[:n_out]
    like = _probe_avals(metas)
    probes = _take(s, metas)
    new = []
    for b, (_, bm) in zip(branches, reaped):
        pos = _positions(bm, slots)
        planted = plant_jaxpr(b, s, bm)
        nb = len(b.in_avals)

        def branch(*a: Any, planted: Any = planted, pos: list[int] = pos, nb: int = nb) -> Any:
            per_slot = _unflat(list(a[nb:]), like)
            mine = _flat([per_slot[j] for j in pos])
            return _eval(planted, [*a[:nb], *mine])

        new.append(_trace(branch, [*b.in_avals, *_flat(like)]))
    return _bind(
        trace, conditionals.cond_p, [index, *ops, *probes], dict(params, branches=tuple(new))
    )


def _remat(trace: HarvestTrace, args: Any, params: dict) -> Any:
    s = trace.session
    jaxpr = params["jaxpr"]  # an open jaxpr: no constants
    n_out = len(jaxpr.outvars)
    reaped, metas = reap_jaxpr(jaxpr, s)
    prevent_cse = params["prevent_cse"]
    if s.mode == "reap":
        body, consts = _closed_to_consts(reaped)
        extra_cse = (
            (*[False] * len(consts), *prevent_cse)
            if isinstance(prevent_cse, tuple)
            else prevent_cse
        )
        outs = _bind(
            trace,
            ad_checkpoint.remat_p,
            [*consts, *args],
            dict(params, jaxpr=body.jaxpr, prevent_cse=extra_cse),
        )
        deliver(s, metas, outs[n_out:], None)
        return outs[:n_out]
    probes = _take(s, metas)
    body, consts = _closed_to_consts(plant_jaxpr(jaxpr, s, metas))
    if isinstance(prevent_cse, tuple):
        prevent_cse = (*[False] * len(consts), *prevent_cse, *[False] * len(probes))
    return _bind(
        trace,
        ad_checkpoint.remat_p,
        [*consts, *args, *probes],
        dict(params, jaxpr=body.jaxpr, prevent_cse=prevent_cse),
    )


RULES: dict[Any, Callable[..., Any]] = {
    pjit.jit_p: _jit,
    loops.scan_p: _scan,
    loops.while_p: _while,
    conditionals.cond_p: _cond,
    ad_checkpoint.remat_p: _remat,
}


# ---- custom derivatives and shard_map ------------------------------------------------------


def _trace_fun(fun: Any, args: Any) -> tuple[ClosedJaxpr, list[tuple[Any, Any]]]:
    """Trace a custom-derivative function's body once; empty its stores, return what they held.

    JAX's caller reads the output tree from either the function's stores or the rule's (never
    both): the stores are refilled by :func:`_restore` only if the parent trace did not call the
    rule.
    """
    avals = [core.typeof(a) for a in args]
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fun, avals)
    saved = []
    for st in fun.stores:
        inner = getattr(st, "_store", st)
        if inner is not None and inner:
            saved.append((st, inner._val))
            st.reset()
    return ClosedJaxpr(jaxpr, consts), saved


def _restore(saved: list[tuple[Any, Any]], rule: Any) -> None:
    if any(getattr(st, "_store", st) for st in rule.stores if st is not None):
        return  # the parent trace ran the rule: its stores hold the output tree
    for st, val in saved:
        st.store(val)


def _as_fun(closed: ClosedJaxpr, like: Any) -> Any:
    return lu.wrap_init(core.jaxpr_as_fun(closed), debug_info=like.debug_info)


def _no_plant(s: Session, metas: tuple[Meta, ...], what: str) -> None:
    raise HookaxError(
        f"{s.who} cannot differentiate with respect to {metas[0].spec.what(metas[0].key)}: it "
        f"runs inside a function with a custom derivative ({what}), whose inside JAX never "
        f"differentiates, so d loss / d (its output) is not defined. Fix: {metas[0].spec.exclude}"
        + (" (the function itself has an address: hx.ops lists it)." if metas[0].spec.op else ".")
    )


def custom_jvp(
    trace: HarvestTrace, prim: Any, fun: Any, jvp: Any, args: Any, *, symbolic_zeros: bool
) -> Any:
    s = trace.session
    closed, saved = _trace_fun(fun, args)
    n_out = len(closed.out_avals)
    params: dict[str, Any] = {"symbolic_zeros": symbolic_zeros}
    avals = [core.typeof(a) for a in args]
    if s.sid not in _sids(closed):
        params["subfuns"] = (_as_fun(closed, fun), jvp)
        outs = prim.bind_with_trace(trace.parent, args, avals, params)
        _restore(saved, jvp)
        return outs
    reaped, metas = reap_jaxpr(closed, s)
    if s.mode == "plant":
        _no_plant(s, metas, "jax.custom_jvp")
    extra_avals = reaped.out_avals[n_out:]

    def new_jvp(*xs: Any) -> list[Any]:
        # The custom rule gives the outputs and their tangents; the marked values are computed
        # from the primal inputs, their tangents are zero (the rule does not define them).
        n = len(xs) // 2
        outs = jvp.call_wrapped(*xs)
        extras = _eval(reaped, list(xs[:n]))[n_out:]
        zeros = [ad_util.zeros_like_aval(a.to_tangent_aval()) for a in extra_avals]
        return [*outs[:n_out], *extras, *outs[n_out:], *zeros]

    params["subfuns"] = (_as_fun(reaped, fun), lu.wrap_init(new_jvp, debug_info=jvp.debug_info))
    outs = prim.bind_with_trace(trace.parent, args, avals, params)
    _restore(saved, jvp)
    deliver(s, metas, list(outs[n_out:]), None)
    return outs[:n_out]


def custom_vjp(
    trace: HarvestTrace, prim: Any, fun: Any, fwd: Any, bwd: Any, args: Any, **kw: Any
) -> Any:
    s = trace.session
    closed, saved = _trace_fun(fun, args)
    avals = [core.typeof(a) for a in args]
    if s.sid not in _sids(closed):
        params = dict(kw, subfuns=(_as_fun(closed, fun), fwd, bwd))
        outs = prim.bind_with_trace(trace.parent, args, avals, params)
        _restore(saved, fwd)
        return outs
    reaped, metas = reap_jaxpr(closed, s)
    if s.mode == "plant":
        _no_plant(s, metas, "jax.custom_vjp")
    # Run eagerly, the custom rule plays no part: run the body with its marks. Staged (under
    # jit, grad, vmap) the rule must stay, and a custom_vjp rule has no room for extra outputs.
    n_out = len(closed.out_avals)
    if trace.parent is not core.eval_trace:
        raise HookaxError(
            f"{s.who}: {metas[0].spec.what(metas[0].key)} runs inside a jax.custom_vjp function "
            "under a transform (jit, grad, vmap); hookax cannot carry its value out without "
            "dropping the function's custom gradient rule. Capture it eagerly (no jit around the "
            f"call), or {metas[0].spec.exclude}."
        )
    for st, val in saved:
        st.store(val)
    with core.set_current_trace(trace.parent):
        outs = _eval(reaped, list(args))
    deliver(s, metas, list(outs[n_out:]), None)
    return outs[:n_out]


def shard_map(trace: HarvestTrace, prim: Any, fun: Any, args: Any, **params: Any) -> Any:
    """Per-shard marked values leave a ``shard_map`` stacked on a new leading axis (one entry per
    shard, over all its manual mesh axes)."""
    s = trace.session
    axes = tuple(a for a in params["mesh"].axis_names if a in params["newly_manual_axes"])
    n = int(np.prod([params["mesh"].shape[a] for a in axes]))
    spec = jax.sharding.PartitionSpec(axes)
    found: list[Any] = []

    def body(*a: Any) -> Any:
        child = Session(s.sid, s.who, "reap", while_steps=s.while_steps)
        with core.set_current_trace(HarvestTrace(core.trace_ctx.trace, child)):
            ft = fun(*a)
        if not child.records:
            return ft
        if s.mode == "plant":
            raise HookaxError(
                f"{s.who} cannot differentiate with respect to "
                f"{child.records[0].spec.what(child.records[0].key)}: it runs inside a "
                "jax.shard_map body, where hookax cannot inject its probe yet. Differentiate "
                "inside the shard_map body (hx.value_and_grad within it), or "
                f"{child.records[0].spec.exclude}."
            )
        found[:] = [
            Meta(r.key, r.spec, tuple(core.typeof(v) for v in r.values), r.axes)
            for r in child.records
        ]
        extras = [jnp.expand_dims(v, 0) for r in child.records for v in r.values]
        data, specs = ft.unpack_aux()
        packed = ft_pack((data, ft_flatten(extras)))
        return packed.with_aux((*specs, *[spec] * len(extras)))

    out = trace.parent.process_shard_map(prim, body, args, **params)
    if not found:
        return out
    main, extra = out.unpack()
    deliver(s, tuple(found), list(extra.vals), ("shard_map", n))
    return main


class HarvestTrace(ForwardingTrace):
    """A forwarding trace that handles its session's marks (recorded, or a probe added) and
    re-traces the inner jaxprs that hold them (the rules of this module)."""

    __slots__ = ("session",)

    def __init__(self, parent: Any, session: Session) -> None:
        super().__init__(parent)
        self.session = session

    def process_primitive(self, prim: Any, args: Any, params: Any) -> Any:
        if prim is tag_p and params["sid"] == self.session.sid:
            with core.set_current_trace(self.parent):
                return self.session.on_tag(list(args), params["key"], params["spec"])
        if has_marks(prim, params, self.session.sid):
            rule = RULES.get(prim)
            if rule is None:
                raise HookaxError(
                    f"{self.session.who}: a selected call site or operation runs inside a "
                    f"`{prim.name}` primitive, which hookax cannot carry values out of. Leave "
                    f"what runs inside it out of where=/ops=, or call {self.session.who} inside "
                    f"that transform."
                )
            return rule(self, args, params)
        return self.forward(prim, args, params)

    def process_custom_jvp_call(self, prim: Any, fun: Any, jvp: Any, args: Any, **kw: Any) -> Any:
        return custom_jvp(self, prim, fun, jvp, args, **kw)

    def process_custom_vjp_call(
        self, prim: Any, fun: Any, fwd: Any, bwd: Any, args: Any, **kw: Any
    ) -> Any:
        return custom_vjp(self, prim, fun, fwd, bwd, args, **kw)

    def process_shard_map(self, prim: Any, fun: Any, args: Any, **params: Any) -> Any:
        return shard_map(self, prim, fun, args, **params)


def run(session: Session, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` with ``session`` collecting on top of the current trace (a top-level session)."""
    parent = core.trace_ctx.trace
    _LOCAL.live[session.sid] = session
    try:
        with core.set_current_trace(HarvestTrace(parent, session)):
            return fn(*args, **kwargs)
    finally:
        del _LOCAL.live[session.sid]
