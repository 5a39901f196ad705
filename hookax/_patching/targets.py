"""Patch targets: which call sites a grid's ``where=`` names, their outputs, and the columns.

``discover`` runs the function abstractly under an ``hx.intercept`` that records every call
site's key and output shape (a scanned call site's output is one layer's), in call order.
``expand`` turns ``where=`` (keys or path globs, ``"path:method"`` for a method other than
``__call__``) into keys in that order; ``columns`` turns ``positions=`` into the patches of one
row.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._engine.eager import jax_functions_at_defaults
from .._engine.select import (
    CALL_ONLY,
    Select,
    as_selector,
    check_glob,
    glob_to_regex,
    split_layers,
    split_method,
)
from .._hooks.intercept import Entry, intercept, scoped
from .._util.errors import SelectorError
from .._util.fnkey import FnKey
from .._util.jaxcompat import closed_parts, core, mlir, trace_context
from .._util.parts import leaf_at, parts, split_part, unwrap_sole
from .._util.specs import Shown, describe, describe_flat
from . import compiled
from .patch import PatchError, position_mask, split_input

__all__ = [
    "Forward",
    "Target",
    "columns",
    "cut_p",
    "discover",
    "expand",
    "forward",
    "selector",
    "where_keys",
]

Target = tuple[str, str, bool]  # (path glob, method, whether the call's input is the target)
_SHAPES: dict[Any, Found] = {}

# A mark on a value in a traced forward (the identity): where a patch goes in (``cutgrid``).
cut_p = core.Primitive("hookax_cut")
cut_p.def_impl(lambda x, *, key: x)
cut_p.def_abstract_eval(lambda x, *, key: x)
mlir.register_lowering(cut_p, lambda ctx, x, *, key: [x])


class Found(dict[str, list[Any]]):
    """What :func:`discover` found: ``{key: [output spec per call]}``, and in ``nested`` the
    keys of the call sites called inside a transform within ``fn`` (a scan, a vmap, a remat,
    a jitted function): their values live in that transform's trace. ``forward``: the traced
    program of ``fn(*args)`` over ``dyn``'s arrays, with each call at ``fn``'s own level marked
    (``cutgrid.cut_p``: its output, and its one positional array argument as ``"key:in"``),
    its output tree, and the trace context it was traced in."""

    nested: frozenset[str] = frozenset()
    forward: tuple[Any, Any, Any] | None = None


def parse(where: Any, who: str) -> list[Target]:
    """``where=`` as ``(path glob, method)`` pairs; a malformed one raises here."""
    items = [where] if isinstance(where, str) else where
    if not isinstance(items, list | tuple) or not items:
        raise SelectorError(
            f"{who}: where= takes a call-site key, a path glob or a list of them, got "
            f"{where!r}. Fix: where='layers/*' or where=['layers/0', 'layers/1/mlp']."
        )
    out = []
    for item in items:
        if not isinstance(item, str):
            raise SelectorError(f"{who}: where= entries are strings like 'layers/3', got {item!r}.")
        site, is_input = split_input(item)  # "blocks/1:in": the input of "blocks/1"
        path, method = split_method(site)
        if path:
            check_glob(split_layers(split_part(path)[0])[0])  # "blocks/mlp[3]": a layer
        out.append((path, method or "__call__", is_input))
    return out


def site_key(key: str) -> str:
    """The key of the call site a target key is a value of (``"layers/1.0:in"`` ->
    ``"layers/1"``)."""
    return split_part(split_input(key)[0])[0]


def plain(keys: list[str], found: Found) -> bool:
    """Whether every target is a call site called at ``fn``'s own trace level (inside no
    transform within it), so a plain interceptor can hand its values out (:func:`recorded`)."""
    return all(site_key(k) in found and site_key(k) not in found.nested for k in keys)


def recorded(fn: Any, keys: list[str]) -> Callable[..., Any]:
    """``hx.capture`` of the call sites ``keys`` (their inputs for ``"key:in"``), for targets
    that are :func:`plain`: an interceptor keeps each call's value, without capture's tracing
    of every operation (which carries values out of transforms)."""
    outs = {site_key(k) for k in keys if not split_input(k)[1]}
    ins = {site_key(k) for k in keys if split_input(k)[1]}

    def run(*fn_args: Any, **fn_kwargs: Any) -> tuple[Any, dict[str, tuple[Any, ...]]]:
        acts: dict[str, list[Any]] = {}

        def keep(
            next_fun: Callable[..., Any], args: tuple, kwargs: dict[str, Any], context: Any
        ) -> Any:
            key = context.key
            if key in ins:
                acts.setdefault(f"{key}:in", []).append(args[0] if len(args) == 1 else args)
            out = next_fun(*args, **kwargs)
            if key in outs:
                acts.setdefault(key, []).append(out)
            return out

        with intercept(keep):
            y = fn(*fn_args, **fn_kwargs)
        return y, {k: tuple(v) for k, v in acts.items()}

    return run


def selector(keys: list[str]) -> Any:
    """A selector picking exactly these call-site keys (for ``hx.capture``)."""
    sel: Any = None
    for key in dict.fromkeys(split_part(split_input(k)[0])[0] for k in keys):
        path, method = split_method(key)  # "layers/1.0": the call site "layers/1"
        one = Select(paths=path, methods=method or "__call__")
        sel = one if sel is None else sel | one
    return sel


def discover(dyn: list[Any], rest: Any) -> Found:
    """``{key: [output ShapeDtypeStruct per call]}`` of every call site ``fn(*args)`` runs,
    keys in the order of their first call (found abstractly; cached by structure and shapes);
    ``dyn, rest = compiled.split((fn, args))``, which the caller also compiles with."""
    cache_key = (rest, compiled.avals(dyn))
    hit = _SHAPES.get(cache_key)
    if hit is not None:
        return hit
    found = Found()
    top: list[Any] = []
    nested: set[str] = set()

    def record(
        next_fun: Callable[..., Any], args: tuple, kwargs: dict[str, Any], context: Any
    ) -> Any:
        key = context.key
        calls = found.setdefault(key, [])  # keys in the order their first call started
        found.setdefault(f"{key}:in", []).append(_spec(args[0] if len(args) == 1 else args))
        mark = core.trace_ctx.trace is top[0]
        if not mark:
            nested.add(key)
        elif len(args) == 1 and isinstance(args[0], core.Tracer):  # (a constant stays one)
            args = (cut_p.bind(args[0], key=f"{key}:in"),)
        out = next_fun(*args, **kwargs)
        calls.append(_spec(out))
        return cut_p.bind(out, key=key) if mark and isinstance(out, core.Tracer) else out

    def run(dyn: list[Any]) -> Any:
        top[:] = [core.trace_ctx.trace]
        f, a = compiled.join(dyn, rest)
        with jax_functions_at_defaults(), intercept(record):
            return f(*a)

    context = trace_context()
    closed, shape = jax.make_jaxpr(run, return_shape=True)(dyn)
    found.nested = frozenset(nested)
    if not any(isinstance(c, core.Tracer) for c in closed_parts(closed)[1]):  # kept: no tracer
        found.forward = (closed, jax.tree.structure(shape), context)
    if len(_SHAPES) > 64:
        _SHAPES.clear()
    _SHAPES[cache_key] = found
    return found


class Forward(NamedTuple):
    """A traced forward with its targets marked (``cut_p``), and what to run it on."""

    program: Any  # a closed jaxpr
    out_tree: Any
    flat: list[Any]  # its inputs for the corrupted run
    clean_flat: list[Any] | None  # ... for the clean run; None where not known or not fitting


def forward(
    dyn: list[Any],
    rest: Any,
    keys: Sequence[str],
    clean_dyn: list[Any] | None = None,
    clean_rest: Any = None,
) -> Forward | None:
    """``fn(*args)`` as :func:`discover` traced it (:attr:`Found.forward`), where it was traced
    in this trace context and no call of the call sites ``keys`` name ran inside a transform
    (unmarked); else None. ``clean_dyn, clean_rest``: the clean run's, as :func:`compiled.split`
    cuts them (its inputs where its rest is ``rest``)."""
    found = _SHAPES.get((rest, compiled.avals(dyn)))
    if found is None or found.forward is None:
        return None
    if any(site_key(k) in found.nested for k in keys):
        return None
    closed, tree, context = found.forward
    try:
        same = bool(context == trace_context())
    except Exception:  # a context value that does not compare
        same = False
    if not same:
        return None
    fits = clean_dyn is not None and clean_rest == rest
    return Forward(closed, tree, jax.tree.leaves(dyn), jax.tree.leaves(clean_dyn) if fits else None)


def _spec(value: Any) -> Any:
    value = unwrap_sole(value)  # a NamedArray: its array
    if _is_array(value):
        return jax.ShapeDtypeStruct(value.shape, value.dtype)
    return _Other(value)


def expand(targets: list[Target], found: dict[str, list[Any]], who: str) -> list[str]:
    """The keys ``targets`` name, in call order within each; one that names none raises."""
    keys: list[str] = []
    sites = {k: v for k, v in found.items() if not split_input(k)[1]}
    for asked, asked_method, is_input in targets:
        target, method, part = asked, asked_method, ""
        hits = _hits(target, method, sites)
        if not hits and not is_input:  # "decoder/layers_1.0": an array inside the output
            (target, part), (method, tail) = split_part(asked), split_part(asked_method)
            part = part or tail
            hits = _hits(target, method, sites) if part else []
        if not hits:
            text = asked if asked_method == "__call__" else f"{asked}:{asked_method}"
            text += ":in" if is_input else ""
            ran = [f"{k}:in" for k in sites] if is_input else list(sites)
            near = difflib.get_close_matches(text, ran, n=6, cutoff=0.0) or ran[:6]
            raise SelectorError(
                f"{who}: where={text!r} matched no call site; those that ran include "
                f"{', '.join(repr(k) for k in near)}. Fix: use a key as hx.capture names it."
            )
        layers = split_layers(target)[1]
        if layers is not None:  # one key per layer, the way hx.capture names them
            hits = [_layer_key(k, i) for k in hits for i in sorted(layers)]
        if is_input:
            hits = [f"{k}:in" for k in hits]
        keys += [k + part for k in hits if k + part not in keys]
    return keys


def _hits(target: str, method: str, found: dict[str, list[Any]]) -> list[str]:
    """The keys of ``found`` that the path glob ``target`` and ``method`` name."""
    path = split_layers(target)[0]
    rx = glob_to_regex(path) if path else None
    return [
        k
        for k in found
        if (k.partition(":")[2] or "__call__") == method
        and (rx.fullmatch(k.partition(":")[0]) if rx else k.partition(":")[0] == "")
    ]


def values_of(acts: dict[str, Any], key: str) -> Any:
    """A target's values in ``acts`` (keyed by call site): a part's arrays for ``"key.0"``."""
    if key in acts:
        return tuple(unwrap_sole(v) for v in acts[key])
    site, part = split_part(key)
    return tuple(unwrap_sole(leaf_at(v, part)) for v in acts[site])


def _layer_key(key: str, layer: int) -> str:
    """``"blocks/mlp"`` -> ``"blocks/mlp[3]"``; ``"enc:encode"`` -> ``"enc[3]:encode"``."""
    path, sep, method = key.partition(":")  # a call-site key: no layer suffix yet
    return f"{path}[{layer}]{sep}{method}"


def site_of(key: str) -> str:
    """The key ``found`` holds a target key under: its layer suffix dropped (``":in"`` kept)."""
    site, is_input = split_input(key)
    path, method = split_method(site)
    return split_layers(path)[0] + (f":{method}" if method else "") + (":in" if is_input else "")


class _Other:
    """A call site's output that is not one array, shown as its structure (``(None,
    f32[1,8,32])``: a block returning ``(cache, x)``). Described only when it is a target:
    the outputs of the other call sites are never handed to their classes' code."""

    def __init__(self, out: Any) -> None:
        leaves, self.treedef = jax.tree.flatten(out)
        self.leaves = [
            jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_array(x) else Shown(x) for x in leaves
        ]
        self.parts = {p: leaf for p, leaf in parts(jax.tree.unflatten(self.treedef, self.leaves))}

    def __repr__(self) -> str:
        return describe_flat(self.treedef, self.leaves)

    def arrays(self, key: str) -> str:
        """Its arrays as targets: ``'layers/1.0' (f32[1,5,8])``."""
        return ", ".join(
            f"{key + p!r} ({describe(v)})"
            for p, v in self.parts.items()
            if isinstance(v, jax.ShapeDtypeStruct)
        )


def _part_spec(spec: Any, key: str, part: str, who: str) -> Any:
    """The spec of the array ``part`` names in a call's output ``spec``."""
    site = key[: len(key) - len(part)]
    leaf = spec.parts.get(part) if isinstance(spec, _Other) else None
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        arrays = spec.arrays(site) if isinstance(spec, _Other) else repr(site)
        raise PatchError(
            f"{who}: {key!r} names no array in the output of call site {site!r}, "
            f"{spec!r}. Fix: name one of its arrays: {arrays}."
        )
    return leaf


def _is_array(x: Any) -> bool:
    return isinstance(getattr(x, "shape", None), tuple) and hasattr(x, "dtype")


def out_spec(key: str, found: dict[str, list[Any]], who: str) -> Any:
    """The output (or input, for ``"key:in"``) shape of ``key``'s first call; its calls must
    all have one array shape. ``"layers/1.0"`` names an array inside the output."""
    site, is_input = split_input(key)
    where, part = site_of(key), ""
    if where not in found and not is_input:  # "layers/1.0": inside the output of "layers/1"
        base, part = split_part(key)
        where = site_of(base)
    specs = found[where]
    if is_input:
        what, fix = f"the input of call site {site!r} is", "Fix: target the output of its caller."
    else:
        what = f"call site {key!r} returns"
        fix = (
            "Fix: target a call site inside it that returns one array, or an operation with "
            "ops= (hx.ops lists them; a block's residual stream is its last add)."
        )
    if part:
        specs = [_part_spec(s, key, part, who) for s in specs]
    other = next((s for s in specs if isinstance(s, _Other)), None)
    if other is not None:
        arrays = other.arrays(key)
        name = f"Fix: name the array inside it: {arrays}; or target" if arrays else "Fix: target"
        raise PatchError(
            f"{who}: {what} {other!r}, not one array; a patching target must be one array. "
            f"{name}{fix.removeprefix('Fix: target')}"
        )
    if any(s.shape != specs[0].shape for s in specs):
        raise PatchError(
            f"{who}: {what} arrays of different shapes at its calls "
            f"({', '.join(describe(s) for s in specs)}); a patching target has one "
            f"shape at every call. {fix}"
        )
    return specs[0]


def columns(positions: Any, axis: int, shapes: dict[str, Any], who: str) -> Any:
    """The patches of one row: ``None`` (one patch, whole outputs) or an array whose leading
    axis enumerates them, each an index or a mask as [`hx.patching`][hookax.patching] takes it."""
    if positions is None:
        return None
    if isinstance(positions, str):
        if positions != "each":
            raise PatchError(
                f"{who}: positions= takes 'each', None or an array of patches, got {positions!r}."
            )
        sizes = {}
        for key, spec in shapes.items():
            _check_patch((), np.dtype(np.int32), tuple(spec.shape), axis, key)  # the axis
            sizes[key] = spec.shape[axis % len(spec.shape)]
        if len(set(sizes.values())) != 1:
            raise PatchError(
                f"{who}: positions='each' needs the same number of positions along axis "
                f"{axis} in every target, got {sizes}. Fix: patch targets of one kind per grid."
            )
        # Host arrays: patches cut and tiled without compiling a program for each operation.
        return np.arange(next(iter(sizes.values())), dtype=np.int32)
    cols: Any
    if isinstance(positions, jax.Array):
        cols = positions
    else:
        cols = np.asarray(positions)
        if cols.dtype == object:  # ragged: JAX's own error
            cols = jnp.asarray(positions)
        cols = cols.astype(jax.dtypes.canonicalize_dtype(cols.dtype))
    if cols.ndim < 1 or cols.shape[0] == 0:
        raise PatchError(
            f"{who}: positions= as an array has one patch per entry along its first axis "
            f"(indices, or masks), got shape {tuple(cols.shape)}."
        )
    for key, spec in shapes.items():  # every patch fits every target (checks shapes early)
        _check_patch(tuple(cols.shape[1:]), np.dtype(cols.dtype), tuple(spec.shape), axis, key)
    return cols


@functools.lru_cache(maxsize=1024)
def _check_patch(
    col_shape: tuple[int, ...], col_dtype: Any, shape: tuple[int, ...], axis: int, key: str
) -> None:
    """Whether a patch of ``col_shape`` fits a value of ``shape`` (raises if not), abstractly:
    no program; each combination checked once (a warm call pays a lookup, not a trace)."""
    col = jax.ShapeDtypeStruct(col_shape, col_dtype)
    jax.eval_shape(lambda c: position_mask(c, shape, axis, key), col)


def where_keys(
    where: Any, fn: Any, args: tuple[Any, ...], found: dict[str, list[Any]], who: str
) -> list[str]:
    """The target keys of any ``where=`` (the grammar of every ``where=``): a string is a key or
    a path glob (:func:`parse`, :func:`expand`); a class, a callable or an ``hx.Select`` picks
    the call sites it matches, in call order; a list is its entries' targets, in its order."""
    items = where if isinstance(where, list | tuple) and not _classes(where) else [where]
    if all(isinstance(item, str) for item in items):
        return expand(parse(where, who), found, who)
    keys: list[str] = []
    for item in items:
        if isinstance(item, str):
            got = expand(parse(item, who), found, who)
        else:
            got = _matched(fn, args, as_selector(item, CALL_ONLY), item, found, who)
        keys += [k for k in got if k not in keys]
    return keys


def _classes(where: Any) -> bool:
    return bool(where) and all(isinstance(w, type) for w in where)


_MATCHED: dict[Any, list[str]] = {}


def _matched(
    fn: Any, args: tuple[Any, ...], sel: Any, item: Any, found: dict[str, list[Any]], who: str
) -> list[str]:
    """The keys of the call sites ``sel`` picks, in call order (abstractly; cached like
    :func:`discover`); one layer of a scanned stack as ``hx.capture`` names it."""
    dyn, rest = compiled.split((fn, args))
    cache_key = (rest, compiled.avals(dyn), sel)
    hit = _MATCHED.get(cache_key)
    if hit is None:
        hit = []

        def record(next_fun: Callable[..., Any], a: tuple, k: dict[str, Any], ctx: Any) -> Any:
            layers = sel.layers(ctx) if sel.has_layers() else None
            for key in (
                [ctx.key] if layers is None else [_layer_key(ctx.key, i) for i in sorted(layers)]
            ):
                if key not in hit:
                    hit.append(key)
            return next_fun(*a, **k)

        def run(dyn: list[Any]) -> Any:
            f, a = compiled.join(dyn, rest)
            with scoped(Entry("intercept", FnKey(record), sel)):
                return f(*a)

        jax.eval_shape(run, dyn)
        if len(_MATCHED) > 64:
            _MATCHED.clear()
        _MATCHED[cache_key] = hit
    if not hit:
        near = list(found)[:6]
        raise SelectorError(
            f"{who}: where={item!r} matched no call site; those that ran include "
            f"{', '.join(repr(k) for k in near)}. Fix: use a key as hx.capture names it, or a "
            "selector that matches one of them."
        )
    return hit
