"""The single function every intercepted module method call goes through.

A framework adapter wraps module methods once; each wrapper checks that nothing is active on this
thread and that no module carries hooks, and otherwise calls :func:`call`. ``call`` builds the
call site's frame and context, runs the matching interceptors (outermost first), then the hooks
and the method itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._util import errors as _errors
from . import context as _context
from .plugins import Slot

__all__ = ["call"]

_active = _context._ACTIVE_VALUE
_trackers = _context.trackers


def _describe(frame: _context.Frame) -> str:
    return f"call site {frame.key!r} ({type(frame.module).__name__}.{frame.method})"


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# Higher layers plug in here rather than being imported (see :mod:`.plugins`; ``import hookax``
# fills every slot).
def _plain(frame: _context.Frame, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return fn(frame.module, *args, **kwargs)


RUN_METHOD: Slot[Callable[..., Any]] = Slot(
    "run_method",
    _plain,
    "run(frame, fn, args, kwargs): a call site's method with its hooks (pre-hooks, the method, "
    "forward hooks, backward identities); the dispatcher calls it innermost.",
)


def _no_layers(interceptor: Any, layers: frozenset[int]) -> Any:
    raise AssertionError("hookax: a layer suffix is active but hookax._hooks is not loaded")


LAYER_GATE: Slot[Callable[..., Any]] = Slot(
    "layer_gate",
    _no_layers,
    "gate(interceptor, layers): the interceptor applied to those iterations of a scan only "
    "(a where= with a layer suffix).",
)


class _Gated:
    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn


def _no_ops(frame: Any, ctx: Any, entries: list[Any], fn: Any) -> Any:
    raise AssertionError("hookax: an ops= entry is active but hookax._capture.ops is not loaded")


SITE_SCOPE: Slot[Callable[..., Any]] = Slot(
    "site_scope",
    _no_ops,
    "enter(frame, ctx, entries, fn) -> (scope, fn): a call site's name-stack scope while ops= "
    "entries are active, and its method run under the operation trace where one names it.",
)


def call(
    fn: Callable[..., Any], method: str, module: Any, args: tuple, kwargs: dict, adapter: Any
) -> Any:
    """Run ``fn(module, *args, **kwargs)`` as the call site ``module.method``."""
    stack = _context.call_stack()
    parent = stack[-1] if stack else None
    if parent is not None and parent.module is module and parent.method == method:
        # super().method(...) from an overriding method: the same call site, seen once.
        return fn(module, *args, **kwargs)
    frame = _context.Frame(module, method, parent, adapter)
    stack.append(frame)
    try:
        return _run(frame, fn, args, kwargs)
    except BaseException as e:
        _errors.add_note(e, f"hookax: raised in {_describe(frame)}")
        if parent is None and adapter.name == "equinox" and isinstance(e, TypeError | ValueError):
            _batch_hint(e, fn, module, args, kwargs)
        raise
    finally:
        # Break frame -> context -> orig_method -> frame, so the call site's module, arguments and
        # tracers die with the call instead of waiting for the cycle collector (Linen's and JAX's
        # leak checkers disable it).
        frame.context = None
        frame.args = frame.layer = None  # the call's values (tracers) die with it too
        stack.pop()
        if not stack:
            adapter.root_done()


def bare(
    fn: Callable[..., Any], method: str, module: Any, args: tuple, kwargs: dict, adapter: Any
) -> Any:
    """Run ``fn(module, *args, **kwargs)`` as a call that is no call site (a framework's bridge
    to another: Flax's ``ToLinen``): no interceptor, hook or capture sees it, but the modules it
    calls find their paths below its own."""
    stack = _context.call_stack()
    frame = _context.Frame(module, method, stack[-1] if stack else None, adapter)
    stack.append(frame)
    try:
        return fn(module, *args, **kwargs)
    finally:
        stack.pop()
        if not stack:
            adapter.root_done()


def _run(frame: _context.Frame, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    run = RUN_METHOD.fn

    def inner(*a: Any, **k: Any) -> Any:
        try:
            return run(frame, fn, a, k)
        except BaseException as e:
            _errors.add_note(e, f"hookax: raised in {_describe(frame)}")
            raise

    entries = _active.value
    if not entries:
        return inner(*args, **kwargs)
    ctx = frame.context = _context.Context(frame, inner)
    frame.args = (args, kwargs)
    chain = []
    recorders: list[Any] | None = None
    ops: list[Any] | None = None
    tracking = _trackers()
    for e in entries:
        if e.kind == "intercept":
            hit = e.selector.matches(ctx)
            if hit:
                if e.records:
                    # Captures record what the caller received: they run outside every
                    # interceptor, whichever was entered first.
                    if recorders is None:
                        recorders = []
                    recorders.append(e)
                elif e.layered:
                    layers = e.selector.layers(ctx)
                    chain.append(e if layers is None else _Gated(LAYER_GATE.fn(e.fn, layers)))
                else:
                    chain.append(e)
            if tracking:
                _context.note_match(e, ctx, hit)
        elif e.kind == "ops":
            if ops is None:
                ops = []
            ops.append(e)
            if tracking:
                _context.note_match(e, ctx, e.selector.matches(ctx))
    if recorders is not None:
        chain = recorders + chain
    if ops is not None:
        # Operations inside call sites: every call site gets its name-stack scope, and the
        # method of one that an ops= pattern names runs under an OpTrace (``inner`` reads
        # ``fn`` when it runs). Every ops entry sees every call site (for its error messages).
        scope, fn = SITE_SCOPE.fn(frame, ctx, ops, fn)
        with scope:
            if not chain:
                return inner(*args, **kwargs)
            return _link(chain, 0, inner, ctx, frame)(*args, **kwargs)
    if not chain:
        return inner(*args, **kwargs)
    return _link(chain, 0, inner, ctx, frame)(*args, **kwargs)


def _link(
    chain: list[Any], i: int, inner: Callable[..., Any], ctx: Any, frame: _context.Frame
) -> Callable[..., Any]:
    if i == len(chain):
        return inner
    interceptor = chain[i].fn

    def next_fun(*args: Any, **kwargs: Any) -> Any:
        try:
            return interceptor(_link(chain, i + 1, inner, ctx, frame), args, kwargs, ctx)
        except BaseException as e:
            _errors.add_note(
                e, f"hookax: raised in interceptor {_name(interceptor)} at {_describe(frame)}"
            )
            raise

    return next_fun


def _batch_hint(e: BaseException, fn: Any, module: Any, args: tuple, kwargs: dict) -> None:
    """An Equinox model called on a batch while hookax is active: say ``jax.vmap(model)`` when
    the same call on one example (each array argument without its leading axis) fits."""
    if not _active.value:
        return
    leaves = [x for x in jax.tree.leaves(args) if hasattr(x, "shape") and hasattr(x, "dtype")]
    if not leaves or any(len(x.shape) == 0 for x in leaves):
        return
    sizes = {x.shape[0] for x in leaves}
    if len(sizes) != 1:
        return

    def one(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        return x

    try:
        with _context.ACTIVE(()):  # hookax idle: no hook or capture sees this check
            jax.eval_shape(lambda a: fn(module, *a, **kwargs), jax.tree.map(one, args))
    except Exception:
        return
    name = type(module).__name__
    e.add_note(
        f"hookax: {name} fits one example, and its input has one more (leading) axis of size "
        f"{sizes.pop()}: an Equinox model takes one example at a time. Fix: map it over the "
        "batch, jax.vmap(model)(x); with hookax, hx.capture(lambda x: jax.vmap(model)(x))(x) "
        "or hx.summary(lambda m, x: jax.vmap(m)(x), model, x)."
    )
