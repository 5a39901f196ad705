"""How :func:`hookax.summary` sees a Flax NNX model: call sites, parameters and FLOPs.

Everything here is abstract. The model is split into a graph definition and a state of
``jax.ShapeDtypeStruct``\\ s, merged again inside ``jax.jit(...).lower`` (which traces, never runs
or allocates), and an interceptor records every call site while that trace runs. The FLOPs of one
call site come from XLA's own cost analysis of that call site's method lowered alone on abstract
inputs; identical call sites (same module structure and configuration, same input shapes) share
one lowering, so the 32 blocks of a 7B decoder cost one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax

from . import _context
from ._intercept import intercept
from ._specs import describe

__all__ = ["Record", "Site", "abstract", "lower_flops", "param_table", "trace_calls"]

_NOTE = "__hookax_summary_noted__"


def abstract(tree: Any) -> Any:
    """Every array-like leaf of ``tree`` as a ``ShapeDtypeStruct``; other leaves unchanged."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_array(x) else x, tree
    )


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


@dataclasses.dataclass
class Flat:
    """A pytree of arguments split into abstract array leaves and static (closed-over) leaves."""

    treedef: Any
    dynamic: list[Any]  # ShapeDtypeStructs, in leaf order
    static: list[tuple[int, Any]]  # (leaf index, value) of the other leaves

    @classmethod
    def of(cls, tree: Any) -> Flat:
        leaves, treedef = jax.tree.flatten(tree)
        dynamic = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves if _is_array(x)]
        static = [(i, x) for i, x in enumerate(leaves) if not _is_array(x)]
        return cls(treedef, dynamic, static)

    def rebuild(self, dynamic: list[Any]) -> Any:
        leaves: list[Any] = list(dynamic)
        for i, x in self.static:
            leaves.insert(i, x)
        return jax.tree.unflatten(self.treedef, leaves)

    def cache_key(self) -> Hashable:
        return (
            self.treedef,
            tuple((x.shape, x.dtype) for x in self.dynamic),
            tuple(self.static),
        )


@dataclasses.dataclass
class Site:
    """What it takes to lower one call site alone: module structure, abstract state, arguments."""

    graphdef: Any
    state: Any
    method: str
    args: Flat

    def cache_key(self) -> Hashable | None:
        key = (
            self.graphdef,
            self.method,
            jax.tree.structure(self.state),
            tuple((x.shape, x.dtype) for x in jax.tree.leaves(self.state)),
            self.args.cache_key(),
        )
        try:
            hash(key)
        except TypeError:
            return None
        return key


@dataclasses.dataclass
class Record:
    """One call site seen while tracing, in call order."""

    key: str
    path: tuple[Any, ...]
    type: str
    method: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...] = ()
    site: Site | None = None


def _describe_tree(tree: Any) -> tuple[str, ...]:
    return tuple(describe(x) for x in jax.tree.leaves(tree))


def _site(module: Any, method: str, args: tuple, kwargs: dict) -> Site | None:
    from flax import nnx

    try:
        graphdef, state = nnx.split(module)
        return Site(graphdef, abstract(state), method, Flat.of((args, kwargs)))
    except Exception:  # a call site NNX cannot split here: no FLOPs for it, nothing else lost
        return None


class _Recorder:
    """The interceptor that records each call site (entry order is call order)."""

    def __init__(self, site: Callable[..., Site | None] | None = None) -> None:
        self.records: list[Record] = []
        self.site = site or _site  # how to cut one call site out (per framework)

    def __call__(
        self, next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: _context.Context
    ) -> Any:
        rec = Record(
            key=context.key,
            path=tuple(context.path),
            type=type(context.module).__name__,
            method=context.method,
            inputs=_describe_tree((args, kwargs)),
        )
        if self.records:  # the root call's FLOPs come from lowering the whole call
            rec.site = self.site(context.module, context.method, args, kwargs)
        self.records.append(rec)
        try:
            out = next_fun(*args, **kwargs)
        except Exception as e:
            _note_rejection(e, rec)
            raise
        rec.outputs = _describe_tree(out)
        return out


def _note_rejection(e: Exception, rec: Record) -> None:
    """Name the innermost call site that raised, and what it received (read by the CLI)."""
    if getattr(e, _NOTE, False):
        return
    try:
        setattr(e, _NOTE, True)
    except Exception:  # pragma: no cover - exceptions without a __dict__
        return
    shown = ", ".join(rec.inputs) or "no arguments"
    e.add_note(
        f"hookax.summary: call site {rec.key!r} ({rec.type}.{rec.method}) rejected its "
        f"input {shown}"
    )


def rejection(e: BaseException) -> str | None:
    """The call site that raised ``e`` (and its input, where summary saw it), from the notes."""
    notes = getattr(e, "__notes__", ())
    for note in notes:
        if note.startswith("hookax.summary: "):
            return note.removeprefix("hookax.summary: ")
    for note in notes:
        if note.startswith("hookax: raised in "):
            return note.removeprefix("hookax: raised in ")
    return None


def trace_calls(model: Any, args: tuple, kwargs: dict) -> tuple[list[Record], Any]:
    """Trace ``model(*args, **kwargs)`` abstractly; the call sites and the lowered whole call."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    flat = Flat.of((args, kwargs))

    def forward(state: Any, dynamic: list[Any]) -> Any:
        a, k = flat.rebuild(dynamic)
        return nnx.merge(graphdef, state)(*a, **k)

    recorder = _Recorder()
    with intercept(recorder):
        lowered = jax.jit(forward).lower(abstract(state), flat.dynamic)
    return recorder.records, lowered


def flops_of(lowered: Any) -> int | None:
    """XLA's FLOP count of a lowered computation (its HLO cost analysis), or None."""
    try:
        cost = lowered.cost_analysis()
    except Exception:  # pragma: no cover - a backend without cost analysis
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return round(cost["flops"])


def lower_flops(site: Site | None, cache: dict[Hashable, int | None]) -> int | None:
    """The FLOPs of one call site's method alone, lowered on abstract inputs (cached)."""
    if site is None:
        return None
    key = site.cache_key()
    if key is not None and key in cache:
        return cache[key]
    from flax import nnx

    def run(state: Any, dynamic: list[Any]) -> Any:
        a, k = site.args.rebuild(dynamic)
        return getattr(nnx.merge(site.graphdef, state), site.method)(*a, **k)

    try:
        flops = flops_of(jax.jit(run).lower(site.state, site.args.dynamic))
    except Exception:  # lowering a call site alone can fail (e.g. it needs an outer transform)
        flops = None
    if key is not None:
        cache[key] = flops
    return flops


@dataclasses.dataclass
class ParamTable:
    """Parameters of every module, shared ones found: what the summary rows and totals need."""

    count: dict[tuple[Any, ...], int]  # module path -> parameters below it (each counted once)
    nbytes: dict[tuple[Any, ...], int]
    shared_with: dict[tuple[Any, ...], tuple[str, ...]]  # path -> other modules holding its params
    total: int
    total_bytes: int
    shared_total: int  # parameters held by more than one module, counted once


def _size(var: Any) -> tuple[int, int]:
    value = var.get_value()
    n = 1
    for d in value.shape:
        n *= int(d)
    return n, n * jax.numpy.dtype(value.dtype).itemsize


def param_table(model: Any) -> ParamTable:
    """Count the ``nnx.Param``\\ s of every module of ``model``; tied parameters once."""
    from flax import nnx
    from flax.nnx import graphlib

    modules = [(tuple(p), m) for p, m in graphlib.iter_graph(model) if isinstance(m, nnx.Module)]
    owners: dict[int, list[tuple[Any, ...]]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    below: dict[tuple[Any, ...], set[int]] = {}
    direct: dict[tuple[Any, ...], set[int]] = {}
    for path, module in modules:
        nodes = list(graphlib.iter_graph(module))
        inner = {tuple(p) for p, n in nodes if isinstance(n, nnx.Module) and p}
        below[path], direct[path] = set(), set()
        for p, node in nodes:
            if not isinstance(node, nnx.Param):
                continue
            vid = id(node)
            if vid not in sizes:
                sizes[vid] = _size(node)
            below[path].add(vid)
            if not any(tuple(p[:i]) in inner for i in range(1, len(p))):
                direct[path].add(vid)
                owners.setdefault(vid, []).append(path)
    return assemble_params(sizes, owners, below, direct)


def assemble_params(
    sizes: dict[int, tuple[int, int]],
    owners: dict[int, list[tuple[Any, ...]]],
    below: dict[tuple[Any, ...], set[int]],
    direct: dict[tuple[Any, ...], set[int]],
) -> ParamTable:
    """The table from parameter ids: sizes, owning modules, and each module's sets.

    ``below[path]`` are the parameters of the module at ``path`` and its submodules;
    ``direct[path]`` its own; ``owners[id]`` the modules holding a parameter directly.
    """
    shared = {vid for vid, paths in owners.items() if len(paths) > 1}
    count = {p: sum(sizes[v][0] for v in vs) for p, vs in below.items()}
    nbytes = {p: sum(sizes[v][1] for v in vs) for p, vs in below.items()}
    shared_with = {
        path: tuple(
            sorted({_context.path_str(o) for v in vs & shared for o in owners[v] if o != path})
        )
        for path, vs in direct.items()
    }
    root = below.get((), set())
    return ParamTable(
        count=count,
        nbytes=nbytes,
        shared_with={p: s for p, s in shared_with.items() if s},
        total=count.get((), 0),
        total_bytes=nbytes.get((), 0),
        shared_total=sum(sizes[v][0] for v in root & shared),
    )
