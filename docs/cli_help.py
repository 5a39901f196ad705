"""A mkdocs hook: ``<!-- hookax-help SUB -->`` in a page becomes ``hookax SUB --help``, as
argparse draws it at 88 columns (``SUB`` empty: the top-level help), so the command-line
reference never drifts from the command. mkdocs.yml loads this file; it is not part of the
package."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- hookax-help ?([\w-]*) -->$", re.M)


def help_text(sub: str, columns: int = 88) -> str:
    """``hookax SUB --help`` of this checkout, in a process of its own (the hookax that mkdocs
    may have imported could be another installation's)."""
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "hookax", *([sub] if sub else []), "--help"]
    run = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return run.stdout.rstrip()


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return MARKER.sub(lambda m: f"```text\n{help_text(m.group(1))}\n```", markdown)
