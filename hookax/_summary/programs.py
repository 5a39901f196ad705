"""How :func:`hookax.summary` sees a program without modules (functions over a weight pytree).

The rows are the program's call sites (:mod:`hookax._transforms.program`): each call of its
Python functions and each named scope, recorded while the program runs through the dispatcher
inside one abstract trace, as a module's calls are.

* **Parameters.** The weights are the first positional argument that holds more than one array
  (``forward(weights, tokens)``, ``forward(tokens, segment_ids, weights, cfg)``; when no argument
  holds several, the first that holds one). Its floating-point leaves are the parameters, its
  other arrays (quantized values, integer tables) are listed apart as ``"other arrays"``; every
  other argument is an input. A call site's parameters are those read by an operation of its
  region, its nested call sites' included; an operation that only changes a weight's dtype or
  layout (a cast, a transpose, a reshape) passes it on, so a weight counts where its result is
  used. A weight read directly by two call sites (tied embeddings) is shown as shared on both
  and counted once; the root counts every weight, read or not.
* **FLOPs.** A call site's region is lowered alone (its equations, as a function of the values
  it reads) for XLA's cost analysis; identical regions (the layers of a Python loop) share one
  lowering. A site inside a scan counts every trip.
* **Shapes.** A function's call site shows its arguments by its parameters' names; a named
  scope shows the values computed before it that it reads (weights left out) and the values
  it computes that the program reads after it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Hashable
from typing import Any

import jax

from .._transforms import program as _program
from .._util.errors import HookaxError
from .._util.jaxcompat import ClosedJaxpr, Jaxpr, Literal, Var, closed_parts, core, jaxpr_as_fun
from .._util.specs import describe
from . import trace

__all__ = ["Program", "weights_position"]

# Operations that only change how a weight is stored: the weight counts where their result is used.
_PASS = frozenset(
    {
        "convert_element_type",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "copy",
        "copy_p",
        "sharding_constraint",
        "device_put",
        "reduce_precision",
        "optimization_barrier",
    }
)
# Higher-order equations whose outputs are their body's outputs, one for one.
_SAME_OUTS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "checkpoint",
        "remat",
        "remat2",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
    }
)
OTHER = "other arrays"  # the collection of the weights' arrays that are not floating-point


def _array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _inexact(x: Any) -> bool:
    try:
        return bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))
    except TypeError:  # PRNG keys
        return False


def weights_position(args: tuple) -> int | None:
    """Which positional argument holds the weights: the first that holds more than one array,
    else the first that holds one; None when no argument holds an array."""
    counts = [sum(_array(x) for x in jax.tree.leaves(a)) for a in args]
    for i, n in enumerate(counts):
        if n > 1:
            return i
    return next((i for i, n in enumerate(counts) if n), None)


@dataclasses.dataclass
class _Located:
    """Where a call site's region is: its jaxpr, the region, what a scope reads."""

    jaxpr: Any
    region: Any
    reads: list[Any]  # a named scope's inputs: values from before it, weights left out


class _Walk:
    """One pass over the program: each call site's region, and the weights read in each."""

    def __init__(self, prog: Any, weights: dict[int, int]) -> None:
        self.prog = prog
        self.direct: dict[tuple[Any, ...], set[int]] = {}  # site path -> weights read there
        self.located: dict[int, _Located] = {}  # id(site) -> its region
        jaxpr, _ = closed_parts(prog.closed)
        origin = {jaxpr.invars[n]: frozenset({pid}) for n, pid in weights.items()}
        self.level(jaxpr, 0, len(jaxpr.eqns), _program.regions(jaxpr), origin, (), ())

    def level(
        self,
        jaxpr: Any,
        lo: int,
        hi: int,
        rs: list[Any],
        origin: dict[Any, frozenset[int]],
        loc: tuple[Any, ...],
        path: tuple[Any, ...],
    ) -> None:
        starts = {r.start: r for r in rs}
        i = lo
        while i < hi:
            r = starts.get(i)
            if r is None:
                self.eqn(jaxpr.eqns[i], origin, loc, i, path)
                i += 1
                continue
            rloc = (*loc, ("r", r.start))
            site = self.prog.paths[rloc]
            a, b = inside(r)
            reads = [] if r.kind == "call" else _free(jaxpr.eqns[a:b], (), origin)
            self.located[id(site)] = _Located(jaxpr, r, reads)
            self.level(jaxpr, a, b, r.children, origin, rloc, site.path)
            i = r.end + 1

    def eqn(
        self,
        eqn: Any,
        origin: dict[Any, frozenset[int]],
        loc: tuple[Any, ...],
        i: int,
        path: tuple[Any, ...],
    ) -> None:
        ins = [
            origin.get(v, frozenset()) if isinstance(v, Var) else frozenset() for v in eqn.invars
        ]
        name = eqn.primitive.name
        if eqn.primitive is _program.site_p or name in _PASS:
            got = frozenset().union(*ins)
            if got:
                for v in eqn.outvars:
                    origin[v] = got
            return
        subs = list(enumerate(_program._sub_jaxprs(eqn)))
        outer = [_outer_vars(eqn, sub) for _, sub in subs]
        if subs and all(o is not None for o in outer):
            reached = bool(_program._reached(eqn))
            for (k, sub), vs in zip(subs, outer, strict=True):
                inner = {
                    jv: origin[ov]
                    for jv, ov in zip(sub.invars, vs or (), strict=False)
                    if isinstance(ov, Var) and ov in origin
                }
                rs = _program.regions(sub) if reached else []
                self.level(sub, 0, len(sub.eqns), rs, inner, (*loc, ("e", i, k)), path)
                if name in _SAME_OUTS and len(subs) == 1 and len(sub.outvars) == len(eqn.outvars):
                    for jv, ov in zip(sub.outvars, eqn.outvars, strict=True):
                        if isinstance(jv, Var) and jv in inner:
                            origin[ov] = inner[jv]
            return
        read = frozenset().union(*ins)
        if read:
            self.direct.setdefault(path, set()).update(read)


def inside(r: Any) -> tuple[int, int]:
    """The equations of a region that run as its call site (a call's without its markers)."""
    return (r.start + 1, r.end) if r.kind == "call" else (r.start, r.end + 1)


def _outer_vars(eqn: Any, sub: Any) -> list[Any] | None:
    """The equation's inputs that ``sub``'s inputs receive, in order; None where unknown."""
    p = eqn.params
    name = eqn.primitive.name
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        carry = list(eqn.invars[cn + bn :])
        if closed_parts(p["cond_jaxpr"])[0] is sub:
            return list(eqn.invars[:cn]) + carry
        return list(eqn.invars[cn : cn + bn]) + carry
    if name == "cond":
        return list(eqn.invars[1:])
    if len(sub.invars) == len(eqn.invars):
        return list(eqn.invars)
    return None


def _free(eqns: list[Any], outs: Any, skip: dict[Any, Any]) -> list[Any]:
    """The variables ``eqns`` (and ``outs``) read that they do not define, in order of first
    reading, without those in ``skip``."""
    defined: set[Any] = set()
    seen: dict[Any, None] = {}
    for eqn in eqns:
        for v in eqn.invars:
            if isinstance(v, Var) and v not in defined and v not in skip:
                seen.setdefault(v, None)
        defined.update(eqn.outvars)
    for v in outs:
        if isinstance(v, Var) and v not in defined and v not in skip:
            seen.setdefault(v, None)
    return list(seen)


def _struct(v: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)


def _region_site(loc: _Located) -> trace.Site | None:
    """One region as a function of the values it reads, to lower alone for its FLOPs."""
    r = loc.region
    a, b = inside(r)
    eqns = loc.jaxpr.eqns[a:b]
    if r.kind == "call":
        outs = [v for v in loc.jaxpr.eqns[r.end].invars if not isinstance(v, Literal)]
    else:
        outs = list(r.outs)
    free = _free(eqns, outs, {})
    try:
        effects = core.join_effects(*(e.effects for e in eqns))
        jx = Jaxpr([], free, outs, eqns, effects)
        key: Hashable = str(jx)
        fn = jaxpr_as_fun(ClosedJaxpr(jx, []))
    except Exception:  # a region JAX will not take as a jaxpr of its own: no FLOPs for it
        return None
    flat = trace.Flat.of([_struct(v) for v in free])

    def run(state: Any, dynamic: list[Any]) -> Any:
        return fn(*dynamic)

    return trace.Site(key, (), "__call__", flat, run)


class _Recorder(trace.Recorder):
    """The summary's recorder, with a program's call sites described as functions and scopes."""

    def __init__(self, owner: Program) -> None:
        super().__init__(owner.site)
        self.owner = owner

    def kind(self, module: Any) -> str:
        if isinstance(module, _program.Site):
            return module.name if module.kind == "function" else "named_scope"
        return super().kind(module)

    def describe(self, module: Any, method: str, args: tuple, kwargs: dict) -> tuple[str, ...]:
        if not isinstance(module, _program.Site):
            return super().describe(module, method, args, kwargs)
        if not module.path:  # the root: its title names the call
            return self.owner.title
        loc = self.owner.walk().located.get(id(module))
        if loc is None:
            return trace.describe_call(None, args, kwargs)
        if loc.region.kind == "scope":
            return tuple(describe(_struct(v)) for v in loc.reads)
        names = getattr(loc.region.info, "arg_names", ())
        params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
        self_ = inspect.Parameter("_site", inspect.Parameter.POSITIONAL_ONLY)
        return trace.describe_call(inspect.Signature([self_, *params]), args, kwargs)


class Program:
    """The summary's backend for a program without modules (``trace_calls``, ``collections``).

    ``fn(*args, **kwargs)`` is the program; ``title`` how its call is shown."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict, title: tuple[str, ...]) -> None:
        self.fn = fn
        self.title = title
        self.at = weights_position(args)
        leaves = jax.tree.leaves((args, kwargs))
        start = sum(len(jax.tree.leaves(a)) for a in args[: self.at]) if self.at is not None else 0
        n = len(jax.tree.leaves(args[self.at])) if self.at is not None else 0
        self.weight = [start <= j < start + n and _array(x) for j, x in enumerate(leaves)]
        self.leaves = leaves
        # A weight held twice (the same array at two places of the pytree) is one parameter.
        first: dict[int, int] = {}
        self.pid = {j: first.setdefault(id(x), j) for j, x in enumerate(leaves) if self.weight[j]}
        self.names = {}
        if self.at is not None:
            flat = jax.tree_util.tree_flatten_with_path(args[self.at])[0]
            for j, (kp, _) in enumerate(flat):
                self.names[start + j] = jax.tree_util.keystr(kp, simple=True, separator="/")
        self.prog: Any = None
        self._walk: _Walk | None = None

    def trace_calls(
        self,
        model: Any,
        args: tuple,
        kwargs: dict,
        *,
        method: str,
        train: bool | None,
        call: Any = None,
    ) -> trace.Whole:
        from ..frameworks import _functions

        treedef = jax.tree.structure((args, kwargs))
        arrays = [_array(x) for x in self.leaves]
        ws = [trace.abstract(x) for x, a, w in zip(self.leaves, arrays, self.weight) if a and w]
        xs = [trace.abstract(x) for x, a, w in zip(self.leaves, arrays, self.weight) if a and not w]

        def forward(ws: list[Any], xs: list[Any]) -> Any:
            wi, xi = iter(ws), iter(xs)
            leaves = [
                (next(wi) if w else next(xi)) if a else x
                for x, a, w in zip(self.leaves, arrays, self.weight, strict=True)
            ]
            a, k = jax.tree.unflatten(treedef, leaves)
            prog = _functions.program_of(self.fn, a, k)
            if prog is None:
                raise HookaxError(_modules_error(self.fn))
            if self.prog is None:
                self.prog = prog
            return _program.Evaluator(prog, _functions.ADAPTER).run(a, k)

        try:
            return trace.trace_whole(forward, (ws, xs), self.site, _Recorder(self))
        except HookaxError:
            raise
        except Exception as e:
            name = getattr(self.fn, "__name__", "the function")
            e.add_note(
                f"hx.summary: none of its positional arguments is a module, so {name} was "
                "summarised as a program without modules; if it calls a model, pass the model "
                "among its positional arguments: hx.summary(forward, model, cache, tokens)"
            )
            raise

    def walk(self) -> _Walk:
        if self._walk is None:
            prog = self.prog
            weights = {
                spec: self.pid[j]
                for j, spec in enumerate(prog.in_spec)
                if isinstance(spec, int) and j in self.pid
            }
            self._walk = _Walk(prog, weights)
        return self._walk

    def site(self, module: Any, method: str, args: tuple, kwargs: dict) -> trace.Site | None:
        loc = self.walk().located.get(id(module))
        return None if loc is None else _region_site(loc)

    def collections(self, model: Any, variables: bool) -> trace.Collections:
        direct = self.walk().direct
        below: dict[tuple[Any, ...], set[int]] = {(): set(self.pid.values())}
        for path, pids in direct.items():
            for j in range(len(path) + 1):
                below.setdefault(path[:j], set()).update(pids)
        entries = []
        for path, pids in below.items():
            for pid in sorted(pids):
                x = self.leaves[pid]
                coll = trace.TRAINABLE if _inexact(x) else OTHER
                entries.append((path, coll, pid, x, pid in direct.get(path, ())))
        own: dict[tuple[Any, ...], tuple[str, ...]] = {}
        if variables:
            for path, pids in direct.items():
                own[path] = tuple(
                    f"{self.names.get(pid, pid)}: {describe(self.leaves[pid])}"
                    for pid in sorted(pids)
                )
        return trace.Collections.build(entries, own)


def _modules_error(fn: Any) -> str:
    name = getattr(fn, "__name__", fn)
    found = _outside_modules(fn)
    if not found:
        return (
            f"hx.summary({name!r}, ...): the function calls a module that is not among its "
            "positional arguments, so there is no model to summarise. Fix: pass the model as an "
            "argument of the function: hx.summary(forward, model, cache, tokens)."
        )
    var, module = found[0]
    kind = type(module).__name__
    if _is_linen(module):
        return (
            f"hx.summary({name!r}, ...): the function runs the Linen module {var!r} ({kind}) "
            "through apply, so hx.summary sees its variables only as arrays. Fix: summarise "
            f"the module itself with its variables, hx.summary({var}.bind(variables), *inputs) "
            f"or hx.summary({var}.apply, variables, *inputs), or initialised abstractly, "
            f"hx.summary({var}, *inputs)."
        )
    if name == "<lambda>":
        take, fn_name = f"lambda {var}, *inputs: ...", "that_function"
    else:
        take, fn_name = f"def {name}({var}, ...)", name
    return (
        f"hx.summary({name!r}, ...): the function calls the module {var!r} ({kind}) from "
        f"outside its arguments, so there is no model to summarise. Fix: take it as an "
        f"argument, {take}, and pass it: hx.summary({fn_name}, {var}, *inputs)."
    )


def _outside_modules(fn: Any) -> list[tuple[str, Any]]:
    """The modules ``fn`` reads from its closure or its globals, by the name it reads them."""
    from .._engine.adapters import adapter_for

    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    cells = dict(zip(code.co_freevars, getattr(fn, "__closure__", None) or ()))
    scope = getattr(fn, "__globals__", {})
    found = []
    for var in (*code.co_freevars, *code.co_names):
        try:
            value = cells[var].cell_contents if var in cells else scope[var]
        except (KeyError, ValueError):
            continue
        if adapter_for(value) is not None or _is_linen(value):
            found.append((var, value))
    return found


def _is_linen(obj: Any) -> bool:
    nn = sys.modules.get("flax.linen")
    return nn is not None and isinstance(obj, nn.Module)
