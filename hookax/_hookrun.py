"""Running hooks at a call site: the hooks layer behind ``_dispatch.run_method``.

At each call site, for each kind of hook: the scoped hooks (``hx.hooks`` blocks, outermost block
first) run before the module's own hooks, as PyTorch runs its global module hooks before a
module's hooks; the module's own run in registration order, ``prepend=True`` ones first. Which
hooks run is decided when the call starts: hooks added or removed during the call take effect at
the next call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from . import _context, _hooks
from ._errors import HookError
from ._grad import wrap_site
from ._hookcheck import check_like, hook_name, noted_call

__all__ = ["run"]

Rec = Any  # a _hooks.HookRecord (not imported by name: _hooks imports this module)

_active = _context._ACTIVE_VALUE


def _collect(frame: _context.Frame, fn: Callable[..., Any]) -> dict[str, list[Rec]] | None:
    """The hooks of this call, by kind, in run order; None when there are none."""
    module, method = frame.module, frame.method
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
                for r in e.fn:
                    found.setdefault(r.kind, []).append(r)
    hs = vars(module).get(_hooks.ATTR)
    if hs is not None:
        for r in hs.records:
            if method in r.methods:
                found.setdefault(r.kind, []).append(r)
    return found or None


def _where(frame: _context.Frame) -> str:
    return f"call site {frame.key!r} ({type(frame.module).__name__}.{frame.method})"


def _pre(r: Rec, frame: _context.Frame, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    note = f"hookax: raised in forward pre-hook {hook_name(r.fn)} at {_where(frame)}"
    if not r.with_kwargs:
        res = noted_call(r.fn, note, frame.module, args)
        if res is None:
            return args, kwargs
        return (res if isinstance(res, tuple) else (res,)), kwargs
    res = noted_call(r.fn, note, frame.module, args, kwargs)
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
    note = f"hookax: raised in forward hook {hook_name(r.fn)} at {_where(frame)}"
    if r.with_kwargs:
        res = noted_call(r.fn, note, frame.module, args, kwargs, out)
    else:
        res = noted_call(r.fn, note, frame.module, args, out)
    if res is None or out is None:
        return out
    fix = "return None to keep the output, or a value like it (e.g. `return output * 2`)."
    check_like(out, res, f"forward hook {hook_name(r.fn)}'s output", _where(frame), fix)
    return res


def _always(
    frame: _context.Frame,
    hooks: list[Rec],
    args: tuple,
    kwargs: dict,
    out: Any,
    error: BaseException,
) -> None:
    """Run the ``always_call`` forward hooks that did not run, after ``error`` was raised.

    ``out`` is None when the method raised, else the output so far (a later hook raised).
    """
    for r in hooks:
        try:
            _post(r, frame, args, kwargs, out)
        except Exception as e:
            warnings.warn(
                f"hookax: forward hook {hook_name(r.fn)} (always_call=True) at {_where(frame)} "
                f"raised {type(e).__name__}: {e}; silenced because the call had already raised "
                f"{type(error).__name__}.",
                RuntimeWarning,
                stacklevel=2,
            )


def run(frame: _context.Frame, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Pre-hooks, then the method, then forward hooks; backward identities on the way out."""
    found = _collect(frame, fn)
    if found is None:
        return fn(frame.module, *args, **kwargs)
    for r in found.get("forward_pre", ()):
        args, kwargs = _pre(r, frame, args, kwargs)
    bpre, bpost = found.get("backward_pre", []), found.get("backward", [])
    wrap_output = None
    if bpre or bpost:
        pre_fns, post_fns = [r.fn for r in bpre], [r.fn for r in bpost]
        args, wrap_output = wrap_site(frame.module, args, pre_fns, post_fns, _where(frame))
    forward = found.get("forward", [])
    pending = [r for r in forward if r.always_call]
    out = None
    try:
        out = fn(frame.module, *args, **kwargs)
        for r in forward:
            if r.always_call:
                pending.remove(r)
            out = _post(r, frame, args, kwargs, out)
    except BaseException as e:
        _always(frame, pending, args, kwargs, out, e)
        raise
    return out if wrap_output is None else wrap_output(out)
