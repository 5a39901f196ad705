"""Every docs page pastes: its Python blocks, run in order in a fresh interpreter, each example's
output checked.

A reader pastes a page's blocks into a new Python session: no conftest, no fixtures, JAX's
default settings. So each page runs here in a fresh subprocess (``tests/page_runner.py``), in a
new empty working folder, at 88 columns (the width of the site's code blocks): the examples of
its doctest blocks with their output compared as pytest's doctests compare it, and its plain
blocks as a script runs them. A page that uses a name it does not define, or prints what it does
not show, fails. This is the check of a page's examples: where it runs, the page's own doctest
items (``docs/PAGE.md``) are not run again (``conftest.py``); ``pytest docs/PAGE.md`` alone
runs them in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import page_runner

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Each page takes 3-60 s (a fresh interpreter imports JAX and compiles): the newcomer's first two
# pages run in `make test`, the rest are `slow`.
FAST = {"index", "getting-started"}


def pages() -> list:
    out = []
    for page in sorted(DOCS.rglob("*.md")):
        if not page_runner.BLOCK.search(page.read_text()):
            continue
        marks = [] if page.stem in FAST else [pytest.mark.slow]
        out.append(pytest.param(page, id=page.relative_to(DOCS).as_posix(), marks=marks))
    return out


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_examples_outputs_errors_and_plain_blocks(tmp_path: Path) -> None:
    ok = (
        "# A page\n\n```python\n>>> x = 1\n>>> def f():\n...     return x\n>>> f()\n1\n\n```\n"
        "Text.\n```bash\nhookax --help\n```\n```python\ny = f() + 1\nprint(y)\n```\n"
        "```python\n>>> y\n2\n>>> 1 / 0\nTraceback (most recent call last):\n"
        "ZeroDivisionError: division by zero\n\n```\n"
    )
    assert page_runner.run(_page(tmp_path, ok)) == 0
    wrong = "```python\n>>> 1 + 1\n3\n\n```\n"
    assert page_runner.run(_page(tmp_path, wrong)) == 1
    undefined = "```python\n>>> z\n1\n\n```\n"
    assert page_runner.run(_page(tmp_path, undefined)) == 1
    shows_an_error_that_is_not_raised = (
        "```python\n>>> 1 / 1\nTraceback (most recent call last):\nZeroDivisionError: x\n\n```\n"
    )
    assert page_runner.run(_page(tmp_path, shows_an_error_that_is_not_raised)) == 1
    plain_block_fails = "```python\nraise ValueError('x')\n```\n"
    assert page_runner.run(_page(tmp_path, plain_block_fails)) == 1


def test_a_failure_names_the_pages_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    page = _page(tmp_path, "# Title\n\nText.\n\n```python\n>>> 1 + 1\n3\n\n```\n")
    assert page_runner.run(page) == 1
    assert f'File "{page}", line 6' in capsys.readouterr().out


@pytest.mark.parametrize("page", pages())
def test_page_runs_pasted_into_a_fresh_interpreter(page: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "PYTEST"))}
    env.update(PYTHONPATH=str(ROOT), MPLBACKEND="Agg", COLUMNS="88")
    env.pop("LINES", None)
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "tests.page_runner", str(page)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    seconds = time.perf_counter() - t0
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-60:])
    assert run.returncode == 0, f"docs/{page.name} pasted failed ({seconds:.0f} s):\n{tail}"
    # what the page writes goes where the page says (a folder it made), not beside the reader
    assert list(tmp_path.iterdir()) == []
