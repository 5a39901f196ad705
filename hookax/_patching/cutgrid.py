"""A grid's rows as the suffix of one traced forward: what a hand-written grid does.

``hx.patch_grid`` over call sites otherwise runs, for each target, the whole patched forward
vmapped over the patches: with ``n`` targets in a stack of ``n`` layers, ``n`` forwards traced
and compiled. Here the corrupted forward is traced once, with each target's output marked (an
identity primitive, ``hookax_cut``); the program computes that forward once, and each row runs,
vmapped over the patches, only the operations after its target that depend on it, reading
everything else from the one forward. The values are the same (the same operations on the same
inputs); the program is the size of the hand-written one (a forward, then each suffix).

It applies to call sites (their outputs, or their inputs: ``":in"``) and operations (``ops=``),
with or without ``heads=``, where the marks
are plain operations of the traced program (not inside a scan, a ``jit`` call or another
transform of the model) and each target runs once with one array as its value; otherwise
:func:`rows` returns None and the grid runs as before.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp

from .._capture.ops import intercept_op
from .._hooks.intercept import intercept
from .._util.jaxcompat import (
    bind_eqn,
    closed_parts,
    core,
    jaxprs_in_params,
    mesh_context,
    to_context_mesh,
)
from . import targets
from .heads import patch_mask
from .targets import cut_p

__all__ = ["delta_program", "eligible", "marks", "rows", "trace", "with_deltas"]


def eligible(keys: Sequence[str], ops: Sequence[str]) -> bool:
    """Whether the targets could be cut (checked again on the traced program): no layer of a
    scanned stack, call sites' whole outputs or inputs (``":in"``: the one positional
    argument), not a part."""
    sites = [k for k in keys if k not in ops]
    return bool(keys) and all("[" not in k for k in keys) and all("." not in k for k in sites)


def _marker(sites: Sequence[str]) -> Callable[..., Any]:
    """An interceptor marking the targets among ``sites``: a call's output, or its one
    positional argument for ``"key:in"`` (what patching an input replaces)."""
    inputs = frozenset(k[: -len(":in")] for k in sites if k.endswith(":in"))
    outputs = frozenset(k for k in sites if not k.endswith(":in"))

    def mark(next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: Any) -> Any:
        key = context.key
        if key in inputs and len(args) == 1 and isinstance(args[0], jax.Array):
            args = (cut_p.bind(args[0], key=key + ":in"),)
        out = next_fun(*args, **kwargs)
        if key in outputs and isinstance(out, jax.Array):
            out = cut_p.bind(out, key=key)
        return out

    return mark


def _mark_op(value: Any, op: Any) -> Any:
    return cut_p.bind(value, key=op.address) if isinstance(value, jax.Array) else None


def rows(
    forward: targets.Forward,
    keys: tuple[str, ...],
    values: dict[str, Any] | None,
    patches: tuple[Any, Any],
    axis: int,
    heads: int | None,
    metric: Callable[[Any], Any],
) -> Any | None:
    """Every target's row (``[len(keys), n_patches, ...]``) for ``patches`` (``(columns,
    heads)``, either None, a leading axis on those given), or None where the program does not
    have the shape this needs. ``forward``: the forward with the targets marked
    (``targets.forward``'s, or :func:`trace`'s). ``values`` None: the targets' clean values are
    read from that forward run on its clean inputs."""
    closed, out_tree, flat, clean_flat = forward
    jaxpr, consts = closed_parts(closed)
    at = marks(jaxpr, keys)
    if at is None:
        return None
    if values is None:
        if clean_flat is None:
            return None
        clean_env = _run(jaxpr, consts, clean_flat)  # the clean forward, the same program
        values = {key: (clean_env[jaxpr.eqns[at[key]].outvars[0]],) for key in keys}
    for key in keys:
        (v,) = jaxpr.eqns[at[key]].outvars
        got = values[key]
        if len(got) != 1 or tuple(got[0].shape) != tuple(v.aval.shape):
            return None

    env = _run(jaxpr, consts, flat)  # the corrupted forward, once
    out: list[Any] = []
    for key in keys:
        i = at[key]
        (v,) = jaxpr.eqns[i].outvars
        clean = values[key][0].astype(v.aval.dtype)
        after = _dependents(jaxpr, i, v)

        def row(
            col: Any,
            head: Any,
            v: Any = v,
            clean: Any = clean,
            after: list[int] = after,
            ctx: Any = jaxpr.eqns[i].ctx,
        ) -> Any:
            # in the target's mesh context (Auto axes inside an ``auto_axes`` body)
            with mesh_context(ctx):
                clean_here = to_context_mesh(clean)
                mask = patch_mask(col, head, v.aval.shape, axis, heads, "")
                patched = clean_here if mask is None else jnp.where(mask, clean_here, env[v])
            local = {v: patched}
            for j in after:
                eqn = jaxpr.eqns[j]
                invals = [_read(x, local, env) for x in eqn.invars]
                for o, x in zip(eqn.outvars, _bind(eqn, invals), strict=True):
                    local[o] = x
            outs = [_read(x, local, env) for x in jaxpr.outvars]
            return metric(jax.tree.unflatten(out_tree, outs))

        if out:  # one row after the other: a chunk's temporaries, not every row's, are live
            patches, _ = jax.lax.optimization_barrier((patches, out[-1]))
        if all(p is None for p in patches):
            out.append(row(None, None))
        else:
            in_axes = tuple(None if p is None else 0 for p in patches)
            out.append(jax.vmap(row, in_axes=in_axes)(*patches))
    return jnp.stack(out)


def marks(jaxpr: Any, keys: Sequence[str]) -> dict[str, int] | None:
    """``{key: index of its mark}`` in ``jaxpr``, or None unless each of ``keys`` is marked
    exactly once, among the program's own operations (not inside an inner program)."""
    at: dict[str, int] = {}
    wanted = set(keys)
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is cut_p and eqn.params["key"] in wanted:
            key = eqn.params["key"]
            if key in at:
                return None  # it runs more than once
            at[key] = i
    if set(at) != wanted or _nested_cut(jaxpr, wanted):
        return None
    return at


def with_deltas(forward: targets.Forward, deltas: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(output, marked values)`` of one run of ``forward`` on its (corrupted) inputs with
    ``deltas[key]`` added to the value marked ``key``: the gradient with respect to a delta is
    the gradient with respect to that value. The run is one ``jax.jit`` call of a function kept
    with the program (:func:`delta_program`): traced once per set of deltas, and JAX's
    derivatives of it (linearized and transposed) are cached with its program, so a second
    gradient over the same forward differentiates the metric only."""
    run, _ = delta_program(forward.program)
    outs, got = run(forward.flat, deltas)
    return jax.tree.unflatten(forward.out_tree, outs), got


# A forward's program -> (its replay with deltas, the marks deltas may be added at)
_DELTAS: weakref.WeakKeyDictionary[Any, tuple[Callable[..., Any], dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)


def delta_program(closed: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``(run, marks)``: ``run(flat, deltas)`` is ``closed`` run on ``flat`` with ``deltas[key]``
    added to the value marked ``key``, returning ``(outputs, {key: marked value})`` for the keys
    of ``deltas``, as a ``jax.jit`` function kept while ``closed`` lives; ``marks``: each float
    value marked once among the program's own operations, ``{key: its aval}``."""
    got = _DELTAS.get(closed)
    if got is not None:
        return got
    jaxpr, consts = closed_parts(closed)
    cuts = [e for e in jaxpr.eqns if e.primitive is cut_p]
    seen = Counter(e.params["key"] for e in cuts)
    marked = {
        e.params["key"]: e.invars[0].aval
        for e in cuts
        if seen[e.params["key"]] == 1 and jnp.issubdtype(e.invars[0].aval.dtype, jnp.inexact)
    }
    nested = {k for k in marked if _nested_cut(jaxpr, {k})}
    marked = {k: a for k, a in marked.items() if k not in nested}

    def replay(flat: list[Any], deltas: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        values: dict[str, Any] = {}

        def add(key: str, v: Any) -> Any:
            if key not in deltas:
                return v
            values[key] = v
            return v + deltas[key]

        env = _run(jaxpr, consts, flat, add)
        return [_read(x, {}, env) for x in jaxpr.outvars], values

    got = (jax.jit(replay), marked)
    _DELTAS[closed] = got
    return got


def trace(
    fn: Any,
    args: tuple[Any, ...],
    keys: tuple[str, ...],
    ops: tuple[str, ...],
    clean_args: tuple[Any, ...] | None = None,
) -> targets.Forward | None:
    """``fn(*args)`` traced with the targets marked (the clean run's inputs ``clean_args``,
    where they have the structure of ``args``), or None where it cannot be traced so."""
    flat, in_tree = jax.tree.flatten(args)
    sites = [k for k in keys if k not in ops]

    def forward(*xs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            if sites:
                stack.enter_context(intercept(_marker(sites), where=targets.selector(sites)))
            if ops:
                stack.enter_context(intercept_op(_mark_op, ops=list(ops)))
            return fn(*jax.tree.unflatten(in_tree, xs))

    try:
        closed, shape = jax.make_jaxpr(forward, return_shape=True)(*flat)
    except Exception:  # a model this cannot trace so: the grid as before, which says why
        return None
    clean_flat = None
    if clean_args is not None:
        leaves, clean_tree = jax.tree.flatten(clean_args)
        clean_flat = leaves if clean_tree == cast(Any, in_tree) else None
    return targets.Forward(closed, jax.tree.structure(shape), flat, clean_flat)


def _nested_cut(jaxpr: Any, keys: set[str]) -> bool:
    def inside(j: Any) -> bool:
        return any(
            (e.primitive is cut_p and e.params["key"] in keys)
            or any(inside(s) for s in jaxprs_in_params(e.params))
            for e in j.eqns
        )

    return any(inside(s) for e in jaxpr.eqns for s in jaxprs_in_params(e.params))


def _dependents(jaxpr: Any, start: int, var: Any) -> list[int]:
    """The equations after ``start`` that read ``var``, directly or not."""
    live = {var}
    out = []
    for j in range(start + 1, len(jaxpr.eqns)):
        eqn = jaxpr.eqns[j]
        if any(not isinstance(x, core.Literal) and x in live for x in eqn.invars):
            out.append(j)
            live.update(eqn.outvars)
    return out


def _read(x: Any, local: dict[Any, Any], env: dict[Any, Any]) -> Any:
    if isinstance(x, core.Literal):
        return x.val
    return local[x] if x in local else env[x]


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
    return invals if eqn.primitive is cut_p else bind_eqn(eqn, invals)


def _run(
    jaxpr: Any,
    consts: list[Any],
    args: list[Any],
    at_mark: Callable[[str, Any], Any] | None = None,
) -> dict[Any, Any]:
    """Every variable's value in one run of ``jaxpr``; ``at_mark(key, value)``, where given,
    gives each marked value (``cut_p``'s input) its value from there on."""
    env: dict[Any, Any] = dict(
        zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True)
    )
    for eqn in jaxpr.eqns:
        invals = [x.val if isinstance(x, core.Literal) else env[x] for x in eqn.invars]
        if at_mark is not None and eqn.primitive is cut_p:
            invals = [at_mark(eqn.params["key"], invals[0])]
        for o, x in zip(eqn.outvars, _bind(eqn, invals), strict=True):
            env[o] = x
    return env
