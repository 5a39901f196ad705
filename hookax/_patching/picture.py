"""A :class:`~.labelled.LabelledArray` drawn: a one-line ``repr``, a table that fits the terminal
(each cell coloured on a colour terminal), a heatmap in HTML for notebooks, and a matplotlib
figure.

Every picture is of a matrix: the last axis gives the columns, the axes before it the rows
(``layers/0 H1``: a target's head). The colour scale diverges around the corrupted run's metric
(around 0 for changes of the metric and for normalised values): red where a patch lowers the
metric below the corrupted run's, blue where it raises it towards the clean run's. Values
without a metric (a logit lens) get a sequential scale from their minimum to their maximum.
"""

from __future__ import annotations

import html as _html
import io
import math
import os
import sys
from typing import Any

import jax
import numpy as np

# The array drawn (:class:`.labelled.LabelledArray`, which imports this module when it is shown).
LabelledArray = Any

__all__ = ["Table", "describe", "html", "matrix", "plot", "text"]

WIDTH = 80  # the width of a table when the terminal's is unknown
MAX_ROWS = 40  # rows a table shows (then a line saying how many more)
HTML_ROWS, HTML_COLS = 128, 64  # cells a heatmap shows
NUMBERS_UP_TO = 24  # a heatmap with at most this many columns writes its values in its cells
LOW, MID, HIGH = (178, 24, 43), (247, 247, 247), (33, 102, 172)  # RdBu's ends and centre


def _concrete(la: LabelledArray) -> bool:
    return not isinstance(la.values, jax.core.Tracer)


def _short(labels: tuple[str, ...] | None, n: int = 3) -> str:
    if labels is None:
        return "None"
    if len(labels) <= 2 * n:
        return repr(list(labels))
    return "[" + ", ".join([*map(repr, labels[:n]), "...", *map(repr, labels[-1:])]) + "]"


def describe(la: LabelledArray) -> str:
    """``LabelledArray(f32[4,8], target=['embed', ...], position=[...], clean=..., ...)``."""
    from .._util.specs import format_spec

    spec = format_spec(tuple(la.values.shape), np.dtype(la.values.dtype).name)
    parts = [spec] + [f"{a}={_short(ls)}" for a, ls in zip(la.axes, la.labels)]
    parts += [
        f"{k}={v:.4g}"
        for k, v in (("clean", la.clean), ("corrupted", la.corrupted))
        if v is not None
    ]
    return f"LabelledArray({', '.join(parts)})"


def matrix(la: LabelledArray) -> tuple[list[str], list[str], np.ndarray]:
    """The rows' labels, the columns' labels and the values as a float64 matrix."""
    a = np.asarray(la.values).astype(np.float64)
    if a.ndim == 0:
        return [la.title or "value"], [""], a.reshape(1, 1)
    shape = a.shape
    names = [*la.labels[: a.ndim], *[None] * (a.ndim - len(la.labels))]
    own = [
        list(ls) if ls is not None else [str(i) for i in range(n)] for ls, n in zip(names, shape)
    ]
    cols = own[-1]
    rows = [""]
    for labels in own[:-1]:
        rows = [f"{r} {o}".strip() for r in rows for o in labels]
    if a.ndim == 1:
        rows = [la.title or "values"]
    return rows, cols, a.reshape(-1, shape[-1])


def axis_names(la: LabelledArray) -> tuple[list[str], str]:
    """The named axes that make a picture's rows, and the name of its columns' axis (empty for
    an axis without a name: a readout's or a metric's own)."""
    ndim = np.ndim(la.values)
    names = [*la.axes[:ndim], *[""] * (ndim - len(la.axes))]
    if not names:
        return [], ""
    return [n for n in names[:-1] if n], names[-1]


def _corner(la: LabelledArray) -> str:
    """The table's corner: ``target head \\ position``."""
    rows, col = axis_names(la)
    return " \\ ".join(a for a in (" ".join(rows), col) if a)


def centre(la: LabelledArray) -> float | None:
    """The value the colour scale diverges around (None: a sequential scale)."""
    if la.delta:
        return 0.0
    return la.corrupted


def scale(la: LabelledArray, m: np.ndarray) -> tuple[float, float]:
    """The colour scale's ends: symmetric around :func:`centre`, or the values' range."""
    finite = m[np.isfinite(m)]
    c = centre(la)
    if c is None:
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        return (lo, hi) if hi > lo else (lo - 1.0, lo + 1.0)
    half = float(np.abs(finite - c).max()) if finite.size else 0.0
    if la.clean is not None and la.corrupted is not None:  # the scale reaches the clean run
        half = max(half, abs(la.clean - la.corrupted))
    half = half or 1.0
    return c - half, c + half


def colour(v: float, lo: float, hi: float, diverging: bool) -> tuple[int, int, int]:
    """RdBu's colour of ``v`` on ``[lo, hi]`` (diverging), or white to blue (sequential)."""
    if not math.isfinite(v):
        return (128, 128, 128)
    t = min(max((v - lo) / (hi - lo), 0.0), 1.0)
    if not diverging:
        return _mix(MID, HIGH, t)
    return _mix(MID, LOW, 1 - 2 * t) if t < 0.5 else _mix(MID, HIGH, 2 * t - 1)


def _mix(a: tuple[int, ...], b: tuple[int, ...], t: float) -> tuple[int, int, int]:
    r, g, bl = (round(x + (y - x) * t) for x, y in zip(a, b))
    return r, g, bl


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _ink(rgb: tuple[int, int, int]) -> str:
    """Black or white text, whichever reads on ``rgb``."""
    return "#000000" if 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 140 else "#ffffff"


def formatter(m: np.ndarray) -> Any:
    """How a table writes the values of ``m``: one number of decimals for all (three
    significant digits of the largest), ``0.00`` rather than ``-0.00``; ``.2e`` for values
    far from 1."""
    finite = np.abs(m[np.isfinite(m)])
    top = float(finite.max()) if finite.size else 0.0
    if top and not 1e-3 <= top < 1e5:
        return lambda v: f"{v:.2e}" if math.isfinite(v) else str(v)
    digits = 2 if top == 0 else max(0, min(5, 2 - math.floor(math.log10(top))))

    def fmt(v: float) -> str:
        if not math.isfinite(v):
            return str(v)
        out = f"{v:.{digits}f}"
        return f"{0.0:.{digits}f}" if float(out) == 0 else out

    return fmt


def heading(la: LabelledArray) -> str:
    parts = [la.title or "values"]
    if la.clean is not None and la.corrupted is not None:
        parts.append(f"clean {la.clean:.4g}, corrupted {la.corrupted:.4g}")
    return ": ".join(parts)


# -- the table ---------------------------------------------------------------------------------


def _cut(label: str, width: int) -> str:
    return label if len(label) <= width else "…" + label[len(label) - width + 1 :]


def layout(la: LabelledArray, width: int) -> list[list[tuple[str, str]]]:
    """The table's lines, each a list of ``(text, rich style)``, none wider than ``width``."""
    from .._util.display import wrap

    lines: list[list[tuple[str, str]]] = [[(t, "bold")] for t in wrap(heading(la), width, 2)]
    if not _concrete(la):
        return [*lines, [("(traced: no values)", "")]]
    rows, cols, m = matrix(la)
    lo, hi = scale(la, m)
    diverging = centre(la) is not None
    fmt = formatter(m)
    cells = [[fmt(v) for v in r] for r in m[:MAX_ROWS]]
    cw = max(max((len(c) for r in cells for c in r), default=1), *(min(len(c), 6) for c in cols))
    corner = _corner(la)
    lw = min(max(len(r) for r in [*rows[:MAX_ROWS], corner[: width // 3]]), width // 3)
    fit = max(1, (width - lw) // (cw + 1))
    shown = list(range(len(cols)))
    if len(cols) > fit:
        shown = [*range(fit - 2), -1, len(cols) - 1] if fit >= 3 else list(range(fit))

    def head(i: int) -> str:
        return "…".rjust(cw) if i < 0 else _cut(cols[i], cw).rjust(cw)

    lines.append([(_cut(corner, lw).ljust(lw), "dim")] + [(" " + head(i), "bold") for i in shown])
    for r, label in enumerate(rows[:MAX_ROWS]):
        line = [(_cut(label, lw).ljust(lw), "cyan")]
        for i in shown:
            if i < 0:
                line.append((" " + "…".rjust(cw), ""))
                continue
            rgb = colour(m[r, i], lo, hi, diverging)
            line += [(" ", ""), (cells[r][i].rjust(cw), f"{_ink(rgb)} on {_hex(rgb)}")]
        lines.append(line)
    if len(rows) > MAX_ROWS:
        lines.append([(f"… {len(rows) - MAX_ROWS} more rows", "dim")])
    if len(cols) > len([i for i in shown if i >= 0]):
        lines.append([(f"… {len(cols)} columns in all", "dim")])
    return lines


class Table:
    """The table as a rich renderable (cells coloured on a colour console)."""

    def __init__(self, la: LabelledArray) -> None:
        self.la = la

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        color = console.color_system is not None
        for line in layout(self.la, min(options.max_width, 100_000)):
            yield Text.assemble(*((t, s if color else "") for t, s in line), no_wrap=True)


def text(la: LabelledArray, width: int | None = None, color: bool | None = False) -> str:
    """The table as text at ``width`` (default the terminal's, else 80 columns); ``color``
    None: ANSI colours when stdout is a colour terminal (and ``NO_COLOR`` is not set)."""
    from .._util.display import terminal_width

    width = width or terminal_width() or WIDTH
    if color is None:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    if not color:
        return "\n".join("".join(t for t, _ in line).rstrip() for line in layout(la, width))
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=True, force_jupyter=False).print(Table(la))
    return buf.getvalue().rstrip("\n")


# -- the heatmap in HTML -------------------------------------------------------------------------


def html(la: LabelledArray) -> str | None:
    """A ``<table>`` heatmap: labelled rows and columns, each cell's colour its value's, its
    value written in it when the table is small, and on hover its row, column and value."""
    if not _concrete(la):
        return None
    esc = _html.escape
    rows, cols, m = matrix(la)
    lo, hi = scale(la, m)
    diverging = centre(la) is not None
    numbers = len(cols) <= NUMBERS_UP_TO
    fmt = formatter(m)
    norm = (
        la.normalized()
        if la.clean is not None and la.corrupted is not None and la.clean != la.corrupted
        else None
    )
    nm = matrix(norm)[2] if norm is not None else None
    # cells without their numbers narrow, each as wide as a two-digit column label
    pad = "padding:2px 4px" if numbers else "padding:2px 1px;min-width:14px"
    td = f"{pad};text-align:right;font-family:monospace;font-size:11px"
    th = f"{pad};font-size:11px"
    out = [
        '<div class="hookax">',
        f"<style>.hookax-heatmap td {{{td}}} .hookax-heatmap th {{{th}}}</style>",
        f'<div style="font-weight:bold;font-size:12px;margin-bottom:2px">{esc(heading(la))}</div>',
        '<table class="hookax-heatmap" style="border-collapse:collapse">',
    ]
    corner = esc(_corner(la))
    heads = "".join(f'<th style="text-align:right">{esc(c)}</th>' for c in cols[:HTML_COLS])
    out.append(f'<thead><tr><th style="text-align:left">{corner}</th>{heads}</tr></thead><tbody>')
    for r, label in enumerate(rows[:HTML_ROWS]):
        cells = []
        for i, c in enumerate(cols[:HTML_COLS]):
            v = float(m[r, i])
            rgb = colour(v, lo, hi, diverging)
            tip = f"{label} × {c}: {v:.4g}"
            if nm is not None:
                tip += f" (normalised {float(nm[r, i]):.3g})"
            body = esc(fmt(v)) if numbers else ""
            style = f"background:{_hex(rgb)};color:{_ink(rgb)}"
            cells.append(f'<td title="{esc(tip)}" style="{style}">{body}</td>')
        row = f'<th style="text-align:left;padding-right:4px">{esc(label)}</th>'
        out.append(f"<tr>{row}{''.join(cells)}</tr>")
    out.append("</tbody></table>")
    notes = [
        f"colour scale {lo:.4g} (red) … {hi:.4g} (blue)"
        if diverging
        else f"colour scale {lo:.4g} … {hi:.4g}"
    ]
    if len(rows) > HTML_ROWS or len(cols) > HTML_COLS:
        notes.append(
            f"showing {min(len(rows), HTML_ROWS)} of {len(rows)} rows, "
            f"{min(len(cols), HTML_COLS)} of {len(cols)} columns"
        )
    note = "<br>".join(esc(n) for n in notes)
    out.append(f'<p style="font-size:11px;margin:4px 0">{note}</p></div>')
    return "\n".join(out)


# -- matplotlib ----------------------------------------------------------------------------------


def plot(
    la: LabelledArray,
    *,
    normalize: bool = False,
    ax: Any = None,
    title: str | None = None,
    cmap: str = "RdBu",
    out: str | None = None,
) -> Any:
    from .._util.extras import require

    require("matplotlib", "plot", "LabelledArray.plot (it draws a chart)")
    if not _concrete(la):
        from .._util.errors import HookaxError

        raise HookaxError("LabelledArray.plot: the values are traced. Fix: plot outside jax.jit.")
    if normalize:
        la = la.normalized()
    rows, cols, m = matrix(la)
    lo, hi = scale(la, m)
    title = title if title is not None else heading(la)
    if ax is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        from .._util.figure import Figure  # a notebook shows it as its image, pyplot or not

        # inches: the row labels (7 pt), the columns and the colour bar, the title (9 pt) and
        # along the bar its label (8 pt)
        labels = 0.05 * max((len(r) for r in rows[:64]), default=0)
        width = max(1.7 + labels + 0.35 * len(cols), 0.8 + 0.07 * len(title))
        height = max(1.2 + 0.25 * len(rows), 0.5 + 0.065 * len(la.title or "value"))
        fig = Figure(
            figsize=(min(width, 14.0), min(height, 12.0)),
            dpi=100,
            layout="constrained",
        )
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
    fig = ax.figure
    im = ax.imshow(
        m,
        cmap=cmap if centre(la) is not None else "viridis",
        vmin=lo,
        vmax=hi,
        aspect="auto",
        interpolation="nearest",
    )
    if len(cols) <= 64:
        ax.set_xticks(range(len(cols)), cols, fontsize=7)
    if len(rows) <= 64:
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
    row_axes, col_axis = axis_names(la)
    ax.set_xlabel(col_axis)
    ax.set_ylabel(" / ".join(row_axes))
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax).set_label(la.title or "value", fontsize=8)
    if out is not None:
        from .._util.figure import save_png

        save_png(fig, out)
    return fig
