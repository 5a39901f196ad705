"""``hx.capture``: the outputs of selected call sites, cache-correct under every transform.

One capture call is a *session*: an interceptor (an :class:`~hookax._intercept.Entry` made active
with ``scoped``, so it is part of the jit cache key) records the output each selected call site
returns to its caller. A value recorded in the trace the session started in is kept as it is. A
value recorded inside an inner transform (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``, ``nnx.jit``)
belongs to that transform's trace: it is written into module state instead, which the transform
carries out (see ``_capture_nnx``), and read back when the function returns. Nothing recorded in an
inner trace is ever returned from the outer one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import core as jex_core

from . import _intercept
from ._errors import HookaxError
from ._select import CALL_ONLY, as_selector

__all__ = ["capture"]


def current_trace() -> Any:
    """An opaque, ``==``-comparable token for the JAX trace running now."""
    return jex_core.get_opaque_trace_state(convention="nnx")


class _Local(threading.local):
    def __init__(self) -> None:
        self.sessions: list[Any] = []


_LOCAL = _Local()


def sessions() -> list[Any]:
    """The capture-like sessions in progress on this thread, outermost first."""
    return _LOCAL.sessions


@dataclasses.dataclass(frozen=True)
class _Recorder:
    """The interceptor of the capture session at ``depth``. Compared by value (a cache key)."""

    depth: int

    def __call__(self, next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        s = _session(self.depth, "hx.capture")
        s.slots.setdefault(ctx.key, [])  # keys in the order of their first call
        out = next_fun(*args, **kwargs)
        s.record(ctx, out)
        return out


def _session(depth: int, who: str) -> Any:
    live = _LOCAL.sessions
    if depth >= len(live):
        raise HookaxError(
            f"{who}: a call site ran after the {who} call that traced it returned (a function "
            f"traced inside {who} and called later). Call the function inside {who} instead."
        )
    return live[depth]


_INNER_HELP = (
    "Its output was computed inside a JAX transform that runs within the captured function "
    "(jax.jit, jax.vmap, jax.grad, jax.lax.scan, ...) on a module it closes over, so the value "
    "cannot be carried out of that transform. Use the NNX transform instead and pass the module "
    "as an argument (nnx.jit, nnx.vmap, nnx.scan, nnx.remat, nnx.grad), or apply hx.capture "
    "inside the transform: jax.vmap(hx.capture(model))(x)."
)


class _Session:
    """One capture call in progress: what was recorded, where inner values are stored."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.trace = current_trace()
        self.attr = f"__hookax_capture_{depth}__"
        # key -> list of ("v", value) (recorded in this trace) or ("m", index) (module state)
        self.slots: dict[str, list[tuple[str, Any]]] = {}
        self.attached: list[tuple[Any, Any]] = []
        self.owners: dict[str, Any] = {}  # key -> the module first recorded under it

    def record(self, ctx: Any, out: Any) -> None:
        slots = self.slots.setdefault(ctx.key, [])
        if current_trace() == self.trace:
            self._check_collision(ctx)
            slots.append(("v", out))
            return
        index = None
        if "flax.nnx" in sys.modules:
            from . import _capture_nnx

            index = _capture_nnx.write(ctx.module, self.attr, ctx.key, out)
        if index is None:
            why = getattr(ctx._frame.adapter, "capture_help", None) or _INNER_HELP
            raise HookaxError(
                f"hx.capture cannot capture call site {ctx.key!r} "
                f"({type(ctx.module).__name__}.{ctx.method}). {why}"
            )
        if ("m", index) not in slots:  # a transform may trace its body more than once
            slots.append(("m", index))

    def _check_collision(self, ctx: Any) -> None:
        """Refuse two different NNX modules recorded under one key (two separate roots)."""
        if getattr(ctx._frame.adapter, "name", None) != "nnx":
            return  # Linen/Equinox rebuild module objects per call: identity means nothing there
        first = self.owners.setdefault(ctx.key, ctx.module)
        if first is ctx.module:
            return
        raise HookaxError(
            f"hx.capture: call site key {ctx.key!r} ({type(ctx.module).__name__}.{ctx.method}) "
            f"was recorded for two different modules ({type(first).__name__} at "
            f"{id(first):#x} and {type(ctx.module).__name__} at {id(ctx.module):#x}): the "
            f"captured function calls separate models, each the root of its own paths, so their "
            f"keys collide. Fix: capture each model separately (hx.capture(model_a), "
            f"hx.capture(model_b)), or make them submodules of one parent module and call that."
        )

    def interceptor(self) -> Any:
        return _Recorder(self.depth)

    def attach(self, objs: Any) -> None:
        if "flax.nnx" in sys.modules:
            from . import _capture_nnx

            self.attached = _capture_nnx.attach(_capture_nnx.find_modules(objs), self.attr)

    def finish(self) -> dict[str, tuple[Any, ...]]:
        stored: dict[str, list[Any]] = {}
        if self.attached:
            from . import _capture_nnx

            for d in _capture_nnx.detach(self.attached, self.attr):
                for key, written in d.items():
                    stored.setdefault(key, []).extend(written)
            self.attached = []
        acts: dict[str, tuple[Any, ...]] = {}
        for key, slots in self.slots.items():
            values = stored.pop(key, [])
            taken = set()
            out = []
            for kind, v in slots:
                if kind == "v":
                    out.append(v)
                elif v < len(values):
                    out.append(values[v])
                    taken.add(v)
            # Values a cached inner transform wrote without running its Python body again.
            out.extend(v for i, v in enumerate(values) if i not in taken)
            acts[key] = tuple(out)
        for key, rest in stored.items():
            if rest:
                acts[key] = tuple(rest)
        _check_no_foreign_tracers(acts)
        return acts

    def abandon(self) -> None:
        if self.attached:
            from . import _capture_nnx

            _capture_nnx.detach(self.attached, self.attr)
            self.attached = []


def _check_no_foreign_tracers(acts: dict[str, tuple[Any, ...]]) -> None:
    from jax._src import core

    trace = core.trace_ctx.trace
    for key, values in acts.items():
        for leaf in jax.tree.leaves(values):
            if isinstance(leaf, core.Tracer) and leaf._trace is not trace:
                raise HookaxError(f"hx.capture cannot capture call site {key!r}. {_INNER_HELP}")


def _roots(fn: Any) -> list[Any]:
    """Objects the captured function reaches besides its arguments: itself, bound self, closure."""
    out: list[Any] = [fn]
    seen = 0
    while seen < 8:
        seen += 1
        if isinstance(fn, functools.partial):
            out += [fn.args, fn.keywords]
            fn = fn.func
        elif hasattr(fn, "__self__"):
            out.append(fn.__self__)
            fn = getattr(fn, "__func__", None)
        else:
            break
    cells = getattr(fn, "__closure__", None) or ()
    for cell in cells:
        with contextlib.suppress(ValueError):  # an empty cell has no contents
            out.append(cell.cell_contents)
    return out


@contextlib.contextmanager
def session(fn: Any, args: tuple, kwargs: dict, selector: Any, make: Any) -> Iterator[Any]:
    """Run a session of ``kind``: push it, make its interceptor active, clean up on exit."""
    live = _LOCAL.sessions
    depth = len(live)
    s = make(depth)
    live.append(s)
    try:
        s.attach((_roots(fn), args, kwargs))
        with _intercept.scoped(_intercept.Entry("intercept", s.interceptor(), selector)):
            yield s
    finally:
        s.abandon()
        live.pop()


def capture(fn: Callable[..., Any], *, where: Any = None) -> Callable[..., tuple[Any, dict]]:
    """Wrap ``fn`` to also return the outputs of the selected call sites it runs.

    ``forward = hx.capture(fn, where=...)``; ``y, acts = forward(*args, **kwargs)``. ``acts`` maps
    each selected call site's key (``"layers/0"``, ``"encoder:encode"``) to a tuple of its
    outputs, one per call, in call order; keys appear in the order of their first call. The
    outputs are what the caller received (after forward hooks ran).

    Works eagerly and under ``jax.jit``/``nnx.jit``, ``jax.vmap``/``nnx.vmap`` (values gain the
    batch axis), ``nnx.scan`` over stacked layers (values gain the scan axis: one entry for the
    scanned call site), ``nnx.remat`` and ``jax.grad``; captures nest. The active capture is part
    of the jit cache key: a function traced for one ``where=`` is never reused for another.

    Args:
      fn: a module, or any function that calls modules.
      where: which call sites; default every module's ``__call__``.

    Returns:
      A function taking ``fn``'s arguments and returning ``(fn's output, acts)``.

    Raises:
      HookaxError: when a value was computed inside a JAX transform that closes over the module
        (``jax.vmap(lambda x: model(x))`` inside the captured function), where it cannot be
        carried out; the message shows the NNX form that works.

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
    return capture_with(fn, as_selector(where, CALL_ONLY))


def capture_with(fn: Callable[..., Any], selector: Any) -> Callable[..., tuple[Any, dict]]:
    """:func:`capture` with a ready :class:`Selector`."""

    def forward(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, tuple[Any, ...]]]:
        with session(fn, args, kwargs, selector, _Session) as s:
            try:
                y = fn(*args, **kwargs)
            except ValueError as e:
                if s.attr not in str(e):
                    raise
                raise HookaxError(
                    f"hx.capture: a call site inside an nnx.vmap/nnx.scan broadcasts its module "
                    f"(in_axes=None), so its captured outputs, which vary along the mapped axis, "
                    f"cannot be stored with it. Route hookax's capture state (an "
                    f"nnx.Intermediate) along the axis: in_axes=(nnx.StateAxes("
                    f"{{nnx.Intermediate: 0, ...: None}}), ...). NNX said: {e}"
                ) from e
            acts = s.finish()
        return y, acts

    # Only a function lends its name: a module's attributes (or a __wrapped__ pointing at it)
    # on the returned function would make Equinox's filtered transforms treat it as a pytree.
    if isinstance(fn, types.FunctionType | types.MethodType):
        functools.update_wrapper(forward, fn)
    return forward
