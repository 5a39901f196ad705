"""Rendering a summary as a table fitted to the terminal, plain text, HTML or Markdown.

This module reads a summary's fields and imports nothing of :mod:`hookax._summary.summary`, which
imports it: the dependency goes one way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["caption", "compact", "grid", "html", "human_bytes", "markdown", "render"]

_HEADERS = ("Call site", "Type", "Inputs", "Outputs", "Params", "FLOPs", "VJP FLOPs")


def compact(n: float | None, unit: str = "") -> str:
    """A number with an SI prefix: ``compact(33024) == '33K'``.

    Examples:
      >>> compact(6_738_415_616)
      '6.74G'
      >>> compact(None), compact(0)
      ('?', '0')
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


def human_bytes(n: int) -> str:
    """``human_bytes(940_584) == '918.54 KiB'``.

    Examples:
      >>> human_bytes(12)
      '12 B'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _shapes(specs: tuple[str, ...]) -> str:
    return "\n".join(specs) if specs else "-"


def _state(state: Any) -> list[str]:
    return [f"{name}: {n:,} ({human_bytes(b)})" for name, n, b in state]


def _params(row: Any) -> str:
    if row.same_as is not None:
        return f"(same module as {row.same_as or '(model)'})"
    if row.params_in is not None:
        return f"(in {row.params_in or '(model)'})"
    lines = [f"{row.params:,}" if row.params else "-"]
    if row.shared_with:
        lines.append(f"(tied: {', '.join(k or '(model)' for k in row.shared_with)})")
    lines += _state(row.state)
    lines += row.variables
    return "\n".join(lines)


def _key(row: Any, parent: str | None = None) -> str:
    """The key (``parent``: the key of the row above it in the tree, dropped from its start),
    indented by depth."""
    name = row.key if row.key else "(model)"
    if parent and row.key.startswith(parent + "/"):
        name = row.key[len(parent) + 1 :]
    if row.trips != 1:
        name += f"  x{'?' if row.trips is None else row.trips}"
    if row.vmapped:
        name += f"  (vmap {'x'.join(map(str, row.vmapped))})"
    if row.folded:
        name += f"  [+{row.folded} folded]"
    return "  " * row.depth + name


def _cells(row: Any, key: str | None = None) -> tuple[str, ...]:
    return (
        _key(row) if key is None else key,
        row.type if row.method == "__call__" else f"{row.type}.{row.method}",
        _shapes(row.inputs),
        _shapes(row.outputs),
        _params(row),
        compact(row.flops),
        compact(row.vjp_flops),
    )


def _full(n: int | None) -> str:
    return "?" if n is None else f"{n:,} ({compact(n)})"


def caption(s: Any) -> list[str]:
    """The totals, one line each; the parameter count written out in full."""
    tot = s.totals
    shared = (
        f", of which tied/shared: {tot.shared_params:,}, counted once" if tot.shared_params else ""
    )
    lines = [f"Total parameters: {tot.params:,} ({human_bytes(tot.param_bytes)}){shared}"]
    if tot.state:
        lines.append(
            f"Non-trainable: {tot.non_trainable:,} ({human_bytes(tot.non_trainable_bytes)}): "
            + ", ".join(f"{name} {n:,} ({human_bytes(b)})" for name, n, b in tot.state)
        )
    lines.append(f"FLOPs (XLA cost analysis): forward {_full(tot.flops)}")
    lines.append(f"FLOPs forward+backward (VJP): {_full(tot.vjp_flops)}")
    m = tot.memory
    if m is not None:
        lines.append(
            f"Memory of one training step (estimate): {human_bytes(m.total)} = inputs "
            f"{human_bytes(m.inputs)} + variables {human_bytes(m.params)} + gradients "
            f"{human_bytes(m.gradients)} + activations kept for backward "
            f"{human_bytes(m.activations)}"
        )
    return lines


def grid(s: Any) -> Any:
    """The summary as a :class:`hookax._util.display.Grid`: the table, the totals below it."""
    from .._util.display import Grid

    tot = s.totals
    total = ("Total", "", "", "", f"{tot.params:,}", compact(tot.flops), compact(tot.vjp_flops))
    rows = [_cells(row) for row in s.rows]
    parents: dict[int, str] = {}  # depth -> the key of the last row at that depth
    tree = []
    for row in s.rows:
        parents[row.depth] = row.key
        tree.append(_cells(row, _key(row, parents.get(row.depth - 1))))
    kw: dict[str, Any] = dict(
        numeric=frozenset({5, 6}),
        sections=frozenset({len(rows)}),
        footer=tuple(caption(s)),
        styles={0: "cyan", 5: "green", 6: "green"},
    )
    # Too wide for the terminal: each key without its parent's (a tree, as indented)
    narrow = Grid(s.title, _HEADERS, [*tree, total], **kw)
    return Grid(s.title, _HEADERS, [*rows, total], narrow=narrow, **kw)


def render(s: Any, width: int | None = None) -> str:
    """The table as plain text (no colour codes), as ``print(summary)`` shows it: at ``width``
    (default: the terminal's, :func:`hookax._util.display.terminal_width`; natural when piped)."""
    from .._util.display import terminal_width

    return grid(s).text(width or terminal_width())


def html(s: Any) -> str:
    """The table as HTML, for notebooks."""
    return grid(s).html()


def markdown(s: Any) -> str:
    """The table as GitHub Markdown (line breaks in cells as ``<br>``), the totals below."""

    def cell(text: str) -> str:
        return text.strip().replace("|", "\\|").replace("\n", "<br>") or " "

    lines = [f"**{cell(s.title)}**", ""]
    lines.append("| " + " | ".join(_HEADERS) + " |")
    lines.append("|" + "|".join("---:" if i >= 5 else "---" for i in range(len(_HEADERS))) + "|")
    for row in s.rows:
        lines.append("| " + " | ".join(cell(c) for c in _cells(row)) + " |")
    lines.append("")
    lines += [f"- {line}" for line in caption(s)]
    return "\n".join(lines)
