"""A docs page run as a reader pastes it, each example's output checked as its doctest checks it.

    python -m tests.page_runner docs/patching.md

Every Python block of the page, in order, in one fresh namespace (``__name__ == "__main__"``):
the examples of a doctest block (``>>>``) with their printed output compared as pytest compares
it (``ELLIPSIS``, ``NORMALIZE_WHITESPACE``; an example that shows an error must raise it), and
a plain block as a script runs it, its output not compared. Warnings are errors, except those
pytest's configuration ignores. Exits 1 with the failures (page line numbers) if any.
"""

from __future__ import annotations

import doctest
import re
import sys
import warnings
from pathlib import Path

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# a plain block: run, its output not compared
ANY_OUTPUT = doctest.register_optionflag("HOOKAX_ANY_OUTPUT")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


class _Checker(doctest.OutputChecker):
    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return bool(optionflags & ANY_OUTPUT) or super().check_output(want, got, optionflags)


def examples(text: str) -> list[doctest.Example]:
    """The page's examples in order; line numbers are the page's (0-based)."""
    out = []
    for m in BLOCK.finditer(text):
        block, first = m.group(1), text.count("\n", 0, m.start(1))
        if not block.lstrip().startswith(">>>"):  # one statement that runs the whole block
            code = f"exec(compile({block!r}, 'page line {first + 1}', 'exec'))\n"
            out.append(doctest.Example(code, "", lineno=first, options={ANY_OUTPUT: True}))
            continue
        for e in doctest.DocTestParser().get_examples(block):
            e.lineno += first
            out.append(e)
    return out


def run(page: Path) -> int:
    """Run the page; the number of failed examples."""
    test = doctest.DocTest(
        examples(page.read_text()),
        {"__name__": "__main__"},
        page.name,
        str(page),
        0,
        None,
    )
    runner = doctest.DocTestRunner(checker=_Checker(), optionflags=FLAGS)
    return runner.run(test, clear_globs=False).failed


def strict_warnings() -> None:
    """Warnings are errors, but for those pytest's configuration ignores (pyproject.toml)."""
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"jax(\..*)?$")
    warnings.filterwarnings("ignore", message=".*font cache.*", category=UserWarning)


if __name__ == "__main__":
    strict_warnings()
    sys.exit(1 if run(Path(sys.argv[1])) else 0)
