"""``hx.capture``: the outputs of selected call sites, delivered as values of the computation.

A capture call is a *session* (``_tags``): an interceptor active for the call (part of the jit
cache key) marks each selected call site's output with the ``hookax_tag`` primitive, and a
forwarding trace collects the marks, re-tracing every inner jaxpr that holds one so its values
leave the transform as outputs (``_tagrules``). See ``docs/design.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .._engine.select import (
    ALL_METHODS,
    CALL_ONLY,
    Select,
    as_selector,
    check_matched,
    resolve_instances,
)
from .._hooks import intercept as _intercept
from .._transforms import tagrules as _tagrules
from .._transforms import tags as _tags
from .._util.errors import HookaxError
from . import ops as _ops

__all__ = ["capture", "session"]


@dataclasses.dataclass(frozen=True)
class _Marker:
    """The interceptor of session ``sid``: marks the selected call sites' outputs.

    It sees every call site (its entry selects all of them) so that a ``where=`` matching none
    can be reported with the paths that did run. Compared by value: it is part of the cache key.
    """

    sid: int
    selector: Any

    def __call__(self, next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        live = _tags.live_session(self.sid)
        if live is not None:
            live.seen.add((ctx.key, ctx.path_str))
        if not self.selector.matches(ctx):
            return next_fun(*args, **kwargs)
        if live is not None:
            live.matched = True
            live.starts.setdefault(ctx.key)
            _check_collision(live, ctx)
        return self.tag(next_fun(*args, **kwargs), ctx)

    def tag(self, out: Any, ctx: Any) -> Any:
        """Mark what this session carries for a selected call site; return what its caller gets.

        Here the output itself; a subclass may mark something derived from it (the
        statistics taps of :mod:`hookax._diagnostics.stats` mark a small dummy instead).
        """
        return _tags.mark(out, self.sid, ctx.key)


_EVERY_CALL_SITE = as_selector(None, ALL_METHODS)


def _check_collision(live: _tags.Session, ctx: Any) -> None:
    """Refuse two different NNX modules under one key (two separate roots in one function)."""
    adapter = ctx._frame.adapter
    if getattr(adapter, "name", None) != "nnx":
        return  # Linen/Equinox rebuild module objects per call: identity means nothing there
    *_, module = adapter.aliases(ctx.module)  # the outermost copy (inside NNX transforms)
    ref = live.owners.get(ctx.key)
    first = ref() if ref is not None else None
    if first is None:  # weak: a module rebuilt inside jit holds that trace's tracers
        live.owners[ctx.key] = weakref.ref(module)
        return
    if first is module:
        return
    raise HookaxError(
        f"{live.who}: call site key {ctx.key!r} ({type(ctx.module).__name__}.{ctx.method}) "
        f"was recorded for two different modules ({type(first).__name__} at {id(first):#x} "
        f"and {type(module).__name__} at {id(module):#x}): the captured function calls separate "
        f"models, each the root of its own paths, so their keys collide. Fix: capture each "
        f"model separately ({live.who}(model_a), {live.who}(model_b)), or make them submodules "
        f"of one parent module and call that."
    )


class _Session:
    """Context for one session: make it live, its marker active and its trace current."""

    def __init__(
        self,
        session: _tags.Session,
        selector: Any,
        where: Any,
        ops: tuple[Any, ...] = (),
        marker: Callable[[int, Any], _Marker] = _Marker,
    ) -> None:
        self.session = session
        self.selector = selector
        self.where = where
        self.ops = ops
        self.marker = marker

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        s = self.session
        s.seen = set()
        s.matched = False
        marker = self.marker(s.sid, self.selector)
        entry = _intercept.Entry("intercept", marker, _EVERY_CALL_SITE)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_intercept.scoped(entry))
            if self.ops:
                s.op_notes = _ops.Notes()
                handler = _ops.OpHandler("mark", s.sid, self.ops)
                stack.enter_context(
                    _intercept.scoped(_intercept.Entry("ops", handler, _ops.Sites(self.ops)))
                )
                stack.enter_context(_ops.named_softmax())
            out = _tagrules.run(s, fn, *args, **kwargs)
        if s.mode == "reap":  # a differentiated run follows a measuring run that checked it
            if self.where is not _NO_SITES:
                check_matched(s.who, self.where, self.selector, s)
            if self.ops:
                _ops.check_ops(s.who, self.ops, s.op_notes)
        return out


class _NoSites:
    """``where=`` left out next to ``ops=``: no call site's output, only the operations."""

    def __repr__(self) -> str:
        return "<no call sites>"


_NO_SITES: Any = _NoSites()
_NONE_SELECTED = Select(types=())


def next_sid() -> int:
    return _tags.depth()


def session(
    who: str,
    where: Any,
    fn: Any,
    args: tuple,
    kwargs: dict,
    mode: str = "reap",
    probes: Any = None,
    ops: tuple[Any, ...] = (),
    marker: Callable[[int, Any], _Marker] = _Marker,
) -> _Session:
    """A session for ``who`` (``"hx.capture"``, ``"hx.value_and_grad"``) over ``fn(*args)``;
    ``ops`` are parsed ``ops=`` patterns, and ``where`` may be :data:`_NO_SITES`. ``marker``
    makes the interceptor from ``(sid, selector)``: a value-comparable :class:`_Marker`."""
    if where is _NO_SITES:
        selector: Any = _NONE_SELECTED
    else:
        selector = as_selector(resolve_instances(where, (fn, args, kwargs)), CALL_ONLY)
    return _Session(_tags.Session(next_sid(), who, mode, probes), selector, where, ops, marker)


def where_and_ops(where: Any, ops: Any, who: str) -> tuple[Any, tuple[Any, ...]]:
    """``where=`` (its default: every call site, or none when ``ops=`` is given) and the
    parsed ``ops=`` patterns; malformed ones raise here, before the first call."""
    patterns = _ops.parse_ops(ops, who)
    if where is _DEFAULT:
        where = _NO_SITES if patterns else None
    if where is not _NO_SITES:
        as_selector(where, CALL_ONLY)
    return where, patterns


class _Default:
    def __repr__(self) -> str:
        return "<default>"


_DEFAULT: Any = _Default()


def collect(session: _tags.Session) -> dict[str, tuple[Any, ...]]:
    """``{key: (output, ...)}`` in call order, keys in the order their first call started."""
    acts: dict[str, list[Any]] = {k: [] for k in session.starts}
    for r in session.records:
        acts.setdefault(r.key, []).append(r.output())
    return {k: tuple(v) for k, v in acts.items() if v}


def capture(
    fn: Callable[..., Any], *, where: Any = _DEFAULT, ops: Any = None
) -> Callable[..., tuple[Any, dict]]:
    """Wrap ``fn`` to also return the outputs of the selected call sites it runs.

    ``forward = hx.capture(fn, where=...)``; ``y, acts = forward(*args, **kwargs)``. ``acts`` maps
    each selected call site's key (``"layers/0"``, ``"encoder:encode"``) to a tuple of its
    outputs, one per call, in call order; keys appear in the order of their first call. The
    outputs are what the caller received (after forward hooks ran).

    The values travel as values of the computation, so every transform carries them: eager,
    ``jax.jit``/``nnx.jit`` (also a jitted function taking the model as an argument, inside or
    around the capture), ``jax.vmap``/``nnx.vmap`` (values gain the batch axis in front),
    ``lax.scan``/``nnx.scan``/``nn.scan``/``lax.map`` over layers (one entry for the scanned call
    site, stacked on the scan axis), ``jax.checkpoint``/``nnx.remat``, ``lax.cond``/``switch``
    (the taken branch's value; NaN where the call site is in a branch not taken),
    ``lax.while_loop`` (the last iteration's value), ``jax.grad``, ``shard_map``. The active capture
    is part of the jit cache key.

    ``ops=`` adds the values of operations inside call sites (:func:`hx.ops` lists their
    addresses): ``acts["layers/0/attn:softmax"]`` is a tuple, one value per call of its call
    site, carried through the same transforms (an operation inside a ``vmap`` written in the
    call site is seen batched, as the call site computes it).

    Args:
      fn: a module, or any function that calls modules.
      where: which call sites; default every module's ``__call__``, or none when ``ops=`` is
        given. A module instance selects that module.
      ops: operation addresses (``"layers/0/attn:softmax"``, ``"**:dot_general#*"``), or a list.

    Returns:
      A function taking ``fn``'s arguments and returning ``(fn's output, acts)``.

    Raises:
      SelectorError: ``where=`` matched no call site that ran (the message lists those that did).
      HookaxError: a selected call site ran where its value cannot be carried out (the message
        names it, the transform, and the fix).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import hookax as hx
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu)
    >>> y, acts = hx.capture(model)(jnp.ones((4, 2)))
    >>> {k: [v.shape for v in vs] for k, vs in acts.items()}
    {'': [(4, 3)], 'layers/0': [(4, 3)]}
    """
    if not callable(fn):
        raise HookaxError(
            f"hx.capture expects a module or a function that calls modules, got {fn!r} of "
            f"type {type(fn).__name__}. Fix: hx.capture(model)(x), or "
            "hx.capture(lambda x: model(x))(x)."
        )
    where, patterns = where_and_ops(where, ops, "hx.capture")  # malformed ones raise here

    def forward(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, tuple[Any, ...]]]:
        s = session("hx.capture", where, fn, args, kwargs, ops=patterns)
        y = s.run(fn, *args, **kwargs)
        return y, collect(s.session)

    # Only a function lends its name: a module's attributes (or a __wrapped__ pointing at it)
    # on the returned function would make Equinox's filtered transforms treat it as a pytree.
    if isinstance(fn, types.FunctionType | types.MethodType):
        functools.update_wrapper(forward, fn)
    return forward


def roots(fn: Any) -> Iterator[Any]:
    """Objects the function reaches besides its arguments: itself, bound self, partial args."""
    seen = 0
    while seen < 8:
        seen += 1
        yield fn
        if isinstance(fn, functools.partial):
            yield fn.args
            yield fn.keywords
            fn = fn.func
        elif hasattr(fn, "__self__"):
            yield fn.__self__
            fn = getattr(fn, "__func__", None)
        else:
            break
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
