"""Every test, doctest and page: tables at their natural width, as when piped.

pytest-xdist's workers set ``COLUMNS=80``, which hookax's tables follow; the tests of the width
set it themselves.

hookax's programs compile on their first call here (``HOOKAX_FIRST_CALL=compile``), as the
tests' exact values and compile counts were written for; ``tests/test_first_call_numpy.py``
runs each workflow both ways, and ``HOOKAX_FIRST_CALL=auto pytest`` runs everything the way a
user's session does.
"""

import os
import sys
from collections.abc import Iterator

import pytest

os.environ.setdefault("HOOKAX_FIRST_CALL", "compile")


@pytest.fixture(autouse=True)
def _natural_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


@pytest.fixture(autouse=True)
def _eager_compiles_end_with_their_test() -> Iterator[None]:
    """Eager programs a test ran with NumPy are compiled before the next test starts (a compile
    from one test never lands in another's compile count)."""
    yield
    firstcall = sys.modules.get("hookax._engine.firstcall")
    if firstcall is not None:
        firstcall.OPS.join()


PASTED = "tests/test_docs_pages.py::test_page_runs_pasted_into_a_fresh_interpreter["


@pytest.hookimpl(trylast=True)  # after -m, -k and --deselect chose the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A docs page whose pasted run (tests/test_docs_pages.py) is in the session is checked there,
    its examples' outputs included: its doctest item (``docs/PAGE.md::PAGE.md``) is not run
    again. ``pytest docs/PAGE.md`` alone runs it."""
    pasted = {i.nodeid[len(PASTED) : -1] for i in items if i.nodeid.startswith(PASTED)}
    again = [i for i in items if i.nodeid.startswith("docs/") and _page(i.nodeid) in pasted]
    if again:
        config.hook.pytest_deselected(items=again)
        items[:] = [i for i in items if i not in again]


def _page(nodeid: str) -> str:
    """``docs/reference/x.md::x.md`` -> ``reference/x.md``; ``""`` for other items."""
    path, _, _ = nodeid.partition("::")
    return path.removeprefix("docs/") if path.endswith(".md") else ""
