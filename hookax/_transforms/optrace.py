"""The trace that sees every operation of one call site: counts, names, marks and edits them.

While a call site selected by an ``ops=`` entry runs its method, an :class:`OpTrace` sits on top
of the current trace (forwarding everything, like ``tagrules.HarvestTrace``). Each primitive bound
at the call site's own level is an *operation*, named by its primitive (``dot_general``) or, for
a function the program keeps as a unit, by the function (a ``jax.jit`` function's name, a
``custom_jvp``/``custom_vjp`` function's name; a leading ``_`` is dropped: ``softmax``,
``einsum``). The n-th operation of a name within one call of the call site has the address
``"<key>:<name>#n"`` (``#0`` is left out).

Operations are counted in program order, a named function before what it contains, at every
depth: the walker re-traces the inner jaxpr of each higher-order primitive (jit, scan, cond,
while, checkpoint, custom_jvp/vjp functions) through a nested :class:`OpTrace`, and binds the
primitive with the re-traced jaxpr only when a handler changed something in it, so a call site
whose operations are only counted compiles to the program it had.

Which call site an operation belongs to is read from the name stack: the dispatcher pushes a
:class:`CallScope` for every call site while an ``ops=`` entry is active, and JAX records name
stacks relative to each inner jaxpr, so an operation inside a child module's call (even one
traced into an inner jaxpr) carries the child's scope, and is the child's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np

from .._engine import eager as _eager
from .._util.errors import HookaxError, HookError
from .._util.jaxcompat import (
    ClosedJaxpr,
    ad_checkpoint,
    as_closed,
    conditionals,
    core,
    jit_inlined,
    loops,
    pjit,
    scan_params,
)
from .._util.jaxcompat import source_info_util as siu
from .tagrules import (
    _as_fun,
    _closed_to_consts,
    _eval,
    _in_avals,
    _restore,
    _trace,
    while_with,
)
from .tags import ForwardingTrace, tag_p

__all__ = ["CallScope", "OpContext", "OpTrace", "Site", "Walker"]


class CallScope(siu.Scope):
    """The name-stack entry of one call site in progress (also labels profiler traces)."""

    __slots__ = ()


def push_scope(label: str) -> tuple[CallScope, Any]:
    """A new :class:`CallScope` and the context manager that puts it on the name stack."""
    scope = CallScope(label)
    stack = siu.current_name_stack()
    return scope, siu.set_name_stack(siu.NameStack((*stack.stack, scope)))


def owner_scope() -> CallScope | None:
    """The innermost call site's scope on the current name stack."""
    for s in reversed(siu.current_name_stack().stack):
        if isinstance(s, CallScope):
            return s
    return None


@dataclasses.dataclass(frozen=True)
class OpContext:
    """What an ``hx.intercept_op`` edit function receives with an operation's value.

    Attributes:
      address: ``"layers/0/attn:softmax"``: the call site's key, ``:``, the name, ``#n``.
      key: the call site's key (``"layers/0/attn"``).
      name: the operation's name (a primitive's, or a named function's).
      index: which operation of that name within this call of the call site (0 first).
      primitive: the JAX primitive bound (``"dot_general"``, ``"jit"``, ``"custom_jvp_call"``).
      module: the module whose method is running.
      method: that method's name.
      path: the module's path.
      inputs: the operation's inputs, as ``jax.ShapeDtypeStruct`` (other inputs, such as NNX
        variables in their hijax form, as their abstract values).
      source: where the operation was written (``"file.py:12 (fn)"``).
    """

    address: str
    key: str
    name: str
    index: int
    primitive: str
    module: Any
    method: str
    path: tuple[Any, ...]
    inputs: tuple[Any, ...]
    source: str


def op_name(prim: Any, params: dict) -> str:
    if prim is pjit.jit_p:
        return _clean(params.get("name", "jit"))
    return _RENAMED.get(prim.name, prim.name)


_RENAMED = {"remat2": "checkpoint", "pjit": "jit"}


def _clean(name: str) -> str:
    return name.strip("<>").lstrip("_") or name


def fun_name(fun: Any) -> str:
    info = getattr(fun, "debug_info", None)
    name = getattr(info, "func_name", None) or "function"
    # "f" or "f at file:line" depending on the JAX version
    return _clean(str(name).split(" ")[0])


_HERE = os.path.dirname(os.path.abspath(__file__))
_ENGINE = (_HERE, os.path.join(_HERE, "frameworks"))  # hookax's own frames (not its examples)


def _ours(filename: str) -> bool:
    return os.path.dirname(filename) in _ENGINE


def _source() -> str:
    """The innermost frame outside JAX and hookax: ``"flax/nnx/nn/attention.py:179 (fn)"``."""
    # A replayed operation's recorded traceback (JAX keeps its innermost frames only), then
    # the Python stack.
    for f in siu.user_frames(siu.current().traceback):
        if not _ours(f.file_name):
            return f"{_short_path(f.file_name)}:{f.start_line} ({f.function_name})"
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if siu.is_user_filename(name) and not _ours(name):
            return f"{_short_path(name)}:{frame.f_lineno} ({frame.f_code.co_qualname})"
        frame = frame.f_back
    return ""


def _short_path(path: str) -> str:
    """``path`` as its package names it (``flax/nnx/nn/linear.py``: from the folder on
    ``sys.path`` that holds it, an editable install's too), else from the current folder."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker) :]
    return _relative(path, os.getcwd(), tuple(sys.path))


@functools.lru_cache(maxsize=1024)
def _relative(path: str, cwd: str, roots: tuple[str, ...]) -> str:
    best = ""
    for root in (cwd, *roots):
        folder = os.path.join(os.path.abspath(root or cwd), "")
        if path.startswith(folder) and len(folder) > len(best) and folder != os.sep:
            best = folder
    return path[len(best) :] if best else path


def _struct(x: Any) -> Any:
    """An input as ``jax.ShapeDtypeStruct``; a non-array input (an NNX hijax variable, a
    reference) as its abstract value."""
    aval = core.typeof(x)
    if getattr(aval, "dtype", None) is None or not hasattr(aval, "shape"):
        return aval
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


@dataclasses.dataclass(frozen=True)
class Site:
    """The call site a walker counts in. Not its ``hx.Context``: that holds the method wrapper,
    which holds the walker's method; a cycle would keep the call's tracers alive until the
    cycle collector ran (Linen's leak test runs without it)."""

    key: str
    module: Any
    method: str
    path: tuple[Any, ...]


_ORDER = itertools.count()  # operations, in program order (named functions before their insides)


class Walker:
    """The operations of one call of one call site: their counts and the handlers they meet.

    ``handlers`` are the ``OpHandler`` objects of the active ``ops=`` entries whose call-site
    part matches this call site; each decides per operation (``handler.visit``).
    """

    def __init__(self, scope: CallScope, site: Site, handlers: list[Any]) -> None:
        self.scope = scope
        self.site = site
        self.key = site.key
        self.handlers = handlers
        self.counts: dict[str, int] = {}
        self.touched = False  # whether a handler marked or edited a value (inside the current walk)
        self.custom: list[str] = []  # addresses of the custom-derivative functions we are inside
        self.named: list[str] = []  # addresses of the named operations we are inside
        self.names: list[str] = []  # and their names

    def within_name(self) -> str | None:
        return self.names[-1] if self.names else None

    def next(self, name: str) -> int:
        """Count one operation named ``name``: its index. Handlers learn where it begins (a
        named function begins before what it contains)."""
        n = self.counts.get(name, 0)
        self.counts[name] = n + 1
        order = next(_ORDER)
        for h in self.handlers:
            h.begin(self, name, n, order)
        return n

    def address(self, name: str, n: int) -> str:
        return f"{self.key}:{name}" + (f"#{n}" if n else "")

    def apply(self, name: str, n: int, prim: Any, args: Any, flat: list[Any]) -> list[Any]:
        """Run the handlers on one operation's outputs; the (possibly new) outputs."""
        address = self.address(name, n)
        op = None
        value: Any = flat[0] if len(flat) == 1 else tuple(flat)
        for h in self.handlers:
            if not h.wants(self, name, n, address):
                continue
            if op is None:
                op = OpContext(
                    address,
                    self.key,
                    name,
                    n,
                    prim.name,
                    self.site.module,
                    self.site.method,
                    self.site.path,
                    tuple(_struct(a) for a in args),
                    _source(),
                )
            value = h.visit(self, op, value)
        if op is None:
            return flat
        return [value] if len(flat) == 1 else list(value)

    def edit(self, fn: Any, op: OpContext, value: Any) -> Any:
        """Apply an edit function; checks that what it returns fits the program."""
        new = fn(value, op)
        if new is None:
            return value
        if self.custom:  # an edit that changes nothing (None) is harmless there
            raise HookaxError(
                f"hx.intercept_op: operation {op.address!r} runs inside the custom-derivative "
                f"function {self.custom[-1]!r}, whose gradient rule would not see the edit. Edit "
                f"that function's output instead: ops={self.custom[-1]!r}."
            )
        old_leaves, old_tree = jax.tree.flatten(value)
        new_leaves, new_tree = jax.tree.flatten(new)
        old_tree, new_tree = cast(Any, old_tree), cast(Any, new_tree)
        if old_tree != new_tree:
            raise HookError(
                f"hx.intercept_op: edit function {_fname(fn)} returned a value of structure "
                f"{new_tree} for operation {op.address!r}, whose output has structure "
                f"{old_tree}. Return None (no change) or a value of the same structure."
            )
        out = []
        for a, b in zip(old_leaves, new_leaves):
            sa, sb = np.shape(a), np.shape(b)
            if sa != sb:
                raise HookError(
                    f"hx.intercept_op: edit function {_fname(fn)} returned shape {sb} for "
                    f"operation {op.address!r}, whose output has shape {sa}; an operation's "
                    f"value is used by the rest of the program as it was traced. Return an "
                    f"array of shape {sa}."
                )
            want, got = core.typeof(a), core.typeof(b)
            if got.dtype != want.dtype and not getattr(got, "weak_type", False):
                raise HookError(
                    f"hx.intercept_op: edit function {_fname(fn)} returned dtype {got.dtype} "
                    f"for operation {op.address!r}, whose output is {want.dtype}. Return "
                    f"{want.dtype} (value.astype(...))."
                )
            out.append(jax.numpy.asarray(b, want.dtype))
        self.touched = True
        return old_tree.unflatten(out)


def _fname(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class OpTrace(ForwardingTrace):
    """A forwarding trace that names the call site's own operations and lets the walker's
    handlers see (and change) their values."""

    __slots__ = ("walker",)

    def __init__(self, parent: Any, walker: Walker) -> None:
        super().__init__(parent)
        self.walker = walker

    def mine(self) -> bool:
        s = owner_scope()
        return s is None or s is self.walker.scope

    def process_primitive(self, prim: Any, args: Any, params: Any) -> Any:
        if prim is tag_p or not self.mine():
            return self.forward(prim, args, params)
        w = self.walker
        rule = DESCEND.get(prim)
        name = op_name(prim, params)
        if (
            rule is not None
            and prim is pjit.jit_p
            and (jit_inlined(params) or name == w.within_name())
        ):
            # jax.numpy's functions are jitted with inline=True: they are inlined into the
            # program (no unit), so their primitives are the operations. A jit directly inside
            # a function of the same name (jax.nn.relu is a custom_jvp of a jit) is that function.
            return rule(self, prim, list(args), params)
        n = w.next(name)
        if rule is None:
            out = self.forward(prim, args, params)
        else:
            w.named.append(w.address(name, n))
            w.names.append(name)
            try:
                out = rule(self, prim, list(args), params)
            finally:
                w.named.pop()
                w.names.pop()
        flat = list(out) if prim.multiple_results else [out]
        with core.set_current_trace(self.parent):  # handlers' own operations are not counted
            new = w.apply(name, n, prim, args, flat)
        return new if prim.multiple_results else new[0]

    def process_custom_jvp_call(
        self, prim: Any, fun: Any, jvp: Any, args: Any, *, symbolic_zeros: bool
    ) -> Any:
        params: dict[str, Any] = {"symbolic_zeros": symbolic_zeros}
        return self._custom(prim, fun, (jvp,), args, params)

    def process_custom_vjp_call(
        self, prim: Any, fun: Any, fwd: Any, bwd: Any, args: Any, **kw: Any
    ) -> Any:
        return self._custom(prim, fun, (fwd, bwd), args, dict(kw))

    def _custom(self, prim: Any, fun: Any, rules: tuple, args: Any, params: dict) -> Any:
        avals = [core.typeof(a) for a in args]

        def bind(body: Any) -> Any:
            p = {**params, "subfuns": (body, *rules)}
            return prim.bind_with_trace(self.parent, args, avals, p)

        if not self.mine():
            return bind(fun)
        w = self.walker
        name = fun_name(fun)
        n = w.next(name)
        address = w.address(name, n)
        # Trace the function's body ourselves, so its operations are counted whatever the
        # parent does with it (under jvp the rule runs instead of the body).
        w.named.append(address)
        w.names.append(name)
        w.custom.append(address)
        before, w.touched = w.touched, False
        try:
            closed, saved = _trace_fun(fun.wrap(_under, (w,), None), args)
        finally:
            w.custom.pop()
            w.named.pop()
            w.names.pop()
        touched, w.touched = w.touched, before
        if touched:
            out = bind(_as_fun(closed, fun))
            _restore(saved, rules[0])
        elif (below := _eager_below(self)) is not None and (run := _eager.program_of(closed, name)):
            # Run eagerly: the traced body as one program (op by op, each of its operations
            # compiled once per process), with the function's stores as its run leaves them.
            with core.set_current_trace(below):
                out = run(*args)
            _restore(saved, rules[0])
        else:  # nothing inside changed: the function as it was (its stores were emptied)
            out = bind(fun)
        with core.set_current_trace(self.parent):
            return w.apply(name, n, prim, args, list(out))

    def process_shard_map(self, prim: Any, fun: Any, args: Any, **params: Any) -> Any:
        if not self.mine():
            return self.parent.process_shard_map(prim, fun, args, **params)
        # Transparent, like an inlined jit: its body's (per-shard) operations are the call
        # site's, and their values leave stacked per shard (the shard_map rule of _tagrules).
        w = self.walker

        def body(*a: Any) -> Any:
            with core.set_current_trace(OpTrace(core.trace_ctx.trace, w)):
                return fun(*a)

        return self.parent.process_shard_map(prim, body, args, **params)


def _eager_below(trace: Any) -> Any:
    """The eager trace under ``trace`` and the traces that only forward to it, or None."""
    t = trace.parent
    while isinstance(t, ForwardingTrace):
        t = t.parent
    return t if type(t) is core.EvalTrace else None


def _under(f: Any, walker: Walker, *args: Any) -> Any:
    with core.set_current_trace(OpTrace(core.trace_ctx.trace, walker)):
        return f(*args)


def _trace_fun(fun: Any, args: Any) -> tuple[ClosedJaxpr, list[tuple[Any, Any]]]:
    from .tagrules import _trace_fun as trace_fun

    return trace_fun(fun, args)


def walk(closed: Any, walker: Walker) -> tuple[ClosedJaxpr, bool]:
    """``closed`` re-traced with its operations through ``walker``; whether a handler changed
    anything in it."""
    before, walker.touched = walker.touched, False

    def body(*args: Any) -> list[Any]:
        with core.set_current_trace(OpTrace(core.trace_ctx.trace, walker)):
            return _eval(closed, list(args))

    try:
        new = _trace(body, _in_avals(closed))
    finally:
        touched, walker.touched = walker.touched, before
    walker.touched = before or touched
    return new, touched


def _bind(trace: OpTrace, prim: Any, args: list[Any], params: dict) -> Any:
    return prim.bind_with_trace(trace.parent, args, [core.typeof(a) for a in args], params)


def _jit(trace: OpTrace, prim: Any, args: list[Any], params: dict) -> Any:
    new, touched = walk(params["jaxpr"], trace.walker)
    if not touched:
        return _bind(trace, prim, args, params)
    # An edit may close over values of the enclosing trace (``v * s`` with ``s`` traced): they
    # are the re-traced jaxpr's constants, and a jit takes them as leading inputs.
    body, consts = _closed_to_consts(new)
    k = len(consts)
    p = dict(
        params,
        jaxpr=body,
        in_shardings=(*[pjit.UNSPECIFIED] * k, *params["in_shardings"]),
        in_layouts=(*[None] * k, *params["in_layouts"]),
        donated_invars=(*[False] * k, *params["donated_invars"]),
    )
    return _bind(trace, prim, [*consts, *args], p)


def _scan(trace: OpTrace, prim: Any, args: list[Any], params: dict) -> Any:
    new, touched = walk(params["jaxpr"], trace.walker)
    if not touched:
        return _bind(trace, prim, args, params)
    body, consts = _closed_to_consts(new)
    p = scan_params(params, body, consts=len(consts))
    return _bind(trace, prim, [*consts, *args], p)


def _cond(trace: OpTrace, prim: Any, args: list[Any], params: dict) -> Any:
    walked = [walk(b, trace.walker) for b in params["branches"]]
    if not any(t for _, t in walked):
        return _bind(trace, prim, args, params)
    # Every branch takes every branch's constants (an edit's closed-over values) as operands.
    opened = [_closed_to_consts(b) for b, _ in walked]
    consts = [c for _, cs in opened for c in cs]
    avals = [core.typeof(c) for c in consts]
    n_in = len(params["branches"][0].in_avals)
    branches = []
    start = 0
    for body, cs in opened:

        def branch(*a: Any, body: Any = body, lo: int = start, hi: int = start + len(cs)) -> Any:
            return _eval(body, [*a[n_in + lo : n_in + hi], *a[:n_in]])

        branches.append(_trace(branch, [*params["branches"][0].in_avals, *avals]))
        start += len(cs)
    index, ops = args[0], args[1:]
    return _bind(trace, prim, [index, *ops, *consts], dict(params, branches=tuple(branches)))


def _while(trace: OpTrace, prim: Any, args: list[Any], params: dict) -> Any:
    cond, t1 = walk(params["cond_jaxpr"], trace.walker)
    body, t2 = walk(params["body_jaxpr"], trace.walker)
    if not (t1 or t2):
        return _bind(trace, prim, args, params)
    p, new_args = while_with(params, cond, body, args)
    return _bind(trace, prim, new_args, p)


def _remat(trace: OpTrace, prim: Any, args: list[Any], params: dict) -> Any:
    new, touched = walk(as_closed(params["jaxpr"]), trace.walker)
    if not touched:
        return _bind(trace, prim, args, params)
    body, consts = _closed_to_consts(new)
    cse = params["prevent_cse"]
    if isinstance(cse, tuple):
        cse = (*[False] * len(consts), *cse)
    return _bind(trace, prim, [*consts, *args], dict(params, jaxpr=body.jaxpr, prevent_cse=cse))


DESCEND: dict[Any, Callable[..., Any]] = {
    pjit.jit_p: _jit,
    loops.scan_p: _scan,
    loops.while_p: _while,
    conditionals.cond_p: _cond,
    ad_checkpoint.remat_p: _remat,
}
