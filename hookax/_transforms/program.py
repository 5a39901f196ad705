"""Call sites of a program without modules: its Python functions' calls and its named scopes.

A JAX program written as functions over a weight pytree (the way jax-llm-examples writes Llama,
Qwen and DeepSeek) calls no module, so no framework adapter sees a call site. Its structure is
still there while it is traced: each call of the user's Python functions, and each
``jax.named_scope`` / ``jax.named_call`` block, which JAX records on every equation's name stack.

**Discovery.** The function is traced once to a jaxpr (``jax.make_jaxpr``) with a Python profile
function set on this thread. On each call of a user function (code outside JAX, NumPy, the
standard library and the other libraries in :data:`_LIBRARIES`; hookax's own examples are user
code) it binds the ``hookax_site``
marker primitive on the call's array arguments, and on return on its array results: identity
equations that mark where the call starts and ends in the program and which values went in and
came out. ``jax.jit`` functions are retraced for discovery (a user-context value keys JAX's caches
apart), so functions a jit would have cached are seen too.

**Regions.** At each level of the jaxpr, the equations between a call's two markers are the
call's region; a maximal run of equations whose name stack holds a named scope is the scope's
region. Regions nest as the Python ran.

**Evaluation.** The program runs again by evaluating the discovered jaxpr; each region runs as a
call site through the dispatcher (:func:`hookax._engine.dispatch.call`), so interceptors, hooks,
capture, operations and gradients see it exactly as they see a module's method: a function's
call site receives the function's arguments and returns what it returned (a hook's edit of the
result is what the rest of the program reads), a named scope's returns the values computed in
the block that the program reads after it (one value, or a tuple in the order they were
computed). ``jit`` equations that hold call sites are inlined; ``scan``, ``while``, ``cond`` and
``checkpoint`` equations that hold call sites are bound again around the evaluation of their
bodies (a call inside a scan is one call site, its layers by the ``[i]`` suffix). Other
equations are bound as they are.

Keys: a call site is named by its function's name (a method's by its name, ``__call__`` by its
class's) or its scope's name, under the call site that encloses it; a name that occurs more than
once under one parent is numbered in call order (``forward_layer/0``, ``forward_layer/1``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax import lax

from .._util.jaxcompat import (
    ad,
    batching,
    bind_eqn,
    closed_parts,
    core,
    mesh_context,
    mlir,
    scan_counts,
)
from .._util.jaxcompat import source_info_util as siu

__all__ = ["DISCOVERING", "Program", "Site", "discover", "site_p"]

# ---------------------------------------------------------------------------------------------
# The marker primitive: the identity, with a kind ("enter"/"exit") and the call's description.

site_p = core.Primitive("hookax_site")
site_p.multiple_results = True
site_p.def_impl(lambda *xs, **_: list(xs))
site_p.def_abstract_eval(lambda *avals, **_: list(avals))
mlir.register_lowering(site_p, lambda ctx, *xs, **_: list(xs))


def _site_batch(args: Any, dims: Any, **params: Any) -> Any:
    return site_p.bind(*args, **params), dims


batching.primitive_batchers[site_p] = _site_batch


def _site_jvp(primals: Any, tangents: Any, **params: Any) -> Any:
    return site_p.bind(*primals, **params), list(tangents)


ad.primitive_jvps[site_p] = _site_jvp


def _site_transpose(cts: Any, *args: Any, **params: Any) -> Any:
    return list(cts)


ad.primitive_transposes[site_p] = _site_transpose


class CallInfo:
    """One traced call of a user function: its name and the structure of what went in and out.

    Compared by identity: a marker's parameter, hashable without hashing the user's values."""

    __slots__ = ("arg_names", "in_leaves", "in_tree", "local", "name", "out_leaves", "out_tree")

    def __init__(
        self,
        name: str,
        in_tree: Any,
        in_leaves: list[Any],
        local: bool = False,
        arg_names: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.local = local  # a function defined inside another (a scan body, a closure)
        self.arg_names = arg_names  # the names of its positional parameters (``self`` left out)
        # Leaves: the marker's n-th input/output (an int) or a static Python value (_Static).
        self.in_tree = in_tree
        self.in_leaves = in_leaves
        self.out_tree: Any = None
        self.out_leaves: list[Any] = []

    def __repr__(self) -> str:
        return f"<call of {self.name}>"


class _Static:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


_ARRAYS = (jax.Array, core.Tracer, np.ndarray, np.generic)


def _split(
    tree: Any, traced: tuple[type, ...] = (core.Tracer,)
) -> tuple[Any, list[Any], list[Any]]:
    """``(treedef, leaves as int positions or _Static, the traced leaves)``: leaves of the
    ``traced`` types are traced, others static (Python numbers, strings, configuration objects,
    as ``eqx.filter_jit`` has them)."""
    leaves, treedef = jax.tree.flatten(tree)
    dyn: list[Any] = []
    spec: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, traced):
            spec.append(len(dyn))
            dyn.append(leaf)
        else:
            spec.append(_Static(leaf))
    return treedef, spec, dyn


def _join(treedef: Any, spec: list[Any], dyn: list[Any]) -> Any:
    return jax.tree.unflatten(treedef, [dyn[s] if isinstance(s, int) else s.value for s in spec])


# ---------------------------------------------------------------------------------------------
# Which Python functions are the user's.

_LIBRARIES = frozenset(
    {
        "jax",
        "jaxlib",
        "numpy",
        "flax",
        "equinox",
        "haiku",
        "optax",
        "chex",
        "hookax",
        "ml_dtypes",
        "opt_einsum",
        "scipy",
        "jaxtyping",
        "typeguard",
        "beartype",
        "einops",
        "typing_extensions",
        "absl",
        "tree",
        "orbax",
        "tensorflow",
        "torch",
        "etils",
        "treescope",
        "msgpack",
        "wadler_lindig",
        "lineax",
        "optimistix",
        "diffrax",
        "pytest",
        "_pytest",
        "pluggy",
        "hypothesis",
        "IPython",
        "ipykernel",
        "tqdm",
        "rich",
        "grain",
        "tensorstore",
        "zarr",
        "numcodecs",
        "pandas",
        "matplotlib",
        "levanter",
        "haliax",
        "alphafold",
        "colabfold",
        "ml_collections",
        "google",
        "qwix",
        "tokamax",
        "coverage",
    }
)
_NOT_CALLS = frozenset(
    {"<lambda>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<module>"}
)
_GENERATOR = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
_USER: dict[types.CodeType, bool] = {}
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))


def _library(code: types.CodeType, module: str | None) -> bool:
    """Whether ``code`` is a library's (JAX, NumPy, the standard library, ...): not the user's."""
    file = code.co_filename
    if file.startswith("<frozen"):  # the standard library's frozen modules
        return True
    if file.startswith("<"):  # typed or run as text: a doctest, a REPL, exec, python -c
        return False
    if (module or "").startswith("hookax.examples."):  # the examples are models, not hookax
        return False
    top = (module or "").partition(".")[0]
    return top in _LIBRARIES or top in _STDLIB


def _is_user(code: types.CodeType, module: str | None) -> bool:
    """Whether a call of ``code`` is a call site: a named function of the user's."""
    hit = _USER.get(code)
    if hit is None:
        name = code.co_name
        hit = not (
            _library(code, module)
            or name in _NOT_CALLS
            or code.co_flags & _GENERATOR
            or (name.startswith("__") and name.endswith("__") and name != "__call__")
        )
        if len(_USER) > 100_000:
            _USER.clear()
        _USER[code] = hit
    return hit


def _call_name(frame: Any, code: types.CodeType) -> tuple[str, bool]:
    """The call's name, and whether its first argument is ``self`` (left out of its inputs)."""
    qualname = getattr(code, "co_qualname", code.co_name)
    parts = qualname.split(".")
    method = (
        code.co_argcount > 0
        and code.co_varnames[0] == "self"
        and len(parts) > 1
        and parts[-2] != "<locals>"
    )
    if method and code.co_name == "__call__":
        return type(frame.f_locals.get("self")).__name__, True
    return code.co_name, method


def _call_args(frame: Any, code: types.CodeType, skip_self: bool) -> tuple[tuple, dict]:
    loc = frame.f_locals
    names = code.co_varnames
    n = code.co_argcount
    args = [loc.get(k) for k in names[1 if skip_self else 0 : n]]
    i = n + code.co_kwonlyargcount
    if code.co_flags & 0x04:  # CO_VARARGS
        args.extend(loc.get(names[i], ()))
        i += 1
    kwargs = {k: loc.get(k) for k in names[n : n + code.co_kwonlyargcount]}
    if code.co_flags & 0x08:  # CO_VARKEYWORDS
        kwargs.update(loc.get(names[i], {}))
    return tuple(args), kwargs


class _Recorder:
    """The profile function of a discovery trace: a marker at each user call's entry and exit."""

    def __init__(self, root: types.CodeType | None) -> None:
        self.root = root  # the program's own function: the root call site, not a child
        self.stack: list[tuple[Any, CallInfo]] = []
        self.modules = False  # a framework's module was called: not a program without modules
        self.failed: BaseException | None = None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code is _ENTER_SCOPE:
                _note_scope(frame)
                return
            if code.co_filename.startswith(_FRAMEWORKS_DIR):
                self.modules = True
                return
            if not _is_user(code, frame.f_globals.get("__name__")):
                return
            if code is self.root:
                self.root = None
                return
            try:
                name, skip_self = _call_name(frame, code)
                args = _call_args(frame, code, skip_self)
                treedef, spec, dyn = _split(args)
                local = "<locals>" in getattr(code, "co_qualname", "")
                names = code.co_varnames[1 if skip_self else 0 : code.co_argcount]
                info = CallInfo(name, treedef, spec, local, names)
                site_p.bind(*dyn, kind="enter", info=info)
            except Exception as e:
                self.failed = self.failed or e
                return
            self.stack.append((frame, info))
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            _, info = self.stack.pop()
            try:
                treedef, spec, dyn = _split(arg)
                info.out_tree, info.out_leaves = treedef, spec
                site_p.bind(*dyn, kind="exit", info=info)
            except Exception as e:
                self.failed = self.failed or e


import os as _os  # noqa: E402

_ENTER_SCOPE = siu.ExtendNameStackContextManager.__enter__.__code__
# Named scopes the user's code opened (``jax.named_scope`` in a ``with`` or as a decorator,
# ``jax.named_call``); JAX's own (``jnp.einsum`` names its equations by their subscripts) are
# no call sites.
_USER_SCOPES: set[str] = set()


def _note_scope(frame: Any) -> None:
    caller = frame.f_back
    name = getattr(frame.f_locals.get("self"), "name", None)
    if caller is None or not isinstance(name, str):
        return
    code = caller.f_code
    if code.co_name == "wrapper" and code.co_filename == _SIU_FILE:
        func = caller.f_locals.get("func")
        code = getattr(func, "__code__", None)
        if code is None:
            return
        user = not _library(code, getattr(func, "__module__", None))
    else:
        user = not _library(code, caller.f_globals.get("__name__"))
    if user:
        if len(_USER_SCOPES) > 10_000:
            _USER_SCOPES.clear()
        _USER_SCOPES.add(name)


_SIU_FILE = siu.__file__
_FRAMEWORKS_DIR = _os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "frameworks")


# ---------------------------------------------------------------------------------------------
# Regions of one jaxpr level.


@dataclasses.dataclass
class Region:
    kind: str  # "call" or "scope"
    name: str
    start: int  # index of the first equation (a call's entry marker)
    end: int = -1  # index of the last equation (a call's exit marker)
    info: CallInfo | None = None
    depth: int = 0  # how many scopes the name stack holds inside it (a call's: at its entry)
    scopes: tuple[str, ...] = ()  # a scope's: the name stack's scopes up to and with it
    children: list[Region] = dataclasses.field(default_factory=list)
    outs: list[Any] = dataclasses.field(default_factory=list)  # a scope's live-out vars


def _scopes(eqn: Any) -> tuple[str, ...]:
    """The named scopes the user opened, of an equation's name stack (none for an equation of a
    backward pass, ``transpose(...)``: it computes no scope's forward value)."""
    stack = eqn.source_info.name_stack.stack
    if any(type(s).__name__ == "Transform" and s.name == "transpose" for s in stack):
        return ()
    return tuple(s.name for s in stack if type(s).__name__ == "Scope" and s.name in _USER_SCOPES)


_REGIONS: dict[int, tuple[Any, list[Region]]] = {}
_REGIONS_LOCK = threading.Lock()


def regions(jaxpr: Any) -> list[Region]:
    """The outermost regions of an open jaxpr's equations, each with its nested ones."""
    hit = _REGIONS.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    top: list[Region] = []
    open_: list[Region] = []
    eqns = jaxpr.eqns

    def close(r: Region, i: int) -> None:
        r.end = i

    for i, eqn in enumerate(eqns):
        scopes = _scopes(eqn)
        # Close the scopes this equation is not in.
        while open_ and open_[-1].kind == "scope" and scopes[: open_[-1].depth] != open_[-1].scopes:
            close(open_.pop(), i - 1)
        # Open the scopes it is newly in.
        for d in range(open_[-1].depth if open_ else 0, len(scopes)):
            r = Region("scope", scopes[d], i, depth=d + 1, scopes=scopes[: d + 1])
            (open_[-1].children if open_ else top).append(r)
            open_.append(r)
        if eqn.primitive is site_p:
            info = eqn.params["info"]
            if eqn.params["kind"] == "enter":
                r = Region("call", info.name, i, info=info, depth=len(scopes))
                (open_[-1].children if open_ else top).append(r)
                open_.append(r)
            else:
                while open_ and open_[-1].info is not info:
                    close(open_.pop(), i - 1)
                if open_:
                    close(open_.pop(), i)
    while open_:
        close(open_.pop(), len(eqns) - 1)
    _live_outs(jaxpr, top)
    top = _prune(top)
    with _REGIONS_LOCK:
        if len(_REGIONS) > 4096:
            _REGIONS.clear()
        _REGIONS[id(jaxpr)] = (jaxpr, top)
    return top


def _live_outs(jaxpr: Any, top: list[Region]) -> None:
    """Each scope's outputs: the variables its equations define that a later equation or the
    jaxpr's outputs read, in the order they were defined."""
    last: dict[Any, int] = {}
    n = len(jaxpr.eqns)
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, core.Var):
                last[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, core.Var):
            last[v] = n

    def visit(rs: list[Region]) -> None:
        for r in rs:
            if r.kind == "scope":
                outs = []
                for eqn in jaxpr.eqns[r.start : r.end + 1]:
                    for v in eqn.outvars:
                        if last.get(v, -1) > r.end:
                            outs.append(v)
                r.outs = outs
            visit(r.children)

    visit(top)


def _prune(rs: list[Region]) -> list[Region]:
    """Regions without values in or out, and local functions that only call another, are no
    call sites: their children take their place."""
    out: list[Region] = []
    for r in rs:
        r.children = _prune(r.children)
        if r.kind == "call":
            assert r.info is not None
            empty = not any(isinstance(s, int) for s in r.info.in_leaves) and not any(
                isinstance(s, int) for s in r.info.out_leaves
            )
            # A local function that only calls another (``def body(x, w): return block(x, w),
            # None`` given to ``lax.scan``) passes its call site through: the other is the site.
            if r.info.local and len(r.children) == 1:
                c = r.children[0]
                empty = empty or (c.start == r.start + 1 and c.end == r.end - 1)
        else:
            empty = not r.outs
        if empty:
            out.extend(r.children)
        else:
            out.append(r)
    return out


# ---------------------------------------------------------------------------------------------
# Higher-order equations.

_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call"})
_REBIND = frozenset({"scan", "while", "cond", "checkpoint", "remat", "remat2"})


def _sub_jaxprs(eqn: Any) -> Iterator[Any]:
    """The open jaxprs of an equation's parameters."""
    for v in eqn.params.values():
        for j in v if isinstance(v, tuple | list) else (v,):
            if isinstance(j, core.Jaxpr):
                yield j
            elif hasattr(j, "jaxpr") and isinstance(getattr(j, "jaxpr", None), core.Jaxpr):
                yield j.jaxpr


_HAS: dict[int, tuple[Any, bool]] = {}


def has_sites(jaxpr: Any) -> bool:
    """Whether an open jaxpr holds call sites (markers or named scopes) at any depth that an
    evaluation reaches (not inside custom derivatives or ``shard_map``)."""
    hit = _HAS.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    found = False
    for eqn in jaxpr.eqns:
        if eqn.primitive is site_p or _scopes(eqn):
            found = True
            break
        name = eqn.primitive.name
        if (name in _INLINE or name in _REBIND) and any(has_sites(j) for j in _sub_jaxprs(eqn)):
            found = True
            break
    if len(_HAS) > 16384:
        _HAS.clear()
    _HAS[id(jaxpr)] = (jaxpr, found)
    return found


# ---------------------------------------------------------------------------------------------
# The program.


class Site:
    """A call site of a program without modules: what hooks see as ``ctx.module``.

    Attributes:
      path: its path (``("forward_layer", 0, "attention")``).
      kind: ``"function"`` (a Python function's call) or ``"scope"`` (a named scope).
      name: the function's or scope's name.
    """

    def __init__(self, path: tuple[Any, ...], kind: str, name: str) -> None:
        self.path = path
        self.kind = kind
        self.name = name

    def __repr__(self) -> str:
        key = "/".join(str(p) for p in self.path)
        return f"Site({key!r}, {self.kind} {self.name!r})"


_SITE_TYPES: dict[str, type[Site]] = {}


def _site_type(name: str) -> type[Site]:
    """A :class:`Site` subclass named ``name`` (the function's name, or ``named_scope``): what
    tables and messages show as a call site's type, as a module's class name is shown."""
    cls = _SITE_TYPES.get(name)
    if cls is None:
        cls = _SITE_TYPES[name] = type(name, (Site,), {"__module__": __name__})
    return cls


@dataclasses.dataclass
class Program:
    """A traced program without modules: its jaxpr, how its arguments map to it, its sites."""

    closed: Any
    in_tree: Any
    in_spec: list[Any]
    out_tree: Any
    paths: dict[tuple[Any, ...], Site]  # location of a region -> its site
    root: Site
    compiled: Any = None  # its evaluation under jax.jit, for a jitted program (made on demand)

    def sites(self) -> list[Site]:
        return list(self.paths.values())


def discover(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Program | None:
    """Trace ``fn(*args, **kwargs)`` for its call sites; None when it calls a framework's
    module (the adapters see its call sites) or when it has none."""
    from .._engine import context as _context

    treedef, spec, dyn = _split((args, kwargs), _ARRAYS)

    def flat(*leaves: Any) -> Any:
        a, k = _join(treedef, spec, list(leaves))
        return fn(*a, **k)

    rec = _Recorder(_root_code(fn))
    previous = sys.getprofile()
    with _context.ACTIVE(DISCOVERING):
        sys.setprofile(rec)
        try:
            closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*dyn)
        finally:
            sys.setprofile(previous)
    if rec.modules:
        return None
    if rec.failed is not None:
        raise rec.failed
    jaxpr, _ = closed_parts(closed)
    prog = Program(
        closed,
        treedef,
        spec,
        jax.tree.structure(out_shape),
        {},
        _site_type(_fn_name(fn))((), "function", _fn_name(fn)),
    )
    _assign_paths(prog, jaxpr, (), ())
    return prog


class _Discovering:
    """The value of hookax's user context during a discovery trace: keys JAX's caches apart,
    so a jitted user function is traced again (and its calls seen) rather than reused."""

    kind = "discover"

    def __repr__(self) -> str:
        return "<hookax discovery>"

    def __hash__(self) -> int:
        return hash("hookax discovery")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Discovering)


DISCOVERING = (_Discovering(),)


def _root_code(fn: Any) -> types.CodeType | None:
    """The code of the function a program's root is (through partials, bound methods, jit and
    ``functools.wraps`` wrappers, a callable object's ``__call__``)."""
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        elif isinstance(fn, types.FunctionType):
            return fn.__code__
        elif isinstance(vars(type(fn)).get("__call__"), types.FunctionType):
            return vars(type(fn))["__call__"].__code__
        else:
            return None
    return None


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _assign_paths(prog: Program, node: Any, loc: tuple[Any, ...], parent: tuple[Any, ...]) -> None:
    """Give every region reached from ``node`` (a jaxpr, or a region's inside) at location
    ``loc``, below the call site at ``parent``, its path; a name that occurs more than once
    under one parent is numbered in program order."""
    found: list[tuple[tuple[Any, ...], Region, Any]] = []
    if isinstance(node, _Inside):
        lo, hi = node.bounds()
        _collect(node.jaxpr, lo, hi, node.region.children, loc, found)
    else:
        _collect(node, 0, len(node.eqns), regions(node), loc, found)
    counts: dict[str, int] = {}
    for _, r, _ in found:
        counts[r.name] = counts.get(r.name, 0) + 1
    seen: dict[str, int] = {}
    for rloc, r, jaxpr in found:
        if counts[r.name] > 1:
            i = seen.get(r.name, 0)
            seen[r.name] = i + 1
            path: tuple[Any, ...] = (*parent, r.name, i)
        else:
            path = (*parent, r.name)
        kind = "function" if r.kind == "call" else "scope"
        prog.paths[rloc] = _site_type(r.name if kind == "function" else "named_scope")(
            path, kind, r.name
        )
        _assign_paths(prog, _Inside(jaxpr, r), rloc, path)


class _Inside:
    """A region's inside: its equations (a call's without its markers) and nested regions."""

    def __init__(self, jaxpr: Any, region: Region) -> None:
        self.jaxpr = jaxpr
        self.region = region

    def bounds(self) -> tuple[int, int]:
        r = self.region
        return (r.start + 1, r.end) if r.kind == "call" else (r.start, r.end + 1)


def _collect(
    jaxpr: Any, lo: int, hi: int, rs: list[Region], loc: tuple[Any, ...], found: list[Any]
) -> None:
    """The regions directly below the current call site among ``jaxpr.eqns[lo:hi]`` (whose
    outermost regions are ``rs``), through the higher-order equations an evaluation descends
    into, in program order: ``(location, region, its jaxpr)``."""
    starts = {r.start: r for r in rs}
    i = lo
    while i < hi:
        r = starts.get(i)
        if r is not None:
            found.append(((*loc, ("r", r.start)), r, jaxpr))
            i = r.end + 1
            continue
        eqn = jaxpr.eqns[i]
        for k, sub in _reached(eqn):
            _collect(sub, 0, len(sub.eqns), regions(sub), _sub_loc(loc, i, k), found)
        i += 1


def _sub_loc(loc: tuple[Any, ...], i: int, k: int) -> tuple[Any, ...]:
    return (*loc, ("e", i, k))


def _reached(eqn: Any) -> list[tuple[int, Any]]:
    """``(index, open jaxpr)`` of the sub-jaxprs an evaluation descends into: those of a
    ``jit``, ``scan``, ``while``, ``cond`` or ``checkpoint`` equation, if any holds a site."""
    name = eqn.primitive.name
    if name not in _INLINE and name not in _REBIND:
        return []
    subs = list(enumerate(_sub_jaxprs(eqn)))
    return subs if any(has_sites(j) for _, j in subs) else []


def _index_of(eqn: Any, jaxpr: Any) -> int:
    for k, j in enumerate(_sub_jaxprs(eqn)):
        if j is jaxpr:
            return k
    raise AssertionError("hookax: a sub-jaxpr not among its equation's parameters")


# ---------------------------------------------------------------------------------------------
# Evaluation.


class Evaluator:
    """Runs a :class:`Program` with each region as a call site through the dispatcher."""

    def __init__(self, prog: Program, adapter: Any) -> None:
        self.prog = prog
        self.adapter = adapter

    def run(self, args: tuple, kwargs: dict) -> Any:
        from .._engine import dispatch as _dispatch

        return _dispatch.call(self._root, "__call__", self.prog.root, args, kwargs, self.adapter)

    def _root(self, site: Site, *args: Any, **kwargs: Any) -> Any:
        prog = self.prog
        leaves = jax.tree.leaves((args, kwargs))
        dyn = [x for x, s in zip(leaves, prog.in_spec, strict=False) if isinstance(s, int)]
        jaxpr, consts = closed_parts(prog.closed)
        outs = self.jaxpr(jaxpr, consts, dyn, ())
        return jax.tree.unflatten(prog.out_tree, outs)

    def jaxpr(
        self, jaxpr: Any, consts: list[Any], args: list[Any], loc: tuple[Any, ...]
    ) -> list[Any]:
        env: dict[Any, Any] = {}
        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        self.range(jaxpr, 0, len(jaxpr.eqns), regions(jaxpr), env, loc)
        return [_read(env, v) for v in jaxpr.outvars]

    def range(
        self, jaxpr: Any, lo: int, hi: int, rs: list[Region], env: dict, loc: tuple[Any, ...]
    ) -> None:
        starts = {r.start: r for r in rs}
        i = lo
        eqns = jaxpr.eqns
        while i < hi:
            r = starts.get(i)
            if r is not None:
                self.region(jaxpr, r, env, (*loc, ("r", r.start)))
                i = r.end + 1
                continue
            eqn = eqns[i]
            invals = [_read(env, v) for v in eqn.invars]
            if eqn.primitive is site_p:
                outs = invals
            else:
                outs = self.eqn(eqn, invals, loc, i)
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
            i += 1

    def region(self, jaxpr: Any, r: Region, env: dict, rloc: tuple[Any, ...]) -> None:
        from .._engine import dispatch as _dispatch

        site = self.prog.paths[rloc]
        eqns = jaxpr.eqns
        if r.kind == "call":
            info = r.info
            assert info is not None
            enter = eqns[r.start]
            exit_ = eqns[r.end]
            in_vars = list(enter.invars)
            dyn = [_read(env, v) for v in in_vars]
            a, k = _join(info.in_tree, info.in_leaves, dyn)

            def body(_site: Site, *args: Any, **kwargs: Any) -> Any:
                new = _pick(info.in_leaves, (args, kwargs))
                saved = {v: env.get(v) for v in in_vars if isinstance(v, core.Var)}
                for v, x in zip(in_vars, new, strict=True):
                    if isinstance(v, core.Var):
                        env[v] = x
                try:
                    self.range(jaxpr, r.start + 1, r.end, r.children, env, rloc)
                    ret = [_read(env, v) for v in exit_.invars]
                finally:
                    for v, x in saved.items():
                        env[v] = x
                return _join(info.out_tree, info.out_leaves, ret)

            # The hooks run in the context the call ran in: under ``auto_axes`` (a function it
            # decorates, or calls) the mesh's axes are Auto there, and the values' types say so.
            with mesh_context(enter.ctx):
                out = _dispatch.call(body, "__call__", site, a, k, self.adapter)
            new_out = _leaves_like(info.out_tree, info.out_leaves, out, site)
            for v, x in zip(exit_.invars, new_out, strict=True):
                if isinstance(v, core.Var):
                    env[v] = x
            for v, x in zip(exit_.outvars, new_out, strict=True):
                env[v] = x
            return
        outs = list(r.outs)

        def scope_body(_site: Site) -> Any:
            self.range(jaxpr, r.start, r.end + 1, r.children, env, rloc)
            vals = [_read(env, v) for v in outs]
            return vals[0] if len(vals) == 1 else tuple(vals)

        out = _dispatch.call(scope_body, "__call__", site, (), {}, self.adapter)
        vals = [out] if len(outs) == 1 else list(out)
        if len(vals) != len(outs):
            raise ValueError(
                f"hookax: a hook on {site!r} returned {len(vals)} values for the named scope's "
                f"{len(outs)} outputs"
            )
        for v, x in zip(outs, vals, strict=True):
            env[v] = x

    def eqn(self, eqn: Any, invals: list[Any], loc: tuple[Any, ...], i: int) -> list[Any]:
        name = eqn.primitive.name
        if not _reached(eqn):
            return bind_eqn(eqn, invals)
        p = eqn.params

        def run(closed: Any, args: list[Any]) -> list[Any]:
            jx, consts = closed_parts(closed)
            return self.jaxpr(jx, consts, args, _sub_loc(loc, i, _index_of(eqn, jx)))

        if name in _INLINE:
            return run(p.get("jaxpr", p.get("call_jaxpr")), invals)
        if name == "scan":
            return self._scan(p, invals, run)
        if name == "while":
            return self._while(p, invals, run)
        if name == "cond":
            return self._cond(p, invals, run)
        # checkpoint / remat

        def f(*xs: Any) -> list[Any]:
            return run(p["jaxpr"], list(xs))

        kw = {}
        if "prevent_cse" in p:
            kw["prevent_cse"] = p["prevent_cse"]
        if "policy" in p:
            kw["policy"] = p["policy"]
        return list(jax.checkpoint(f, **kw)(*invals))

    def _scan(self, p: dict, invals: list[Any], run: Callable[..., Any]) -> list[Any]:
        nc, nk, _ = scan_counts(p)
        consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]

        def step(carry: Any, x: Any) -> Any:
            outs = run(p["jaxpr"], [*consts, *carry, *x])
            return outs[:nk], outs[nk:]

        carry, ys = lax.scan(
            step,
            list(init),
            list(xs),
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        return [*carry, *ys]

    def _while(self, p: dict, invals: list[Any], run: Callable[..., Any]) -> list[Any]:
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]

        def cond(c: Any) -> Any:
            return run(p["cond_jaxpr"], [*cconsts, *c])[0]

        def body(c: Any) -> Any:
            return run(p["body_jaxpr"], [*bconsts, *c])

        return list(lax.while_loop(cond, body, list(init)))

    def _cond(self, p: dict, invals: list[Any], run: Callable[..., Any]) -> list[Any]:
        index, ops = invals[0], invals[1:]
        fns = [lambda *xs, br=br: run(br, list(xs)) for br in p["branches"]]
        return list(lax.switch(index, fns, *ops))


def _read(env: dict, v: Any) -> Any:
    if isinstance(v, core.Literal):
        return v.val
    return env[v]


def _pick(spec: list[Any], tree: Any) -> list[Any]:
    """The leaves of ``tree`` at the traced positions of ``spec``."""
    flat = jax.tree.leaves(tree)
    n = sum(isinstance(s, int) for s in spec)
    dyn: list[Any] = [None] * n
    for s, x in zip(spec, flat, strict=False):
        if isinstance(s, int):
            dyn[s] = x
    return dyn


def _leaves_like(treedef: Any, spec: list[Any], out: Any, site: Site) -> list[Any]:
    """The traced leaves of what a call site returned, which must have the structure the rest
    of the program reads."""
    got = jax.tree.structure(out)
    if got != treedef:
        from .._util.errors import HookError

        raise HookError(
            f"hookax: the call site {'/'.join(map(str, site.path))!r} returned a value of "
            f"structure {got}, but the program reads one of structure {treedef}. Fix: return "
            "a value of the structure the hook or interceptor received."
        )
    return _pick(spec, out)
