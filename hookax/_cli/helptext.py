"""Help text wrapped by argparse at the terminal's width, and unknown flags answered with the
nearest flag of the subcommand that was run.

Descriptions and epilogs are written one paragraph per source line (never wrapped by hand): a
line that ends with ``:`` is a heading, a line's leading spaces indent it and its continuation
lines, and a line starting with ``- `` is a list item (its continuation lines hang under its
text). :class:`HelpFormatter` wraps each at the width argparse draws at (``COLUMNS``, else the
terminal's, less 2), between words only: a flag or a path is never cut.

Examples:
  >>> f = HelpFormatter("hookax", width=30)
  >>> print(f._fill_text("notes:\\n  - an item that is long enough to wrap once", 30, ""))
  notes:
    - an item that is long
      enough to wrap once
  >>> nearest_flag("--exmaple", ["--example", "--eval", "--input"])
  '--example'
  >>> nearest_flag("--foo", ["--format", "--help"]) is None
  True
"""

from __future__ import annotations

import argparse
import difflib
import textwrap
from collections.abc import Iterable

__all__ = ["HelpFormatter", "nearest_flag"]


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    return textwrap.wrap(
        text,
        max(width, len(rest) + 1),
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, wrapping between words only, and keeping the paragraphs, headings
    and list items of descriptions and epilogs (see the module's docstring)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return _wrap(" ".join(text.split()), width, "", "")

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        for line in text.splitlines():
            body = line.strip()
            if not body:
                out.append("")
                continue
            lead = indent + line[: len(line) - len(line.lstrip())]
            hang = "  " if body.startswith("- ") else ""
            out += _wrap(" ".join(body.split()), width, lead, lead + hang)
        return "\n".join(out)


def nearest_flag(flag: str, flags: Iterable[str]) -> str | None:
    """The flag of ``flags`` that ``flag`` (a typo) most likely meant, or None."""
    name = flag.split("=", 1)[0].lstrip("-")
    names = {f.lstrip("-"): f for f in flags if f.startswith("--") and f != "--help"}
    close = difflib.get_close_matches(name, list(names), 1, 0.6)
    return names[close[0]] if close else None
