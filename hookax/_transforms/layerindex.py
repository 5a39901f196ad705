"""The iteration index of a scan, for one layer of a scanned stack (``"blocks/attn[3]"``).

A call site inside ``lax.scan`` (``nnx.scan``, ``nn.scan``, ``lax.scan`` over stacked layers) is
traced once for every layer, so which layer runs is not known while tracing. A one-layer edit
binds :data:`layer_index_p` inside the scan body and selects between the edited and the plain
value on it. The primitive is resolved where the iteration counter exists: when the scan that
holds it is lowered, hookax's scan lowering (installed on first use) adds an ``iota`` over the
layers as one more scanned input and substitutes it for the primitive, at any depth of the
body except inside a nested scan (which resolves its own). Every JAX transform of the scan
(vmap, JVP, partial evaluation, transpose, remat) carries the primitive along, so the index is
right in the backward pass too: a transposed scan reads its inputs in the forward's order.

The primitive takes one value of the call site as a dummy operand: a loop-varying value keeps
it inside the loop when JAX's partial evaluation hoists loop-invariant work out of a scan.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._util.errors import HookaxError
from .._util.jaxcompat import (
    ClosedJaxpr,
    ad,
    ad_checkpoint,
    ad_util,
    as_closed,
    batching,
    bind_eqn,
    conditionals,
    core,
    loops,
    lu,
    mlir,
    pe,
    pjit,
    scan_params,
)
from .._util.words import counted
from .tagrules import _jaxprs_in

__all__ = ["layer_index", "layer_index_p", "select"]

layer_index_p = core.Primitive("hookax_layer_index")


def _abstract(dep: Any, *, site: str, wanted: Any) -> core.ShapedArray:
    return core.ShapedArray((), np.dtype(np.int32))


def _impl(dep: Any, *, site: str, wanted: Any) -> Any:
    raise HookaxError(
        f"hookax: the layer index of call site {site!r} was evaluated outside the scan that "
        "runs it (the call site's value does not change from layer to layer, so JAX moved it "
        "out of the loop). Fix: select the call site without a layer suffix."
    )


def _jvp(primals: Any, tangents: Any, *, site: str, wanted: Any) -> Any:
    out = layer_index_p.bind(*primals, site=site, wanted=wanted)
    return out, ad_util.p2tz(out)


def _batch(args: Any, dims: Any, *, site: str, wanted: Any) -> Any:
    (dep,), (d,) = args, dims
    if d is not None:
        dep = jax.lax.index_in_dim(dep, 0, d, keepdims=False)
    return layer_index_p.bind(dep, site=site, wanted=wanted), None  # not batched


def _lower_alone(ctx: Any, dep: Any, *, site: str, wanted: Any) -> Any:
    _impl(dep, site=site, wanted=wanted)


layer_index_p.def_impl(_impl)
layer_index_p.def_abstract_eval(_abstract)
ad.primitive_jvps[layer_index_p] = _jvp
batching.primitive_batchers[layer_index_p] = _batch
mlir.register_lowering(layer_index_p, _lower_alone)


def layer_index(dep: Any, site: str, wanted: frozenset[int] | None = None) -> jax.Array:
    """The index of the scan iteration running now, as a traced ``int32`` scalar.

    ``dep`` is any array that changes from iteration to iteration (a value of the call site);
    ``wanted`` are the indices a selector names, checked against the scan's length when it is
    compiled.
    """
    _install()
    leaf = _first_array(dep)
    if leaf is None:
        raise HookaxError(
            f"hookax: call site {site!r} has no array among its inputs or outputs, so hookax "
            "cannot tell which layer of the scan runs. Fix: select it without a layer suffix."
        )
    return layer_index_p.bind(leaf, site=site, wanted=None if wanted is None else tuple(wanted))


def _first_array(tree: Any) -> Any:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array | core.Tracer):
            return leaf
    return None


def select(pred: Any, on: Any, off: Any, site: str) -> Any:
    """``on`` where ``pred`` else ``off``, leaf by leaf; both trees must have one structure."""
    on_leaves, on_tree = jax.tree.flatten(on)
    off_leaves, off_tree = jax.tree.flatten(off)
    if on_tree != off_tree:  # type: ignore[operator]
        raise HookaxError(
            f"hookax: the edit of one layer of call site {site!r} changed the structure of its "
            f"value ({on_tree} vs {off_tree}); every layer of a scan has one structure. Fix: "
            "return a value of the same structure, shapes and dtypes."
        )
    out = []
    for a, b in zip(on_leaves, off_leaves, strict=True):
        if a is b:
            out.append(a)
            continue
        if not isinstance(a, jax.Array | core.Tracer) or not isinstance(b, jax.Array | core.Tracer):
            if type(a) is type(b) and a == b:
                out.append(a)
                continue
            raise HookaxError(
                f"hookax: the edit of one layer of call site {site!r} changed a non-array value "
                f"({b!r} -> {a!r}); a scan runs one program for every layer. Fix: edit arrays."
            )
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise HookaxError(
                f"hookax: the edit of one layer of call site {site!r} changed a value's shape or "
                f"dtype ({jnp.result_type(b)}{list(jnp.shape(b))} -> "
                f"{jnp.result_type(a)}{list(jnp.shape(a))}); every layer of a scan has one "
                "shape. Fix: return the same shape and dtype."
            )
        out.append(jax.lax.select(jnp.broadcast_to(pred, jnp.shape(a)), a, b))
    return jax.tree.unflatten(on_tree, out)


# ---- resolving the index when a scan is lowered --------------------------------------------


_HOLDS: weakref.WeakKeyDictionary[Any, tuple[bool, tuple[int, ...]]] = weakref.WeakKeyDictionary()


def _holds(jaxpr: Any) -> tuple[bool, tuple[int, ...]]:
    """Whether ``jaxpr`` binds the index outside any nested scan, and the indices wanted."""
    j = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    hit = _HOLDS.get(j)
    if hit is not None:
        return hit
    found, wanted = False, set()
    for eqn in j.eqns:
        if eqn.primitive is layer_index_p:
            found = True
            wanted |= set(eqn.params["wanted"] or ())
        elif eqn.primitive is not loops.scan_p:
            for sub in _jaxprs_in(eqn.params):
                f, w = _holds(sub)
                found, wanted = found or f, wanted | set(w)
    result = (found, tuple(sorted(wanted)))
    _HOLDS[j] = result
    return result


_DEBUG = lu.DebugInfo("hookax", "<hookax layer index>", None, None)


def _with_index(jaxpr: Any, at: int | None = None) -> ClosedJaxpr:
    """``jaxpr`` with one more ``int32`` input (at ``at``, default last): the layer index."""
    closed = as_closed(jaxpr)
    avals = [v.aval for v in closed.jaxpr.invars]
    at = len(avals) if at is None else at
    in_avals = [*avals[:at], core.ShapedArray((), np.dtype(np.int32)), *avals[at:]]

    def fn(*args: Any) -> list[Any]:
        idx = args[at]
        rest = [*args[:at], *args[at + 1 :]]
        return _eval(closed.jaxpr, closed.consts, rest, idx)

    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=_DEBUG), in_avals)
    return ClosedJaxpr(jaxpr, consts)


def _open(closed: ClosedJaxpr) -> tuple[core.Jaxpr, list[Any]]:
    return pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def _eval(jaxpr: core.Jaxpr, consts: Any, args: list[Any], idx: Any) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = _eval_eqn(eqn, invals, idx)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn: Any, invals: list[Any], idx: Any) -> list[Any]:
    p, params = eqn.primitive, eqn.params
    if p is layer_index_p:
        return [idx]
    if p is loops.scan_p or not any(_holds(j)[0] for j in _jaxprs_in(params)):
        return bind_eqn(eqn, invals)
    if p is pjit.jit_p or p is core.closed_call_p:
        sub = params["jaxpr"] if p is pjit.jit_p else params["call_jaxpr"]
        return _eval(sub.jaxpr, sub.consts, invals, idx)
    if p.name in ("custom_jvp_call", "custom_vjp_call"):  # AD is done: the primal function
        sub = params["call_jaxpr"]
        return _eval(sub.jaxpr, sub.consts, invals, idx)
    if p is ad_checkpoint.remat_p:
        body, consts = _open(_with_index(params["jaxpr"]))
        prevent_cse = params["prevent_cse"]
        if isinstance(prevent_cse, tuple):
            prevent_cse = (*[False] * len(consts), *prevent_cse, False)
        return list(
            p.bind(*consts, *invals, idx, **dict(params, jaxpr=body, prevent_cse=prevent_cse))
        )
    if p is conditionals.cond_p:
        branches = tuple(_with_index(b) for b in params["branches"])
        return list(p.bind(invals[0], *invals[1:], idx, **dict(params, branches=branches)))
    if p is loops.while_p:
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        cond_j = _with_index(params["cond_jaxpr"], cn)
        body_j = _with_index(params["body_jaxpr"], bn)
        cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        new = dict(
            params, cond_jaxpr=cond_j, body_jaxpr=body_j, cond_nconsts=cn + 1, body_nconsts=bn + 1
        )
        return list(p.bind(*cconsts, idx, *bconsts, idx, *init, **new))
    raise HookaxError(
        f"hookax: a one-layer selection inside {p.name!r} inside a scan is not supported. Fix: "
        "select the call site without a layer suffix, or move it out of that transform."
    )


# ---- the scan lowering -----------------------------------------------------------------------

_LOCK = threading.Lock()
_INSTALLED: list[Any] = []


def _install() -> None:
    """Wrap scan's lowering once, on the first one-layer selection (invisible until then)."""
    if _INSTALLED:
        return
    with _LOCK:
        if _INSTALLED:
            return
        original = mlir._lowerings[loops.scan_p]
        with_iota = mlir.lower_fun(_scan_with_iota, multiple_results=True)

        def rule(ctx: Any, *args: Any, jaxpr: Any, length: int, **params: Any) -> Any:
            found, wanted = _holds(jaxpr)
            if not found:
                return original.rule(ctx, *args, jaxpr=jaxpr, length=length, **params)
            bad = [i for i in wanted if not 0 <= i < length]
            if bad:
                raise HookaxError(
                    f"hookax: layer {bad[0]} selected, but the scan that runs the call site "
                    f"has {counted(length, 'layer')} (0 to {length - 1}). Fix: pick an index "
                    f"below {length}."
                )
            body = _with_index(jaxpr)
            return with_iota(ctx, *args, jaxpr=body, length=length, **params)

        mlir.register_lowering(loops.scan_p, rule, inline=original.inline)
        _INSTALLED.append(original)


def _scan_with_iota(*args: Any, jaxpr: Any, length: int, **params: Any) -> Any:
    iota = jax.lax.iota(np.int32, length)
    p = scan_params(dict(params, length=length), jaxpr, xs=1)
    return loops.scan_p.bind(*args, iota, **p)
