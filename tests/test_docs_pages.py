"""Every docs page pastes: its Python blocks, run as one script in a fresh interpreter.

The doctests of a page (``pytest docs/PAGE.md``) run inside this project's test set-up
(``docs/conftest.py``); a reader pastes the blocks into a new Python session instead. So each
page's code, every block in order with the prompts and outputs left out (what the site's copy
button copies), runs here as one script in a fresh subprocess: no conftest, no fixtures, a new
empty working folder, JAX's default settings. A page that uses a name it does not define fails.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Each page takes 3-15 s as a script (a fresh interpreter imports JAX and compiles), about 3
# minutes for all: the newcomer's first two pages run in `make test`, the rest are `slow`.
FAST = {"index", "getting-started"}


def script(page: Path) -> str:
    """The page's Python: the source of each doctest example, or a plain block as it is."""
    parts = []
    for block in BLOCK.findall(page.read_text()):
        if not block.lstrip().startswith(">>>"):
            parts.append(block)
            continue
        for e in doctest.DocTestParser().get_examples(block):
            if e.exc_msg is None:
                parts.append(e.source)
            else:  # an example that shows an error: pasted, it prints the error and goes on
                body = textwrap.indent(e.source, "    ")
                parts.append(f"try:\n{body}except Exception:\n    pass\nelse:\n    {RAISE}\n")
    return "".join(parts)


RAISE = "raise AssertionError('the page shows an error here; pasted, none was raised')"


def pages() -> list:
    out = []
    for page in sorted(DOCS.rglob("*.md")):
        if not BLOCK.search(page.read_text()):
            continue
        marks = [] if page.stem in FAST else [pytest.mark.slow]
        out.append(pytest.param(page, id=page.relative_to(DOCS).as_posix(), marks=marks))
    return out


def test_an_example_that_shows_an_error_must_raise_it(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\n>>> 1 / 0\nTraceback (most recent call last):\nZeroDivisionError: x\n```\n"
    )
    code = script(page)
    exec(compile(code, "page", "exec"), {})  # raised and shown: the script goes on
    page.write_text(
        "```python\n>>> 1 / 1\nTraceback (most recent call last):\nZeroDivisionError: x\n```\n"
    )
    with pytest.raises(AssertionError, match="the page shows an error here"):
        exec(compile(script(page), "page", "exec"), {})


def test_script_is_the_code_the_copy_button_copies(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```python\n>>> x = 1\n>>> def f():\n...     return x\n>>> f()\n1\n\n```\n"
        "Text.\n```bash\nhookax --help\n```\n```python\nprint(f())\n```\n"
    )
    assert script(page) == "x = 1\ndef f():\n    return x\nf()\nprint(f())\n"


@pytest.mark.parametrize("page", pages())
def test_page_runs_pasted_into_a_fresh_interpreter(page: Path, tmp_path: Path) -> None:
    code = script(page)
    assert code.strip(), f"{page.name}: no Python blocks"
    (tmp_path / "page.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "PYTEST"))}
    env.update(PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "page.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    seconds = time.perf_counter() - t0
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-25:])
    assert run.returncode == 0, f"docs/{page.name} as a script failed ({seconds:.0f} s):\n{tail}"
    # what the page writes goes where the page says (a folder it made), not beside the reader
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.py"]
