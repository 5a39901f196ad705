"""``hx.ops``: the operations inside call sites, with their addresses, as a table and rows."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from .._engine import adapters as _adapters
from .._engine.select import ALL_METHODS, Where, as_selector, resolve_instances
from .._util.words import counted
from ..frameworks._functions import as_program
from .ops import Listing, OpHandler, OpPattern, OpRow, named_softmax

__all__ = ["Ops", "ops"]

_HEADERS = ("Address", "Primitive", "Inputs", "Outputs", "Source")


class Ops:
    """The operations [`hx.ops`][hookax.ops] found: ``rows`` ([`hx.OpRow`][hookax.OpRow]),
    printed as a table."""

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

    def grid(self) -> Any:
        """The table as a ``hookax._util.display.Grid`` (what ``print`` and notebooks
        show): one row per operation. Too wide for the terminal, each call site and each source
        line becomes a line of its own, above the operations it holds (each by its whole
        address, ``embed:take``, as ``ops=`` takes it; the primitive in brackets where it
        differs)."""
        from .._util.display import Grid, Line

        sites = len({r.key for r in self.rows})
        footer = (f"{counted(len(self.rows), 'operation')} in {counted(sites, 'call site')}",)
        wide: list[Any] = []
        narrow: list[Any] = []
        key = source = None
        for r in self.rows:
            indent = "  " * _depth(r, self.rows)
            shapes = (" ".join(r.inputs) or "-", " ".join(r.outputs) or "-")
            wide.append((indent + r.address, r.primitive, *shapes, r.source))
            if r.key != key:
                narrow.append(Line(r.key or "(model)", "bold cyan"))
                key, source = r.key, None
            if r.source != source:
                narrow.append(Line(f"  at {_short(r.source) or '?'}", "dim"))
                source = r.source
            name = r.address  # the whole address: what ops= takes
            if r.primitive != r.name:
                name += f" ({r.primitive})"
            narrow.append(("  " + indent + name, *shapes))
        heads = ("Operation", "Inputs", "Outputs")
        small = Grid(
            "", heads, narrow, footer=footer, boxed=False, styles={0: "cyan"}, whole=frozenset({0})
        )
        styles = {0: "cyan", 4: "dim"}
        return Grid("", _HEADERS, wide, footer=footer, boxed=False, styles=styles, narrow=small)

    def __rich__(self) -> Any:
        return self.grid()

    def __str__(self) -> str:
        """The table as text at the terminal's width (natural when piped or in a notebook)."""
        from .._util.display import terminal_width

        return self.grid().text(terminal_width())

    def __repr__(self) -> str:
        sites = len({r.key for r in self.rows})
        return f"<hx.Ops: {counted(len(self.rows), 'operation')} in {counted(sites, 'call site')}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text
        p.text(str(self))

    def _repr_html_(self) -> str:  # a notebook's table
        return self.grid().html()


def _short(source: str) -> str:
    """A source line without the ``<locals>`` of nested functions' names."""
    return source.replace(".<locals>.", ".")


def _depth(row: OpRow, rows: list[OpRow]) -> int:
    by = {r.address: r for r in rows}
    d, within = 0, row.within
    while within and d < 16:
        d += 1
        within = by[within].within if within in by else ""
    return d


def ops(fn: Callable[..., Any], *args: Any, where: Where = None, **kwargs: Any) -> Ops:
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
      where: which call sites to list; default every call site: each module's ``__call__``
        and the other methods it runs (``"attn:forward:softmax"`` for an operation inside
        ``attn.forward``). Without ``methods=`` a ``where=`` lists every method of the call
        sites it names.
      **kwargs: example keyword arguments.

    Returns:
      An [`hx.Ops`][hookax.Ops]: ``rows`` and a printable table.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> class Block(nnx.Module):
      ...     def __init__(self):
      ...         self.lin = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
      ...     def __call__(self, x):
      ...         return jnp.exp(jax.nn.softmax(self.lin(x)))
      >>> table = hx.ops(Block(), jnp.ones((2, 3)))
      >>> names = ("softmax", "exp", "dot_general")
      >>> [(r.address, r.within) for r in table if r.name in names]
      [('lin:dot_general', ''), (':softmax', ''), (':exp', ':softmax'), (':exp#1', '')]
    """
    fn = as_program(fn)  # a program without modules: its own call sites
    from .._hooks.intercept import Entry, tracked
    from .actgrad import eval_shape, framework_mode, is_nnx_module
    from .capture import check_variables

    check_variables("hx.ops", fn)
    listing = Listing()
    selector = as_selector(resolve_instances(where, (fn, args, kwargs)), ALL_METHODS)
    handler = OpHandler("list", listing, (OpPattern("**:*#*", selector, "*", None),))
    mode = framework_mode(fn, args, kwargs)
    if mode is True and is_nnx_module(fn):  # an argument of nnx.eval_shape: it may update state
        call, args = (lambda m, *a, **k: m(*a, **k)), (fn, *args)
    else:
        call = lambda *a, **k: fn(*a, **k)  # noqa: E731
    with tracked(Entry("ops", handler, selector), "hx.ops", where), named_softmax():
        try:
            eval_shape(call, mode, args, kwargs)
        except ValueError as e:
            _adapters.note_haiku_outside_transform(e, "hx.ops")
            raise
    return Ops(listing.rows)
