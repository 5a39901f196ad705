"""Running hooks at a call site: the hooks layer behind ``_dispatch.RUN_METHOD``.

At each call site, for each kind of hook: the scoped hooks (``hx.hooks`` blocks, outermost block
first) run before the module's own hooks, as PyTorch runs its global module hooks before a
module's hooks; the module's own run in registration order, ``prepend=True`` ones first. As in
PyTorch, the pre-hooks and backward hooks of a call are read when it starts and its forward hooks
after the method returns: a pre-hook that removes a forward hook stops it in the same call.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from .._engine import context as _context
from .._engine import dispatch as _dispatch
from .._util.errors import HookError, SelectorError, add_note
from . import hooks as _hooks
from . import layergate as _layergate
from .grad import wrap_site
from .hookcheck import hook_name

__all__ = ["run"]

Rec = Any  # a _hooks.HookRecord (not imported by name: _hooks imports this module)

_active = _context._ACTIVE_VALUE


def _collect(frame: _context.Frame) -> dict[str, list[Rec]] | None:
    """The hooks of this call, by kind, in run order; None when there are none."""
    method = frame.method
    found: dict[str, list[Rec]] = {}
    entries = _active.value
    if entries:
        ctx = frame.context  # built once per call site by the dispatcher
        tracking = _context.trackers()
        for e in entries:
            if e.kind != "hooks" or not e.fn:
                continue
            hit = e.selector.matches(ctx)
            if tracking and ctx is not None:
                _context.note_match(e, ctx, hit)
            if hit:
                layers = e.selector.layers(ctx) if e.layered else None
                for r in e.fn:
                    if layers is not None:
                        r = _layered(r, layers, frame)
                    found.setdefault(r.kind, []).append(r)
    hs = vars(frame.module).get(_hooks.ATTR)
    if hs is not None:
        for r in hs.records:
            if method in r.methods:
                found.setdefault(r.kind, []).append(r)
    return found or None


def _layered(r: Rec, layers: frozenset[int], frame: _context.Frame) -> Rec:
    """A scoped hook record applied to some scan iterations only (``where="blocks/mlp[3]"``)."""
    if r.kind.startswith("backward"):
        raise SelectorError(
            f"hx.hooks: backward hooks of one layer of a scanned stack (call site "
            f"{frame.key!r}) are not supported. Fix: read that layer's gradient with "
            f"hx.value_and_grad(loss_fn, where=...), or hook every layer."
        )
    return dataclasses.replace(r, layers=layers)


def _forward_hooks(frame: _context.Frame, found: dict[str, list[Rec]]) -> list[Rec]:
    """The forward hooks of this call: the scoped ones (token 0) found when it started, then the
    module's own as they are now (PyTorch reads a module's forward hooks after ``forward``)."""
    out = [r for r in found.get("forward", ()) if not r.token]
    hs = vars(frame.module).get(_hooks.ATTR)
    if hs is not None:
        method = frame.method
        out += [r for r in hs.records if r.kind == "forward" and method in r.methods]
    return out


def _where(frame: _context.Frame) -> str:
    return f"call site {frame.key!r} ({type(frame.module).__name__}.{frame.method})"


def _pre(r: Rec, frame: _context.Frame, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    try:
        res = r.fn(frame.module, args, kwargs) if r.with_kwargs else r.fn(frame.module, args)
    except BaseException as e:
        # The note (and the call site's path in it) is built only when a hook raises.
        add_note(e, f"hookax: raised in forward pre-hook {hook_name(r.fn)} at {_where(frame)}")
        raise
    if not r.with_kwargs:
        if res is None:
            return args, kwargs
        return (res if isinstance(res, tuple) else (res,)), kwargs
    if res is None:
        return args, kwargs
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], dict)):
        raise HookError(
            f"forward pre-hook {hook_name(r.fn)} (with_kwargs=True) at {_where(frame)} must "
            f"return None or a pair (new_args, new_kwargs), got {res!r:.80}. Fix: "
            "`return args, kwargs`."
        )
    new_args = res[0] if isinstance(res[0], tuple) else (res[0],)
    return new_args, res[1]


def _post(r: Rec, frame: _context.Frame, args: tuple, kwargs: dict, out: Any) -> Any:
    """Run forward hook ``r``; it may return an output of any structure, as in PyTorch."""
    try:
        if r.with_kwargs:
            res = r.fn(frame.module, args, kwargs, out)
        else:
            res = r.fn(frame.module, args, out)
    except BaseException as e:
        add_note(e, f"hookax: raised in forward hook {hook_name(r.fn)} at {_where(frame)}")
        raise
    return out if res is None else res


def _always(
    frame: _context.Frame,
    found: dict[str, list[Rec]],
    called: list[Rec],
    args: tuple,
    kwargs: dict,
    out: Any,
    error: BaseException,
) -> None:
    """Run the ``always_call`` forward hooks not run yet (not in ``called``) after ``error``.

    As in PyTorch: the list is read now; ``out`` is None when a pre-hook or the method raised,
    else the output so far (a forward hook raised); a hook that raises is silenced with a
    warning, and the next one runs.
    """
    for r in _forward_hooks(frame, found):
        if not r.always_call or any(c is r for c in called):
            continue
        try:
            res = _post(r, frame, args, kwargs, out)
            out = res if res is not None else out
        except Exception as e:
            warnings.warn(
                f"hookax: forward hook {hook_name(r.fn)} (always_call=True) at {_where(frame)} "
                f"raised {type(e).__name__}: {e}; silenced because the call had already raised "
                f"{type(error).__name__}.",
                RuntimeWarning,
                stacklevel=2,
            )


def run(frame: _context.Frame, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Pre-hooks, then the method, then forward hooks; backward identities on the way out.

    As in PyTorch's ``Module._call_impl``: whether the call has hooks at all, and which pre-hooks
    and backward hooks it has, is read when it starts; the forward hooks after the method
    returns. When a pre-hook, the method or a forward hook raises (an ``Exception``), the
    ``always_call`` forward hooks that did not run yet run, and the exception propagates.
    """
    found = _collect(frame)
    if found is None:
        return fn(frame.module, *args, **kwargs)
    called: list[Rec] = []
    out = None
    try:
        for r in found.get("forward_pre", ()):
            if r.layers is None:
                args, kwargs = _pre(r, frame, args, kwargs)
            else:
                pred = _layergate.layer_pred(frame, r.layers, (args, kwargs))
                edited = _pre(r, frame, args, kwargs)
                args, kwargs = _layergate.select(frame, pred, edited, (args, kwargs))
        bpre, bpost = found.get("backward_pre"), found.get("backward")
        wrap_output = None
        if bpre or bpost:
            pre_fns = [r.fn for r in bpre or ()]
            post_fns = [r.fn for r in bpost or ()]
            args, wrap_output = wrap_site(frame.module, args, pre_fns, post_fns, _where(frame))
        out = fn(frame.module, *args, **kwargs)
        for r in _forward_hooks(frame, found):
            if r.always_call:
                called.append(r)
            if r.layers is None:
                out = _post(r, frame, args, kwargs, out)
            else:
                pred = _layergate.layer_pred(frame, r.layers, (args, kwargs))
                edited = _post(r, frame, args, kwargs, out)
                out = _layergate.select(frame, pred, edited, out)
    except Exception as e:
        _always(frame, found, called, args, kwargs, out, e)
        raise
    return out if wrap_output is None else wrap_output(out)


_dispatch.RUN_METHOD.register(run, __name__)  # every method runs through the hooks layer
