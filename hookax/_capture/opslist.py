"""``hx.ops``: the operations inside call sites, with their addresses, as a table and rows."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from .._engine.select import CALL_ONLY, as_selector, resolve_instances
from .ops import Listing, OpHandler, OpPattern, OpRow, named_softmax

__all__ = ["Ops", "ops"]

_HEADERS = ("Address", "Primitive", "Inputs", "Outputs", "Source")


class Ops:
    """The operations :func:`hx.ops` found: ``rows`` (:class:`hx.OpRow`), printed as a table."""

    def __init__(self, rows: list[OpRow]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[OpRow]:
        return iter(self.rows)

    @property
    def addresses(self) -> list[str]:
        """Every address, in program order."""
        return [r.address for r in self.rows]

    def to_json(self) -> str:
        import dataclasses

        return json.dumps([dataclasses.asdict(r) for r in self.rows], indent=1)

    def __str__(self) -> str:
        body = [
            (
                ("  " * _depth(r, self.rows)) + r.address,
                r.primitive,
                " ".join(r.inputs) or "-",
                " ".join(r.outputs) or "-",
                r.source,
            )
            for r in self.rows
        ]
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(_HEADERS)]
        widths[-1] = len(_HEADERS[-1])  # the last column is not padded
        line = "  ".join(h.ljust(w) for h, w in zip(_HEADERS, widths)).rstrip()
        out = [line, "-" * len(line)]
        out += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
        out.append(f"{len(self.rows)} operations in {len({r.key for r in self.rows})} call sites")
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"<hx.Ops: {len(self.rows)} operations>"


def _depth(row: OpRow, rows: list[OpRow]) -> int:
    by = {r.address: r for r in rows}
    d, within = 0, row.within
    while within and d < 16:
        d += 1
        within = by[within].within if within in by else ""
    return d


def ops(fn: Callable[..., Any], *args: Any, where: Any = None, **kwargs: Any) -> Ops:
    """The operations inside each call site of ``fn(*args, **kwargs)``, with their addresses.

    Computed abstractly (``eval_shape``: no arrays are allocated). Each row gives the address
    that ``ops=`` takes (``"layers/0/attn:softmax"``: the call site's key, the operation's name,
    ``#n`` for the n-th of that name within the call site, its child call sites not counted),
    the primitive, input and output shapes, and the source line. Named functions (a
    ``jax.jit`` function, a ``custom_jvp``/``custom_vjp`` function such as ``jax.nn.softmax``
    or ``jax.nn.relu``) are one row each, and the operations inside them follow, indented.

    Args:
      fn: a module, or a function that calls modules.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      where: which call sites to list; default every module's ``__call__``.
      **kwargs: example keyword arguments.

    Returns:
      An :class:`hx.Ops`: ``rows`` and a printable table.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import hookax as hx
    >>> class Block(nnx.Module):
    ...     def __init__(self):
    ...         self.lin = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    ...     def __call__(self, x):
    ...         return jnp.exp(jax.nn.softmax(self.lin(x)))
    >>> table = hx.ops(Block(), jnp.ones((2, 3)))
    >>> [(r.address, r.within) for r in table if r.name in ("softmax", "exp", "dot_general")]
    [('lin:dot_general', ''), (':softmax', ''), (':exp', ':softmax'), (':exp#1', '')]
    """
    from .._hooks.intercept import Entry, tracked
    from .actgrad import eval_shape, framework_mode, is_nnx_module

    listing = Listing()
    selector = as_selector(resolve_instances(where, (fn, args, kwargs)), CALL_ONLY)
    handler = OpHandler("list", listing, (OpPattern("**:*#*", selector, "*", None),))
    mode = framework_mode(fn, args, kwargs)
    if mode is True and is_nnx_module(fn):  # an argument of nnx.eval_shape: it may update state
        call, args = (lambda m, *a, **k: m(*a, **k)), (fn, *args)
    else:
        call = lambda *a, **k: fn(*a, **k)  # noqa: E731
    with tracked(Entry("ops", handler, selector), "hx.ops", where), named_softmax():
        eval_shape(call, mode, args, kwargs)
    return Ops(listing.rows)
