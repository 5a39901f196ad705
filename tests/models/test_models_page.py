"""The examples of ``docs/models.md``, each run where its codebase is installed.

The page shows them as text (the site's doctests run without these codebases); each block
follows a ``<!-- models-example: NAME -->`` line and ends with the shape of the grid it makes.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import jax
import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"
BLOCK = re.compile(r"<!-- models-example: (\w+) -->\n```text\n(.*?)^```", re.S | re.M)
NEEDS = {
    "gemma": ("gemma",),
    "easydel": ("easydel",),
    "maxtext": ("maxtext",),
    "alphafold": ("alphafold",),
}


def examples() -> list:
    return [pytest.param(code, name, id=name) for name, code in BLOCK.findall(PAGE.read_text())]


def test_the_page_has_an_example_per_codebase() -> None:
    assert sorted(name for name, _ in BLOCK.findall(PAGE.read_text())) == sorted(NEEDS)


@pytest.mark.parametrize(("code", "name"), examples())
def test_example_runs_and_makes_the_grid_it_shows(code: str, name: str) -> None:
    for module in NEEDS[name]:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    os.environ.setdefault("EASYDEL_AUTO", "0")
    shape = re.search(r"^grid\.shape\s+# (\(.*\))", code, re.M)
    assert shape is not None, "the example ends with the grid's shape"
    scope: dict = {}
    with jax.numpy_dtype_promotion("standard"):  # gemma mixes Python floats and ints
        exec(compile(code, f"docs/models.md ({name})", "exec"), scope)
    assert str(tuple(scope["grid"].shape)) == shape.group(1)
