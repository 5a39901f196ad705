"""How :func:`hookax.summary` traces a model: call sites, the whole call, and Flax NNX's variables.

Everything here is abstract. The model is split into a structure and a state of
``jax.ShapeDtypeStruct``\\ s, merged again inside ``jax.jit(...).trace`` (which traces, never runs
or allocates), and an interceptor records every call site while that trace runs. Each call site
runs inside a name scope (``hookax_site_<n>``), so the traced program tells which call sites sit
inside a scan and how many times they run. The FLOPs of one call site come from XLA's own cost
analysis of that call site's method lowered alone on abstract inputs; identical call sites (same
module structure and configuration, same input shapes) share one lowering, so the 32 blocks of a
7B decoder cost one. Linen and Equinox plug their own splitting into the same recorder
(``_summary_frameworks``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax

from .._engine import context as _context
from .._engine import dispatch as _dispatch
from .._hooks.intercept import intercept
from .._util.parts import axis_names, unwrap_sole
from .._util.specs import describe, describe_tree
from . import cost

__all__ = [
    "NNX",
    "Collections",
    "Flat",
    "ParamTable",
    "Record",
    "Recorder",
    "Site",
    "Whole",
    "abstract",
    "assemble_params",
    "describe_call",
    "rejection",
]

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
    """What it takes to lower one call site alone: a function of (state, arrays) and both.

    ``run(state, dynamic)`` calls the method; ``structure`` (graph definition, module
    configuration) and the abstract ``state`` and ``args`` make the cache key.
    """

    structure: Any
    state: Any
    method: str
    args: Flat
    run: Callable[[Any, list[Any]], Any]

    def cache_key(self) -> Hashable | None:
        key = (
            self.structure,
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
    module_id: int = 0
    vmapped: tuple[int, ...] = ()


@dataclasses.dataclass
class Whole:
    """The whole call, traced once: what the totals and the memory estimate are computed from.

    ``fn(*args)`` is the call as a function of abstract arguments; ``traced`` its trace (with
    the recorder's name scopes); ``records`` the call sites seen.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    traced: Any
    records: list[Record]
    input_bytes: int

    def flops(self) -> int | None:
        return cost.flops(self.traced)

    def backward(self, compile: bool = False) -> tuple[int | None, int]:
        """FLOPs of the forward and backward pass, and the bytes of activations kept.

        With ``compile``, the activations are XLA's temporary buffers of the compiled
        forward and backward pass (``memory_analysis().temp_size_in_bytes``) instead.
        """
        kept: list[int] = []
        try:
            traced = jax.jit(cost.vjp_fn(self.fn, kept)).trace(*self.args)
        except Exception:  # pragma: no cover - a model that cannot be differentiated
            return None, sum(kept)
        if compile:
            kept = [traced.lower().compile().memory_analysis().temp_size_in_bytes]
        return cost.flops(traced), sum(kept)


# A pytree with more leaves than this (a KV cache: two per layer) is one line: its leaves
# counted by shape and dtype, ``"cache: 56 x f32[1,8,64]"``.
_MANY = 4


def _described(leaf: Any) -> str:
    """A leaf's spec; a NamedArray-like tree's with its axis names (``f32[batch=2,embed=8]``)."""
    names = axis_names(leaf)
    if names is None:
        return describe(leaf)
    array = unwrap_sole(leaf)
    text = describe(array)
    dims = ",".join(f"{n}={d}" for n, d in zip(names, array.shape))
    return text[: text.index("[") + 1] + dims + "]" if "[" in text else text


def _is_named(x: Any) -> bool:
    return axis_names(x) is not None


def _named(name: str, tree: Any) -> list[str]:
    """Each leaf of ``tree`` described, prefixed by ``name`` and its key path in the tree; a tree
    of many leaves in one line, its leaves counted by spec. A NamedArray-like tree is one leaf,
    shown with its axis names."""
    if _is_named(tree):
        return [f"{name}: {_described(tree)}" if name else _described(tree)]
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_named)[0]
    if len(flat) > _MANY:
        counts: dict[str, int] = {}
        for _, leaf in flat:
            spec = _described(leaf)
            counts[spec] = counts.get(spec, 0) + 1
        text = ", ".join(f"{n} x {spec}" if n > 1 else spec for spec, n in counts.items())
        return [f"{name}: {text}" if name else text]
    out: list[str] = []
    for kp, leaf in flat:
        sub = jax.tree_util.keystr(kp, simple=True, separator="/")
        label = "/".join(s for s in (name, sub) if s)
        out.append(f"{label}: {_described(leaf)}" if label else _described(leaf))
    return out


def describe_call(sig: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """The arguments of a call as specs: a positional array bare, anything else named."""
    params = list(sig.parameters.values())[1:] if sig is not None else []
    out: list[str] = []
    for i, arg in enumerate(args):
        leaves = jax.tree.leaves(arg)
        if _is_named(arg):
            out.append(_described(arg))
            continue
        if len(leaves) <= 1 and all(x is arg for x in leaves):
            out.extend(describe(x) for x in leaves)
            continue
        p = params[i] if i < len(params) else None
        name = p.name if p is not None and p.kind is not p.VAR_POSITIONAL else f"arg{i}"
        out.extend(_named(name, arg))
    for name, value in kwargs.items():
        out.extend(_named(name, value))
    return tuple(out)


def describe_output(out: Any) -> tuple[str, ...]:
    """Each leaf of an output: bare for one array, named by its key in a pytree."""
    return tuple(_named("", out))


_SIGNATURES: dict[tuple[type, str], inspect.Signature | None] = {}


def _signature_of(module: Any, method: str) -> inspect.Signature | None:
    key = (type(module), method)
    if key not in _SIGNATURES:
        try:
            _SIGNATURES[key] = inspect.signature(getattr(type(module), method))
        except (AttributeError, TypeError, ValueError):
            _SIGNATURES[key] = None
    return _SIGNATURES[key]


def _vmapped(tree: Any) -> tuple[int, ...]:
    """The sizes of the vmaps the values of ``tree`` are batched by, outermost first."""
    best: list[int] = []
    for leaf in jax.tree.leaves(tree):
        sizes, t = [], leaf
        while hasattr(t, "val") and hasattr(getattr(t, "_trace", None), "axis_data"):
            sizes.append(int(t._trace.axis_data.size))
            t = t.val
        if len(sizes) > len(best):
            best = sizes
    return tuple(reversed(best))


class Recorder:
    """The interceptor that records each call site (entry order is call order)."""

    def __init__(self, site: Callable[..., Site | None]) -> None:
        self.records: list[Record] = []
        self.site = site  # how to cut one call site out (per framework)
        self._modules: list[Any] = []  # keeps ids unique while recording

    def __call__(
        self, next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: _context.Context
    ) -> Any:
        module = context.module
        self._modules.append(module)
        rec = Record(
            key=context.key,
            path=tuple(context.path),
            type=self.kind(module),
            method=context.method,
            inputs=self.describe(module, context.method, args, kwargs),
            module_id=id(module),
            vmapped=_vmapped((args, kwargs)),
        )
        if self.records:  # the root call's FLOPs come from the whole call
            rec.site = self.site(module, context.method, args, kwargs)
        n = len(self.records)
        self.records.append(rec)
        try:
            with jax.named_scope(f"{cost.SCOPE}{n}"):
                out = next_fun(*args, **kwargs)
        except Exception as e:
            _note_rejection(e, rec)
            raise
        rec.outputs = describe_output(out)
        return out

    def kind(self, module: Any) -> str:
        """What a row's "Type" says: the module's class."""
        return type(module).__name__

    def describe(self, module: Any, method: str, args: tuple, kwargs: dict) -> tuple[str, ...]:
        """A call site's inputs, named by its method's parameters."""
        return describe_call(_signature_of(module, method), args, kwargs)


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


def root_call(module: Any, method: str, call: Any, args: tuple, kwargs: dict, adapter: Any) -> Any:
    """The summarised call, ``module.method(*args, **kwargs)`` or (``hx.summary(fn, model,
    ...)``) ``call(module, *args, **kwargs)``, run as the model's root call site, also where
    the method is not one (a private method): the modules it reaches are keyed by their paths
    in the model (else each would be a root of its own, keyed ``""``). The model's own method
    inside it is that root call, seen once, as ``super().method`` is."""
    if call is not None:
        return _dispatch.call(call, "__call__", module, args, kwargs, adapter)
    fn = getattr(type(module), method, None)
    if not isinstance(fn, types.FunctionType):  # a static or class method, an attribute
        return getattr(module, method)(*args, **kwargs)
    return _dispatch.call(fn, method, module, args, kwargs, adapter)


def trace_whole(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    site: Callable[..., Site | None],
    recorder: Recorder | None = None,
) -> Whole:
    """Trace ``fn(*args)`` (abstract arguments) with the recorder on; the :class:`Whole`.

    ``args[1]`` are the inputs (counted by the memory estimate); ``recorder`` one of a
    framework's own (default: a :class:`Recorder` of ``site``). Outputs that are no JAX values
    (a string, a name) are left out of the traced program's result: a summary lists what a
    model computes, and a ``jit`` cannot return them."""

    def values(*a: Any) -> Any:
        keep = lambda v: _is_array(v) or isinstance(v, int | float | complex)  # noqa: E731
        return jax.tree.map(lambda v: v if keep(v) else None, fn(*a))

    recorder = Recorder(site) if recorder is None else recorder
    with intercept(recorder):
        traced = jax.jit(values).trace(*args)
    inputs = sum(cost.nbytes(x) for x in args[1])
    return Whole(values, args, traced, recorder.records, inputs)


# ---------------------------------------------------------------------------------------------
# Parameter tables


@dataclasses.dataclass
class ParamTable:
    """One collection of every module, shared values found: what rows and totals need."""

    count: dict[tuple[Any, ...], int]  # module path -> values below it (each counted once)
    nbytes: dict[tuple[Any, ...], int]
    shared_with: dict[tuple[Any, ...], tuple[str, ...]]  # path -> other modules holding its values
    total: int
    total_bytes: int
    shared_total: int  # values held by more than one module, counted once


def assemble_params(
    sizes: dict[int, tuple[int, int]],
    owners: dict[int, list[tuple[Any, ...]]],
    below: dict[tuple[Any, ...], set[int]],
    direct: dict[tuple[Any, ...], set[int]],
) -> ParamTable:
    """The table from value ids: sizes, owning modules, and each module's sets.

    ``below[path]`` are the values of the module at ``path`` and its submodules;
    ``direct[path]`` its own; ``owners[id]`` the modules holding a value directly.
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


class _Acc:
    """Accumulates one collection's ids while walking the modules."""

    def __init__(self) -> None:
        self.sizes: dict[int, tuple[int, int]] = {}
        self.owners: dict[int, list[tuple[Any, ...]]] = {}
        self.below: dict[tuple[Any, ...], set[int]] = {}
        self.direct: dict[tuple[Any, ...], set[int]] = {}

    def add(self, path: tuple[Any, ...], vid: int, leaf: Any, is_direct: bool) -> None:
        if vid not in self.sizes:
            # A variable's value is an array, or a pytree of them (what ``sow`` keeps: a tuple
            # of the values sown); anything without a shape counts nothing.
            arrays = [x for x in jax.tree.leaves(leaf) if hasattr(x, "shape")]
            n = sum(math.prod(int(d) for d in x.shape) for x in arrays)
            self.sizes[vid] = (n, sum(cost.nbytes(x) for x in arrays))
        self.below.setdefault(path, set()).add(vid)
        if is_direct:
            self.direct.setdefault(path, set()).add(vid)
            self.owners.setdefault(vid, []).append(path)


TRAINABLE = "trainable"


@dataclasses.dataclass
class Collections:
    """Every collection's :class:`ParamTable`; :data:`TRAINABLE` is the trainable one."""

    tables: dict[str, ParamTable]
    variables: dict[tuple[Any, ...], tuple[str, ...]]  # module path -> its own variables

    @classmethod
    def build(
        cls,
        entries: Iterable[tuple[tuple[Any, ...], str, int, Any, bool]],
        variables: dict[tuple[Any, ...], tuple[str, ...]],
    ) -> Collections:
        """From ``(module path, collection, value id, leaf, is the module's own)`` entries."""
        accs: dict[str, _Acc] = {TRAINABLE: _Acc()}
        for path, coll, vid, leaf, is_direct in entries:
            accs.setdefault(coll, _Acc()).add(path, vid, leaf, is_direct)
        tables = {
            c: assemble_params(a.sizes, a.owners, a.below, a.direct)
            for c, a in sorted(accs.items())
        }
        return cls(tables, variables)

    def of(self, path: tuple[Any, ...]) -> tuple[int, int, tuple[tuple[str, int, int], ...]]:
        """Trainable count and bytes below ``path``, and the other collections'."""
        t = self.tables[TRAINABLE]
        state = tuple(
            (c, tab.count[path], tab.nbytes[path])
            for c, tab in self.tables.items()
            if c != TRAINABLE and tab.count.get(path)
        )
        return t.count.get(path, 0), t.nbytes.get(path, 0), state

    def shared_with(self, path: tuple[Any, ...]) -> tuple[str, ...]:
        return self.tables[TRAINABLE].shared_with.get(path, ())

    def shared_total(self) -> int:
        return self.tables[TRAINABLE].shared_total


# ---------------------------------------------------------------------------------------------
# Flax NNX


def _nnx_site(module: Any, method: str, args: tuple, kwargs: dict) -> Site | None:
    from flax import nnx

    try:
        graphdef, state = nnx.split(module)
    except Exception:  # a call site NNX cannot split here: no FLOPs for it, nothing else lost
        return None
    flat = Flat.of((args, kwargs))

    def run(state: Any, dynamic: list[Any]) -> Any:
        a, k = flat.rebuild(dynamic)
        return getattr(nnx.merge(graphdef, state), method)(*a, **k)

    return Site(graphdef, abstract(state), method, flat, run)


def _nnx_collection(var: Any) -> str:
    from flax import nnx

    if isinstance(var, nnx.Param):
        return TRAINABLE
    return "RngState" if isinstance(var, nnx.RngState) else type(var).__name__


class NNX:
    """Flax NNX: ``nnx.split`` / ``nnx.merge`` on abstract state."""

    def trace_calls(
        self,
        model: Any,
        args: tuple,
        kwargs: dict,
        *,
        method: str,
        train: bool | None,
        call: Any = None,
    ) -> Whole:
        from flax import nnx

        from ..frameworks import _nnx

        graphdef, state = nnx.split(model)
        flat = Flat.of((args, kwargs))

        def forward(state: Any, dynamic: list[Any]) -> Any:
            a, k = flat.rebuild(dynamic)
            m = nnx.merge(graphdef, state)
            if train is not None:
                m.train() if train else m.eval()
            return root_call(m, method, call, a, k, _nnx.ADAPTER)

        return trace_whole(forward, (abstract(state), flat.dynamic), _nnx_site)

    def collections(self, model: Any, variables: bool) -> Collections:
        """Every ``nnx.Variable`` of every module, by type (``Param`` trainable); ties once."""
        from flax import nnx
        from flax.nnx import graphlib

        modules = [
            (tuple(p), m) for p, m in graphlib.iter_graph(model) if isinstance(m, nnx.Module)
        ]
        entries = []
        own: dict[tuple[Any, ...], tuple[str, ...]] = {}
        for path, module in modules:
            nodes = list(graphlib.iter_graph(module))
            inner = {tuple(p) for p, n in nodes if isinstance(n, nnx.Module) and p}
            mine = []
            for p, node in nodes:
                if not isinstance(node, nnx.Variable):
                    continue
                is_direct = not any(tuple(p[:i]) in inner for i in range(1, len(p)))
                value = node.get_value()
                entries.append((path, _nnx_collection(node), id(node), value, is_direct))
                if is_direct and variables:
                    name = "/".join(str(k) for k in p)
                    mine.append(f"{name}: {type(node).__name__} {describe_tree(value)}")
            if mine:
                own[path] = tuple(mine)
        return Collections.build(entries, own)
