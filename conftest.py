"""Every test, doctest and page: tables at their natural width, as when piped.

pytest-xdist's workers set ``COLUMNS=80``, which hookax's tables follow; the tests of the width
set it themselves.
"""

import pytest


@pytest.fixture(autouse=True)
def _natural_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
