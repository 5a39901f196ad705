"""Rendering a :class:`~hookax.Summary` as a ``rich`` table (rich is imported here, lazily)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._summary import Summary, SummaryRow

__all__ = ["compact", "render", "table"]


def compact(n: float | None, unit: str = "") -> str:
    """A number with an SI prefix: ``compact(33024) == '33.0K'``.

    >>> compact(6_738_415_616)
    '6.74G'
    >>> compact(None)
    '?'
    """
    if n is None:
        return "?"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return (
                f"{n / scale:.3g}{prefix}{unit}"
                if n / scale < 100
                else f"{n / scale:.0f}{prefix}{unit}"
            )
    return f"{n:g}{unit}"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _shapes(specs: tuple[str, ...]) -> str:
    return "\n".join(specs) if specs else "-"


def _params(row: SummaryRow) -> str:
    text = f"{row.params:,}" if row.params else "-"
    if row.shared_with:
        text += f"\n(tied: {', '.join(k or '(model)' for k in row.shared_with)})"
    return text


def _key(row: SummaryRow) -> str:
    name = row.key if row.key else "(model)"
    suffix = f"  [+{row.folded} folded]" if row.folded else ""
    return "  " * row.depth + name + suffix


def table(s: Summary) -> Any:
    """The summary as a ``rich.table.Table``, ending with the totals."""
    from rich.table import Table

    t = Table(title="hookax summary", show_lines=False, title_justify="left")
    t.add_column("Call site", no_wrap=True)
    t.add_column("Type", no_wrap=True)
    t.add_column("Inputs", no_wrap=True)
    t.add_column("Outputs", no_wrap=True)
    t.add_column("Params", justify="right", no_wrap=True)
    t.add_column("FLOPs", justify="right", no_wrap=True)
    for row in s.rows:
        t.add_row(
            _key(row),
            row.type if row.method == "__call__" else f"{row.type}.{row.method}",
            _shapes(row.inputs),
            _shapes(row.outputs),
            _params(row),
            compact(row.flops),
        )
    tot = s.totals
    t.add_section()
    t.add_row("Total", "", "", "", f"{tot.params:,}", compact(tot.flops))
    shared = (
        f" (of which tied/shared: {tot.shared_params:,}, counted once)" if tot.shared_params else ""
    )
    flops = "?" if tot.flops is None else f"{tot.flops:,}"
    t.caption = (
        f"Total parameters: {tot.params:,}{shared}\n"
        f"Parameter bytes: {tot.param_bytes:,} ({_bytes(tot.param_bytes)})\n"
        f"FLOPs (XLA cost analysis): {flops} ({compact(tot.flops)})"
    )
    t.caption_justify = "left"
    return t


def render(s: Summary, width: int | None = None) -> str:
    """The table as plain text (no colour codes), as ``print(summary)`` shows it."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width or 200, force_terminal=False, color_system=None)
    console.print(table(s))
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())
