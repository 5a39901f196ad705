"""Where a call site of the residual graph runs, relative to the run that reads it.

The graph's run keeps its senders' values and adds its receivers' shifts in the trace the
model's call starts in (the *top*). A call site inside a ``jax.vmap`` the model applies
(Equinox maps the positions so: ``jax.vmap(self.embed)(tokens)``, the projections of
``eqx.nn.MultiheadAttention``; or ``jax.vmap(model)`` over a batch) sees one element at a time:
:func:`whole` takes a value made there to the top, every element stacked, the vmaps' axes in
front (outermost first, as ``hx.capture`` stacks them), and :func:`each` gives such a whole
value to the call site as its element's slice. A scan over stacked layers runs as a Python
loop in the run (:func:`unrolled`), each iteration's call sites in the top trace, labelled by
their layer in the order the loop runs them. A call site inside any other transform of the
model's own (``jax.checkpoint``, a ``cond`` or a ``while_loop`` on traced values) raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .._engine import context as _context
from .._util.errors import HookaxError
from .._util.jaxcompat import batching, core

__all__ = ["each", "root", "unrolled", "vmaps", "whole"]


@contextlib.contextmanager
def unrolled() -> Iterator[None]:
    """Run the model's scans as Python loops (``jax.disable_jit``: ``lax.scan``,
    ``nnx.scan``, ``nn.scan``, ``fori_loop`` over static bounds), so each layer's call sites
    run in the trace its call starts in, one after another; its ``jax.jit`` calls are inlined.
    The run computes the same operations on the same values: the iterations, unrolled."""
    with jax.disable_jit():
        yield


def vmaps(top: Any, who: str, key: str) -> tuple[Any, ...] | None:
    """The ``jax.vmap`` traces between ``top`` and the current trace, outermost first; None
    in the pass Linen's ``nn.scan`` makes over its body before the scan (to find the outputs
    that do not change from layer to layer: the call sites run as they are, nothing is
    recorded); raise if any other transform is between them."""
    t = _context.current_trace()
    found = []
    while t is not top:
        if type(t).__name__ == "JaxprTrace" and _context._in_linen_scan_prepass():
            return None
        if t is None or type(t).__name__ != "BatchTrace":
            _raise(who, key)
        found.append(t)
        t = t.parent_trace
    return tuple(found[::-1])


def _raise(who: str, key: str) -> None:
    raise HookaxError(
        f"{who}: the call site {key!r} runs inside a transform the model applies itself "
        f"(jax.checkpoint / remat, a cond or a while_loop on traced values). The residual "
        f"graph is read off one run in which every layer's parts are called one after "
        f"another, each value visible to the parts after it; a value made inside such a "
        f"transform is not (jax.vmap and scans over layers are followed). Fix: call the "
        f"parts outside the transform (e.g. without remat; a Python loop for a while_loop)."
    )


def whole(value: Any, maps: tuple[Any, ...]) -> Any:
    """``value``, made inside the vmaps ``maps``, as the top trace sees it: every element, the
    vmaps' axes in front (outermost first)."""
    for v in reversed(maps):
        with core.set_current_trace(v.parent_trace):
            mine = isinstance(value, batching.BatchTracer) and value._trace.tag is v.tag
            val, dim = (value.val, value.batch_dim) if mine else (value, None)
            if dim is None:
                value = jnp.broadcast_to(val, (v.axis_data.size, *jnp.shape(val)))
            else:
                value = jnp.moveaxis(val, dim, 0)
    return value


def each(value: Any, maps: tuple[Any, ...]) -> Any:
    """A whole ``value`` (the vmaps' axes in front) as the element of ``maps`` that the call
    site runs sees it."""
    for v in maps:
        value = batching.BatchTracer(v, value, 0)
    return value


def root(value: Any, maps: tuple[Any, ...]) -> Any:
    """The array ``value`` is an element of, in the top trace (for identity checks: the same
    array read by two vmaps has one root)."""
    for v in reversed(maps):
        if isinstance(value, batching.BatchTracer) and value._trace.tag is v.tag:
            value = value.val
    return value
