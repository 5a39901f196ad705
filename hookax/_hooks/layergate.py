"""Edits of one layer of a scanned stack: an interceptor or hook applied to some scan iterations.

A scan traces its body once for all layers, so an edit of ``"blocks/attn[3]"`` runs in every
layer and its result is selected on the layer index (:mod:`hookax._transforms.layerindex`): the
call site's method still runs once per layer, and the extra cost is the edit and a select.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from .._engine import context as _context
from .._engine import dispatch as _dispatch
from .._transforms import layerindex as _layerindex
from .._util.errors import HookaxError, SelectorError

__all__ = ["check_in_scan", "gate", "layer_pred", "select"]


def _layer_of(frame: _context.Frame) -> Any:
    if frame.layer is None and frame.in_scan():
        frame.layer = _layerindex.layer_index(frame.args, frame.key)
    return frame.layer


_context.LAYER_OF.register(_layer_of, __name__)


def check_in_scan(frame: _context.Frame, layers: frozenset[int]) -> None:
    """Raise ``SelectorError`` when a layer suffix picks a call site that runs outside a scan."""
    if not frame.in_scan():
        want = ", ".join(str(i) for i in sorted(layers))
        raise SelectorError(
            f"a layer suffix selects iteration(s) {want} of call site {frame.key!r}, but it "
            f"does not run inside a scan (nnx.scan, nn.scan, lax.scan), so it has no layers. "
            f"Fix: select it as {frame.key!r}; layers of an unrolled stack have keys of their "
            f"own (e.g. 'blocks/3/attn')."
        )


def layer_pred(frame: _context.Frame, layers: frozenset[int], dep: Any) -> Any:
    """A traced bool: whether the scan iteration running ``frame``'s call is in ``layers``.

    ``dep`` is a value of the call (its arguments): see :func:`layerindex.layer_index`."""
    check_in_scan(frame, layers)
    # A primitive of its own (not ctx.layer's): it carries the layers to check at compile time.
    idx = _layerindex.layer_index(dep, frame.key, layers)
    if len(layers) == 1:
        return idx == next(iter(layers))
    return jnp.isin(idx, jnp.asarray(sorted(layers), jnp.int32))


def select(frame: _context.Frame, pred: Any, edited: Any, plain: Any) -> Any:
    """``edited`` in the selected layers, ``plain`` in the others."""
    return _layerindex.select(pred, edited, plain, frame.key)


def gate(interceptor: Callable[..., Any], layers: frozenset[int]) -> Callable[..., Any]:
    """``interceptor``, applied to the scan iterations ``layers`` of each call site it meets."""

    def gated(next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        pred = layer_pred(ctx._frame, layers, (args, kwargs))
        plain: list[Any] = []

        def step(*a: Any, **k: Any) -> Any:
            if plain:
                raise HookaxError(
                    f"hookax: an interceptor of one layer of call site {ctx.key!r} called "
                    "next_fun twice; inside a scan one call of the method serves every layer. "
                    "Fix: call next_fun once (or select the call site without a layer suffix)."
                )
            a, k = _layerindex.select(pred, (a, k), (args, kwargs), ctx.key)
            out = next_fun(*a, **k)
            plain.append(out)
            return out

        edited = interceptor(step, args, kwargs, ctx)
        if not plain:
            plain.append(next_fun(*args, **kwargs))
        return _layerindex.select(pred, edited, plain[0], ctx.key)

    gated.__qualname__ = f"{getattr(interceptor, '__qualname__', 'interceptor')}[layers]"
    return gated


_dispatch.LAYER_GATE.register(gate, __name__)
