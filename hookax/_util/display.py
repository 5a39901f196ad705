"""Tables where people read them: fitted to a terminal's width, as plain text, in colour on a
terminal only, and as HTML for notebooks (``rich`` is imported lazily, when a table is drawn).

A :class:`Grid` is a table of strings. Fitted to a width, its cells wrap only *between* pieces
(after a space that does not separate a number from its unit, after ``/`` or ``:``, after a
``,`` that is not inside a number; never inside a word such as ``lm_head``, a number such as
``1.41M`` or a qualified name such as ``Embed.__call__``) and its
numeric columns never wrap, so no number is ever cut, parted from its unit or shortened to
``…``; columns shrink widest first, never below their longest piece. Without a width (output
piped to a file, no ``COLUMNS``) a table keeps its natural width.

Examples:
  >>> g = Grid("t", ("Key", "Count"), [("layers/0/mlp", "1,234,567")], numeric=frozenset({1}))
  >>> print(g.text(20))
  t
  Key            Count
  ────────────────────
  layers/0/  1,234,567
   mlp
"""

from __future__ import annotations

import dataclasses
import html
import io
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "NATURAL",
    "Grid",
    "Line",
    "echo",
    "in_notebook",
    "pieces",
    "plain",
    "terminal_width",
    "wrap",
]

NATURAL = 100_000  # the width that stands for "no limit": a table takes its natural width


def terminal_width(stream: Any = None) -> int | None:
    """The width to draw at: ``COLUMNS`` when set, else the terminal's width when ``stream``
    (default ``sys.stdout``) is a terminal, else None (natural width: piped, a notebook)."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    stream = sys.stdout if stream is None else stream
    if not _isatty(stream):
        return None
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 80


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed, or not a file
        return False


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (its output goes to a notebook)."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if get is not None else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


# Units that stay on the line of the number before them: "451.25 KiB", "3.1 ms", "x32".
UNITS = frozenset(
    {"B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "ns", "us", "µs", "ms", "s", "x"}
)


def _breaks_after(text: str, i: int) -> bool:
    """Whether a line may break between ``text[i - 1]`` and ``text[i]``: after a space (not
    between a number and its unit), after ``/ : ; ) > ]``, after a ``,`` that is not inside a
    number; never inside a word (``lm_head`` and ``Embed.__call__`` stay whole)."""
    a, b = text[i - 1], text[i]
    if b == " ":
        return False
    if a == " ":
        return not (i >= 2 and text[i - 2].isdigit() and _word_at(text, i) in UNITS)
    if a in "/:;)>]":
        return True
    if a == ",":  # not inside a number or a shape: 115,520, f32[2,32,172]
        return not (i >= 2 and text[i - 2].isdigit() and b.isdigit())
    return False  # a "." is inside a number, a file name or a qualified name: Embed.__call__


def _word_at(text: str, i: int) -> str:
    """The word starting at ``text[i]``, without the punctuation that follows it."""
    end = i
    while end < len(text) and (text[end].isalnum() or text[end] == "µ"):
        end += 1
    return text[i:end]


def pieces(text: str) -> list[str]:
    """``text`` cut where a line may break (each piece keeps its trailing separator).

    Examples:
      >>> pieces("layers/0/attn_norm 1.41M f32[2,32,172]")
      ['layers/', '0/', 'attn_norm ', '1.41M ', 'f32[2,32,172]']
      >>> pieces("variables 451.25 KiB (tied: lm_head)")
      ['variables ', '451.25 KiB ', '(tied: ', 'lm_head)']
    """
    out, start = [], 0
    for i in range(1, len(text)):
        if _breaks_after(text, i):
            out.append(text[start:i])
            start = i
    if text:
        out.append(text[start:])
    return out


def pieces_of(text: str) -> list[tuple[str, list[str]]]:
    """Each line of ``text``: its leading spaces and the :func:`pieces` of the rest."""
    out = []
    for para in text.split("\n"):
        body = para.lstrip(" ")
        out.append((para[: len(para) - len(body)], pieces(body)))
    return out


def wrap(
    text: str, width: int, hang: int = 1, cut: list[tuple[str, list[str]]] | None = None
) -> list[str]:
    """The lines of ``text`` at most ``width`` wide, broken only between :func:`pieces`.

    A line's leading spaces are kept on its continuation lines, plus ``hang`` more. Only a
    piece wider than the whole width is cut (a width below :func:`min_width`). ``cut``:
    :func:`pieces_of` of ``text``, when already computed.

    Examples:
      >>> wrap("  layers/0/mlp/gate", 12)
      ['  layers/0/', '   mlp/gate']
    """
    out: list[str] = []
    for lead, parts in pieces_of(text) if cut is None else cut:
        line = lead
        for piece in parts:
            if len((line + piece).rstrip()) <= width or not line.strip():
                line += piece
            else:
                out.append(line.rstrip())
                line = lead + " " * hang + piece
            while len(line.rstrip()) > width:  # one piece wider than the column
                at = max(width, len(lead) + hang + 1)
                out.append(line[:at])
                line = lead + " " * hang + line[at:]
        out.append(line.rstrip())
    return out


def natural_width(text: str) -> int:
    return max((len(line) for line in text.split("\n")), default=0)


def min_width(text: str, hang: int = 1) -> int:
    """The narrowest width :func:`wrap` keeps every piece of ``text`` whole at."""
    best = 0
    for para in text.split("\n"):
        body = para.lstrip(" ")
        lead = len(para) - len(body)
        parts = [p.rstrip() for p in pieces(body)]
        if parts:
            best = max(best, lead + len(parts[0]), *(lead + hang + len(p) for p in parts[1:]))
    return best


def fit(columns: Sequence[Sequence[str]], minimum: Sequence[int], room: int) -> list[int]:
    """Widths of columns (each ``[header, *cells]``) that sum to at most ``room``.

    From their natural widths, one column at a time narrows by one character: the one whose
    lines (wrapped by :func:`wrap`) grow least, the widest of those; so a header or a few long
    cells wrap before a column of many does. None narrows below its ``minimum`` (the sum of the
    minimums when even those do not fit).

    Examples:
      >>> fit([["Key", "layers/0/mlp", "x"], ["Count", "1,234"]], [7, 5], 14)
      [9, 5]
    """
    natural = [max(natural_width(c) for c in col) for col in columns]
    widths = list(natural)
    cut = [[(c, pieces_of(c)) for c in col] for col in columns]
    cache: dict[tuple[int, int], int] = {}

    def lines(i: int, w: int) -> int:
        if (i, w) not in cache:
            cache[i, w] = sum(
                len(wrap(c, w, 0 if j == 0 else 1, cuts))
                for j, (c, cuts) in enumerate(cut[i])
                if natural_width(c) > w
            )
        return cache[i, w]

    while sum(widths) > room:
        costs = [
            (lines(i, w - 1) - lines(i, w), -w, i) for i, w in enumerate(widths) if w > minimum[i]
        ]
        if not costs:
            break
        widths[min(costs)[2]] -= 1
    return widths


@dataclasses.dataclass(frozen=True)
class Line:
    """A row of a :class:`Grid` that is one line across the whole table (a group's name)."""

    text: str
    style: str = ""


@dataclasses.dataclass(frozen=True)
class Grid:
    """A table of strings, drawn at a width (see the module's docstring).

    Attributes:
      title: a line above the table.
      headers: the column names.
      rows: the cells, or a :class:`Line` across the table; a cell may hold several lines
        (``"\\n"``); leading spaces indent.
      numeric: columns of numbers: right-justified and never wrapped.
      whole: columns of names that are never wrapped either (addresses to copy), left-justified.
      sections: row indexes that start a new section (a rule above them).
      footer: lines below the table (wrapped to the width, continuation lines indented).
      boxed: draw a box (rules around every cell) when the natural width fits (and no row is
        a :class:`Line`); otherwise columns are two spaces apart, a rule under the header.
      styles: column index -> rich style, used on a colour terminal only.
      narrow: another grid of the same table, drawn instead of this one when this one's
        natural width does not fit (shorter names, say); None: this one, wrapped.
    """

    title: str
    headers: tuple[str, ...]
    rows: Sequence[tuple[str, ...] | Line]
    numeric: frozenset[int] = frozenset()
    whole: frozenset[int] = frozenset()
    sections: frozenset[int] = frozenset()
    footer: tuple[str, ...] = ()
    boxed: bool = True
    styles: dict[int, str] = dataclasses.field(default_factory=dict)
    narrow: Grid | None = None

    # -- layout ---------------------------------------------------------------------------------

    def _columns(self) -> list[list[str]]:
        """Each column: its header, then its cells."""
        cells = [row for row in self.rows if not isinstance(row, Line)]
        return [[head] + [row[i] for row in cells] for i, head in enumerate(self.headers)]

    def _natural(self) -> list[int]:
        return [max(natural_width(c) for c in col) for col in self._columns()]

    def fits(self, width: int) -> bool:
        """Whether the table fits ``width`` at its natural width."""
        return self.layout(width)[1] == self._natural()

    def layout(self, width: int) -> tuple[bool, list[int]]:
        """Whether to draw the box, and the columns' widths (without padding) at ``width``."""
        columns, natural = self._columns(), self._natural()
        n = len(self.headers)
        boxed = self.boxed and not any(isinstance(row, Line) for row in self.rows)
        if boxed and sum(natural) + 3 * n + 1 <= width:
            return True, natural
        minimum = []
        for i, (head, *cells) in enumerate(columns):
            if i in self.numeric or i in self.whole:  # numbers and whole names never wrap
                low = max([min_width(head, 0)] + [natural_width(c) for c in cells])
            else:
                low = max([min_width(head, 0)] + [min_width(c) for c in cells])
            minimum.append(min(low, natural[i]))
        room = width - 2 * (n - 1)
        if sum(minimum) > room:  # whole names that do not fit: as wide as the others leave
            others = sum(m for i, m in enumerate(minimum) if i not in self.whole)
            share = (room - others) // max(len(self.whole), 1)
            for i in self.whole:
                cut = max(min_width(c, 0 if j == 0 else 1) for j, c in enumerate(columns[i]))
                minimum[i] = min(max(cut, share), natural[i])
        return False, fit(columns, minimum, room)

    # -- drawing --------------------------------------------------------------------------------

    def renderables(self, width: int, color: bool = False) -> Iterator[Any]:
        """The title, the table and the footer, fitted to ``width`` (rich renderables)."""
        from rich.text import Text

        if self.narrow is not None and not self.fits(width):
            yield from self.narrow.renderables(width, color)
            return

        def lines(text: str, hang: int, style: str = "") -> Any:
            body = "\n".join(wrap(text, width, hang)) if width < NATURAL else text
            return Text(body, style=style if color else "", no_wrap=True, overflow="ignore")

        if self.title:
            yield lines(self.title, 2, "bold")
        boxed, widths = self.layout(width)
        if boxed:
            yield self._boxed(widths, color)
        else:
            for line in self._lines(widths, width, color):
                yield line
        for line in self.footer:
            yield lines(line, 2)

    def _boxed(self, widths: list[int], color: bool) -> Any:
        """A rich table in a box, at the columns' natural widths."""
        from rich import box
        from rich.table import Table
        from rich.text import Text

        t = Table(box=box.HEAVY_HEAD, header_style="bold" if color else "")
        for i, (head, w) in enumerate(zip(self.headers, widths)):
            t.add_column(
                head,
                width=w,
                no_wrap=True,
                justify="right" if i in self.numeric else "left",
                style=self.styles.get(i, "") if color else "",
            )
        for r, row in enumerate(self.rows):
            assert not isinstance(row, Line)
            if r in self.sections and r:
                t.add_section()
            t.add_row(
                *(
                    Text(c, justify="right" if i in self.numeric else "left", no_wrap=True)
                    for i, c in enumerate(row)
                )
            )
        return t

    def _lines(self, widths: list[int], width: int, color: bool) -> Iterator[Any]:
        """The table without a box: columns two spaces apart, wrapped to ``widths``."""
        from rich.text import Text

        drawn = sum(widths) + 2 * (len(widths) - 1)
        rule = Text("─" * drawn, no_wrap=True, overflow="ignore")

        def join(cells: list[list[str]], bold: bool = False) -> Iterator[Any]:
            for k in range(max(len(c) for c in cells)):
                line = Text(no_wrap=True, overflow="ignore")
                for i, (c, w) in enumerate(zip(cells, widths)):
                    part = c[k] if k < len(c) else ""
                    part = part.rjust(w) if i in self.numeric else part.ljust(w)
                    style = "bold" if bold else self.styles.get(i, "")
                    line.append(("  " if i else "") + part, style=style if color else "")
                line.rstrip()
                yield line

        heads = [wrap(h, w, 0) for h, w in zip(self.headers, widths)]
        tall = max(len(h) for h in heads)
        yield from join([[""] * (tall - len(h)) + h for h in heads], bold=True)  # on the rule
        yield rule
        for r, row in enumerate(self.rows):
            if r in self.sections and r:
                yield rule
            if isinstance(row, Line):
                text = "\n".join(wrap(row.text, max(width, drawn), 2))
                yield Text(text, style=row.style if color else "", no_wrap=True, overflow="ignore")
                continue
            cells = [
                c.split("\n")
                if i in self.numeric or (i in self.whole and natural_width(c) <= w)
                else wrap(c, w)
                for i, (c, w) in enumerate(zip(row, widths))
            ]
            yield from join(cells)

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        yield from self.renderables(options.max_width, color=console.color_system is not None)

    def text(self, width: int | None = None) -> str:
        """The table as plain text at ``width`` (None: its natural width)."""
        return plain(self, width)

    # -- HTML -----------------------------------------------------------------------------------

    def html(self) -> str:
        """The table as HTML (a ``<table>``, the footer below it), for notebooks."""

        def cell(text: str, tag: str, right: bool, span: int = 1) -> str:
            lines = []
            for line in text.split("\n"):
                body = line.lstrip(" ")
                lines.append("&nbsp;" * (len(line) - len(body)) + html.escape(body))
            style = "text-align:right;white-space:nowrap" if right else "text-align:left"
            cols = f' colspan="{span}"' if span > 1 else ""
            return f'<{tag}{cols} style="{style}">{"<br>".join(lines)}</{tag}>'

        out = ['<div class="hookax">', '<table style="border-collapse:collapse">']
        if self.title:
            title = html.escape(self.title)
            out.append(f'<caption style="text-align:left"><b>{title}</b></caption>')
        heads = "".join(cell(h, "th", i in self.numeric) for i, h in enumerate(self.headers))
        out.append(f"<thead><tr>{heads}</tr></thead><tbody>")
        for r, row in enumerate(self.rows):
            rule = ' style="border-top:1px solid"' if r in self.sections and r else ""
            if isinstance(row, Line):
                cells = cell(row.text, "td", False, len(self.headers))
            else:
                cells = "".join(cell(c, "td", i in self.numeric) for i, c in enumerate(row))
            out.append(f"<tr{rule}>{cells}</tr>")
        out.append("</tbody></table>")
        if self.footer:
            out.append("<p>" + "<br>".join(html.escape(line) for line in self.footer) + "</p>")
        out.append("</div>")
        return "\n".join(out)


def _console(file: Any, width: int, color: bool) -> Any:
    from rich.console import Console

    return Console(
        file=file,
        width=width,
        force_terminal=color,
        force_jupyter=False,  # a kernel's console would send the text to the notebook instead
        color_system="auto" if color else None,
        highlight=False,
        legacy_windows=False,
    )


def plain(renderable: Any, width: int | None = None) -> str:
    """``renderable`` (anything rich draws) as plain text, in every environment (also in a
    Jupyter kernel); trailing spaces removed. ``width`` None: its natural width."""
    buf = io.StringIO()
    _console(buf, width or NATURAL, color=False).print(renderable, crop=False)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def echo(renderable: Any, file: Any = None) -> None:
    """Print ``renderable`` to ``file`` (default stdout) at the terminal's width (see
    :func:`terminal_width`), in colour on a terminal only (and unless ``NO_COLOR`` is set)."""
    file = sys.stdout if file is None else file
    width = terminal_width(file)
    if _isatty(file) and not os.environ.get("NO_COLOR"):
        _console(file, width or 80, color=True).print(renderable, crop=False)
    else:
        print(plain(renderable, width), file=file)
