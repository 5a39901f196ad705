"""Doctest set-up for the recipes.

Each page runs with JAX's default settings, as a reader's session would (the test suite's own
conftest turns on strict dtype promotion, which optax and ``jax.nn.dot_product_attention`` in
bfloat16 do not support), and gets ``out_dir``, a fresh temporary folder for the files it writes.
"""

from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

# The griffe extension and the hook that mkdocs.yml loads hold no examples (and need the docs
# extra).
collect_ignore = ["griffe_defaults.py", "cli_help.py"]


@pytest.fixture(autouse=True)
def _reader_session(doctest_namespace: dict, tmp_path: Path) -> Iterator[None]:
    doctest_namespace["out_dir"] = tmp_path
    with jax.numpy_dtype_promotion("standard"):
        yield
