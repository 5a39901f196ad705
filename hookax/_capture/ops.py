"""Operations inside call sites: ``ops=`` patterns, their handlers, and ``hx.intercept_op``.

An ``ops=`` pattern is ``"<call site>:<operation>"``: a path glob (``"layers/*/attn"``, ``"**"``),
optionally ``:method`` (without one: the call sites of every method there), then an operation
name glob and an optional ``#n`` (``"softmax"``, ``"dot_general#1"``, ``"dot_general#*"`` for
every one). Each consumer (a capture session, an edit block, a listing) is one
``Entry("ops", OpHandler, ...)`` among the active entries, so it is part of the jit cache key
like every interceptor; ``_optrace`` does the work inside call sites.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .._engine import dispatch as _dispatch
from .._engine.select import (
    ALL_METHODS,
    Select,
    Selector,
    check_glob,
    forget_unmatched,
    remember_unmatched,
    repeat_unmatched,
    split_layers,
    split_method,
)
from .._hooks import layergate as _layergate
from .._transforms import tags as _tags
from .._transforms.optrace import OpContext, Site, Walker, push_scope
from .._util.errors import HookaxError, SelectorError
from .._util.fnkey import FnKey, note_fresh

__all__ = [
    "OpHandler",
    "OpPattern",
    "Sites",
    "check_ops",
    "enter_site",
    "intercept_op",
    "named_scopes",
    "parse_ops",
    "scope_chain",
]

_OP = re.compile(r"(?P<name>[^#:/\s]+?)(?:#(?P<index>\d+|\*))?")


@functools.lru_cache(maxsize=256)
def _name_rx(glob: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in glob.split("*")))


@dataclasses.dataclass(frozen=True)
class OpPattern:
    """One ``ops=`` string: which call sites, which operation name, which occurrence."""

    text: str
    site: Selector
    name: str  # a glob over operation names
    index: int | None  # None: every occurrence

    def matches(self, name: str, n: int) -> bool:
        return (self.index is None or self.index == n) and bool(_name_rx(self.name).fullmatch(name))


def parse_ops(ops: Any, who: str) -> tuple[OpPattern, ...]:
    """``ops=`` (a string or a list of them) as patterns; a malformed one raises at once."""
    if ops is None:
        return ()
    items = [ops] if isinstance(ops, str) else ops
    if not isinstance(items, list | tuple) or not items:
        raise SelectorError(
            f"{who}: ops= takes an operation address or a list of them, got {ops!r}. Fix: "
            "ops='layers/0/attn:softmax' (see hx.ops(model, x) for the addresses)."
        )
    out = []
    for text in items:
        if not isinstance(text, str):
            raise SelectorError(
                f"{who}: ops= entries are strings like 'layers/0/attn:softmax', got {text!r}."
            )
        site, sep, op = text.rpartition(":")
        if sep and op == "in":
            raise SelectorError(
                f"{who}: ops={text!r} names the input of call site {site!r}, a call site's "
                f"value, not an operation. Fix: pass it as where=: {who}(..., where={text!r})."
            )
        m = _OP.fullmatch(op)
        if not sep or m is None:
            raise SelectorError(
                f"{who}: ops={text!r} is not an operation address. An address is "
                "'<call site>:<operation>[#n]': 'layers/0/attn:softmax', "
                "'layers/*/mlp:dot_general#1', '**:softmax' (every call site), ':exp' (the root "
                "module). Fix: write the call site's path, a colon, then the operation; "
                "hx.ops(model, x) lists the addresses."
            )
        path, method = split_method(site)
        check_glob(split_layers(path)[0])
        index = m["index"]
        out.append(
            OpPattern(
                text,
                # No method named: the operations of every method a call site runs
                # ("**:softmax" finds the one inside "attn:forward").
                Select(paths=path, methods=method or ALL_METHODS),
                m["name"],
                None if index == "*" else int(index or 0),
            )
        )
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Sites(Selector):
    """The call sites any of the patterns names (the selector of an ``ops`` entry)."""

    patterns: tuple[OpPattern, ...]

    def matches(self, ctx: Any) -> bool:
        return any(p.site.matches(ctx) for p in self.patterns)

    def names_methods(self) -> bool:
        return True

    def needs_path(self) -> bool:
        return True


class Notes:
    """What one consumer's patterns met: call sites whose part matched, operations seen (in
    those call sites), patterns that matched an operation. For ``SelectorError``."""

    def __init__(self) -> None:
        self.sites: set[str] = set()  # pattern texts whose call-site part matched
        self.seen: dict[str, None] = {}  # operation addresses in those call sites
        self.hit: set[str] = set()  # pattern texts that matched an operation
        self.calls: set[tuple[str, str]] = set()  # (key, path) of every call site that ran


@dataclasses.dataclass(frozen=True)
class OpHandler:
    """One consumer of operations; the key of its ``ops`` entry (compared by value).

    ``action``: ``"mark"`` (``arg`` is a session id: capture and gradients), ``"edit"`` (``arg``
    is the edit function's :class:`FnKey`), ``"list"`` (``arg`` is a listing, by identity),
    ``"scope"`` (no patterns: only the name-stack labels of :func:`named_scopes`), ``"sites"``
    (the labels, and ``arg.add(chain, ctx)`` told each call site's: ``hx.profile``).
    """

    action: str
    arg: Any
    patterns: tuple[OpPattern, ...]


class Bound:
    """An :class:`OpHandler` at one call site: the patterns whose call-site part matched, and
    the scan iterations each picks (``"blocks/attn[3]:softmax"``; None: every call)."""

    __slots__ = ("frame", "handler", "layers", "notes", "patterns")

    def __init__(
        self,
        handler: OpHandler,
        patterns: list[OpPattern],
        notes: Notes | None,
        frame: Any = None,
        layers: list[frozenset[int] | None] | None = None,
    ):
        self.handler = handler
        self.patterns = patterns
        self.notes = notes
        self.frame = frame
        self.layers = layers

    def layers_of(self, name: str, n: int) -> frozenset[int] | None:
        """The scan iterations the patterns matching this operation pick (None: all)."""
        if self.layers is None:
            return None
        picked: frozenset[int] = frozenset()
        for p, layers in zip(self.patterns, self.layers, strict=True):
            if p.matches(name, n):
                if layers is None:
                    return None
                picked |= layers
        return picked

    def wants(self, walker: Walker, name: str, n: int, address: str) -> bool:
        hit = False
        notes = self.notes
        for p in self.patterns:
            if p.matches(name, n):
                hit = True
                if notes is not None:
                    notes.hit.add(p.text)
        if notes is not None:
            notes.seen[address] = None
        return hit

    def begin(self, walker: Walker, name: str, n: int, order: int) -> None:
        """An operation begins: a capture lists its address there (keys in program order), a
        listing reserves its row's place."""
        h = self.handler
        if h.action == "edit" or not any(p.matches(name, n) for p in self.patterns):
            return
        address = walker.address(name, n)
        if h.action == "mark":
            live = _tags.live_session(h.arg)
            layers = self.layers_of(name, n)
            if layers is not None:  # as visit() names it
                tail = address[len(walker.key) :]
                address = f"{walker.key}[{','.join(map(str, sorted(layers)))}]{tail}"
            if live is not None:
                live.starts.setdefault(address)
        else:
            h.arg.order.setdefault(address, order)

    def visit(self, walker: Walker, op: OpContext, value: Any) -> Any:
        h = self.handler
        layers = self.layers_of(op.name, op.index)
        if h.action == "mark":
            walker.touched = True
            address = op.address
            if layers is not None:
                _layergate.check_in_scan(self.frame, layers)
                tail = op.address[len(op.key) :]
                address = f"{op.key}[{','.join(map(str, sorted(layers)))}]{tail}"
                live = _tags.live_session(h.arg)
                if live is not None:
                    live.layered[address] = (op.key, tuple(sorted(layers)), tail)
            return _tags.mark(value, h.arg, address, op=True)
        if h.action == "edit":
            if layers is None:
                return walker.edit(h.arg.fn, op, value)
            pred = _layergate.layer_pred(self.frame, layers, value)
            edited = walker.edit(h.arg.fn, op, value)
            return _layergate.select(self.frame, pred, edited, value)
        h.arg.add(op, value, walker)
        return value


def _notes_for(handler: OpHandler) -> Notes | None:
    if handler.action == "mark":
        live = _tags.live_session(handler.arg)
        return None if live is None else live.op_notes
    if handler.action == "edit":
        stack = _TRACKERS.notes.get(handler)
        return stack[-1] if stack else None
    if handler.action == "list":
        return handler.arg.notes
    return None  # "scope": labels only


def enter_site(frame: Any, ctx: Any, entries: list[Any], fn: Callable[..., Any]) -> tuple[Any, Any]:
    """For a call site while ``ops`` entries are active: the name-stack scope to enter, and the
    method to call (``fn`` itself, or ``fn`` run under an :class:`OpTrace` when some entry's
    patterns name this call site)."""
    scope, cm = push_scope(_label(frame))
    bound = []
    for e in entries:
        h: OpHandler = e.key
        if h.action == "sites":  # hx.profile: which scope labels are which call sites
            h.arg.add(scope_chain(frame), ctx, frame.in_scan())
            continue
        notes = _notes_for(h)
        pats = [p for p in h.patterns if p.site.matches(ctx)]
        if notes is not None:
            notes.calls.add((ctx.key, ctx.path_str))
            notes.sites.update(p.text for p in pats)
        if pats:
            layers = None
            if any(p.site.has_layers() for p in pats):
                layers = [p.site.layers(ctx) for p in pats]
            bound.append(Bound(h, pats, notes, frame, layers))
    if not bound:
        return cm, fn
    # edits first (in the order their blocks were entered), then the marks and listings, so a
    # capture sees the value the rest of the program uses
    bound.sort(key=lambda b: b.handler.action != "edit")

    site = Site(ctx.key, ctx.module, ctx.method, ctx.path)  # not ctx: see Site
    if any(b.layers is not None for b in bound):
        frame.pin_scan()  # asked again at each operation, from traces below this one

    def method(module: Any, *args: Any, **kwargs: Any) -> Any:
        from .._transforms.optrace import OpTrace
        from .._util.jaxcompat import core

        walker = Walker(scope, site, bound)
        with core.set_current_trace(OpTrace(core.trace_ctx.trace, walker)):
            return fn(module, *args, **kwargs)

    return cm, method


_dispatch.SITE_SCOPE.register(enter_site, __name__)


def scope_chain(frame: Any) -> tuple[str, ...]:
    """The scope labels of a call site and of the call sites it runs inside, outermost first
    (an operation's ``op_name`` holds them in this order, with JAX's own scopes between)."""
    labels = []
    while frame is not None:
        labels.append(_label(frame))
        frame = frame.parent
    return tuple(reversed(labels))


def _label(frame: Any) -> str:
    """The scope's name: the call site's path below its caller's (profiler traces read
    ``layers/0/attn/dot_general``)."""
    path, parent = frame.path, frame.parent
    if parent is not None and path[: len(parent.path)] == parent.path:
        path = path[len(parent.path) :]
    s = "/".join(str(k) for k in path) or type(frame.module).__name__
    return s if frame.method == "__call__" else f"{s}:{frame.method}"


def check_ops(
    who: str,
    patterns: tuple[OpPattern, ...],
    notes: Notes,
    asker: Callable[[], Any] = lambda: None,
) -> None:
    """Raise :class:`SelectorError` for a pattern that matched no operation that ran
    (``asker``: as :func:`hookax._engine.select.check_matched` takes it)."""

    def key() -> tuple[str, str, int]:
        return (who, repr(tuple(p.text for p in patterns)), hash(asker()))

    if not notes.calls:
        repeat_unmatched(key)  # nothing ran (a cached trace): what its trace said, if it failed
        return
    try:
        _check_ops(who, patterns, notes)
    except SelectorError as e:
        remember_unmatched(key, str(e))
        raise
    forget_unmatched(key)


def _check_ops(who: str, patterns: tuple[OpPattern, ...], notes: Notes) -> None:
    for p in patterns:
        if p.text in notes.hit:
            continue
        if p.text not in notes.sites:
            keys = sorted({k for k, _ in notes.calls})
            site = p.text.rpartition(":")[0]
            near = difflib.get_close_matches(site, keys, n=6, cutoff=0.0) or keys[:6]
            raise SelectorError(
                f"{who}: ops={p.text!r} names no call site that ran: its call-site part "
                f"{site!r} matched none of them; those that ran include "
                f"{', '.join(map(repr, near))}. Fix: correct the path before the colon."
            )
        seen = list(notes.seen)
        if not seen:
            site, _, op = p.text.rpartition(":")
            raise SelectorError(
                f"{who}: ops={p.text!r} matched no operation: the call sites {site!r} names "
                "ran no operation of their own (an operation belongs to the innermost call "
                f"site around it). Fix: name the call site that holds it, or '**:{op}' for "
                "every call site's (hx.ops(fn, *args) lists every address)."
            )
        near = difflib.get_close_matches(p.text, seen, n=8, cutoff=0.0) or seen[:8]
        raise SelectorError(
            f"{who}: ops={p.text!r} matched no operation in the call sites it names; operations "
            f"that ran there include {', '.join(map(repr, near))}. Fix: use one of these "
            f"addresses (hx.ops(fn, *args) lists them all)."
        )


def _check_two_args(fn: Any) -> None:
    import inspect

    from .._util.errors import HookError

    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise HookError(
            f"hx.intercept_op: edit function {getattr(fn, '__qualname__', fn)!r} cannot be "
            "called as fn(value, op). Fix: `def edit(value, op): return value.at[...].set(0)`."
        ) from None
    except ValueError:  # no signature (a builtin): left to fail when called
        pass


def named_softmax() -> contextlib.AbstractContextManager[Any]:
    """``jax.nn.softmax`` as one named operation (``"softmax"``) while ``ops=`` is active.

    By default JAX 0.10 computes softmax inline (no unit in the program to address); with
    ``jax_softmax_custom_jvp`` (the announced future default, JAX PR 15677) it is a
    ``custom_jvp`` function. The forward values are the same; the gradient is JAX's custom rule.
    The flag is part of JAX's jit cache key, like the active entries.
    """
    from .._util.jaxcompat import config

    return config.softmax_custom_jvp(True)


class _Trackers(threading.local):
    def __init__(self) -> None:
        self.notes: dict[OpHandler, list[Notes]] = {}


_TRACKERS = _Trackers()


@contextlib.contextmanager
def _edit_block(handler: OpHandler) -> Iterator[None]:
    from .._hooks.intercept import Entry, scoped

    notes = Notes()
    stack = _TRACKERS.notes.setdefault(handler, [])
    stack.append(notes)
    try:
        with scoped(Entry("ops", handler, Sites(handler.patterns))), named_softmax():
            yield
    finally:
        stack.remove(notes)
        if not stack:
            del _TRACKERS.notes[handler]
    check_ops("hx.intercept_op", handler.patterns, notes, lambda: handler)


def named_scopes() -> contextlib.AbstractContextManager[None]:
    """Label every call site's operations with its module path, for the duration of a block.

    Each module call pushes its path on JAX's name stack (as ``jax.named_scope`` does), so the
    HLO's ``op_name`` metadata and profiler traces (``jax.profiler``, TensorBoard, Perfetto) read
    ``jit(step)/.../layers/0/attn/dot_general`` instead of a flat list. The labels are debug
    metadata: the optimized program is the same. Active scopes are part of the jit cache key, so
    a function traced inside the block is traced again outside it.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu)
      >>> with hx.named_scopes():
      ...     compiled = jax.jit(lambda m, x: m(x)).lower(model, jnp.ones((1, 2))).compile()
      >>> 'op_name="jit(<lambda>)/Sequential/layers/0/dot_general"' in compiled.as_text()
      True
    """
    from .._hooks.intercept import Entry, scoped

    return scoped(Entry("ops", OpHandler("scope", None, ()), Sites(())))


def intercept_op(
    fn: Callable[[Any, OpContext], Any], *, ops: Any
) -> contextlib.AbstractContextManager[None]:
    """Replace the values of operations inside call sites for the duration of a ``with`` block.

    ``fn(value, op)`` runs on each selected operation's output (an array, or a tuple for an
    operation with several outputs) with its [`hx.OpContext`][hookax.OpContext]; it returns the new
    value, of the same shape and dtype, or ``None`` to leave it. The rest of the program, and its
    gradient, use the new value. ``ops=`` takes addresses as [`hx.ops`][hookax.ops] lists them
    (``"layers/0/attn:softmax"``), with globs (``"layers/*/attn:softmax"``, ``"**:exp#*"``). Edits
    work eagerly and under ``jax.jit``/``nnx.jit`` (the active edits are part of the jit cache key),
    ``vmap``, ``scan`` over layers and ``jax.grad``; an operation inside a
    ``custom_jvp``/``custom_vjp`` function cannot be edited (edit the function's output).

    Args:
      fn: the edit function ``fn(value, op) -> value | None``.
      ops: an operation address or a list of them.

    Raises:
      SelectorError: at the end of the block, when an address matched no operation that ran.
      HookError: ``fn`` returned a value of another structure or shape.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> class Block(nnx.Module):
      ...     def __init__(self):
      ...         self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
      ...     def __call__(self, x):
      ...         return jax.nn.relu(self.lin(x)) * 2.0
      >>> block = Block()
      >>> with hx.intercept_op(lambda v, op: jnp.zeros_like(v), ops=":relu"):
      ...     y = block(jnp.ones((1, 3)))
      >>> y
      Array([[0., 0., 0.]], dtype=float32)
    """
    if not callable(fn):
        raise HookaxError(
            f"hx.intercept_op expects an edit function fn(value, op), got {fn!r}. Fix: "
            "hx.intercept_op(lambda value, op: value * 0, ops='layers/0/attn:softmax')."
        )
    _check_two_args(fn)
    patterns = parse_ops(ops, "hx.intercept_op")
    key = FnKey(fn)
    note_fresh(key, "hx.intercept_op")
    return _edit_block(OpHandler("edit", key, patterns))


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One operation inside a call site, as [`hx.ops`][hookax.ops] lists it.

    Attributes:
      address: what ``ops=`` takes: ``"layers/0/attn:softmax"``.
      key: the call site's key.
      name: the operation's name (a primitive's, or a named function's).
      index: which operation of that name within the call (0 first).
      primitive: the JAX primitive (``"jit"``/``"custom_jvp_call"`` for a named function).
      inputs: input shapes and dtypes (``"f32[2,4]"``).
      outputs: output shapes and dtypes.
      source: where it was written (``"attention.py:179 (dot_product_attention_weights)"``).
      within: the address of the named operation it is inside, or ``""``.
    """

    address: str
    key: str
    name: str
    index: int
    primitive: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    source: str
    within: str


def _spec(x: Any) -> str:
    """``"f32[2,3]"`` for an array, its abstract value's text for anything else."""
    from .._util.jaxcompat import core

    try:
        aval: Any = core.ShapedArray(tuple(x.shape), x.dtype)
    except (AttributeError, TypeError, ValueError):
        aval = x if isinstance(x, core.AbstractValue) else core.typeof(x)
    short = getattr(aval, "str_short", None)
    return short(short_dtypes=True) if short is not None else str(aval)


class Listing:
    """The rows one [`hx.ops`][hookax.ops] call collects (compared by identity: every listing
    traces afresh)."""

    def __init__(self) -> None:
        self.notes = Notes()
        self.order: dict[str, int] = {}  # address -> where it first began, in program order
        self._rows: dict[str, OpRow] = {}

    @property
    def rows(self) -> list[OpRow]:
        """In program order (a child call site's operations where it was called)."""
        return [self._rows[k] for k in sorted(self._rows, key=self.order.__getitem__)]

    def add(self, op: OpContext, value: Any, walker: Walker) -> None:
        import jax

        # One row per address: a call site called (or traced) again has the same operations
        if op.address in self._rows:
            return
        self._rows[op.address] = OpRow(
            op.address,
            op.key,
            op.name,
            op.index,
            op.primitive,
            tuple(_spec(a) for a in op.inputs),
            tuple(_spec(v) for v in jax.tree.leaves(value)),
            op.source,
            walker.named[-1] if walker.named else "",
        )
