"""Doctest set-up for the recipes.

Each page runs with JAX's default settings, as a reader's session would (the test suite's own
conftest turns on strict dtype promotion, which optax and ``jax.nn.dot_product_attention`` in
bfloat16 do not support). A page defines every name it uses (a folder for the files it writes
included): ``tests/test_docs_pages.py`` runs each page as one script in a fresh interpreter.
Tables print at 88 columns (``COLUMNS=88``), the width of the site's code blocks, as they would
in a terminal that wide; piped, without ``COLUMNS``, a table takes its natural width.
"""

from collections.abc import Iterator

import jax
import pytest

# The griffe extension and the hook that mkdocs.yml loads hold no examples (and need the docs
# extra).
collect_ignore = ["griffe_defaults.py", "cli_help.py"]


@pytest.fixture(autouse=True)
def _reader_session(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("COLUMNS", "88")
    with jax.numpy_dtype_promotion("standard"):
        yield
