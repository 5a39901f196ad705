"""A mkdocs hook: ``<!-- hookax-help SUB -->`` in a page becomes ``hookax SUB --help``, as
argparse draws it at 88 columns (``SUB`` empty: the top-level help), so the command-line
reference never drifts from the command. mkdocs.yml loads this file; it is not part of the
package."""

from __future__ import annotations

import os
import re
from typing import Any

MARKER = re.compile(r"^<!-- hookax-help ?([\w-]*) -->$", re.M)


def help_text(sub: str, columns: int = 88) -> str:
    from hookax._cli.main import _parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(columns)
    try:
        p = _parser()
        if sub:
            (subs,) = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
            p = subs.choices[sub]
        return p.format_help().rstrip()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return MARKER.sub(lambda m: f"```text\n{help_text(m.group(1))}\n```", markdown)
