"""Doctest set-up for the recipes: each page gets ``out_dir``, a fresh temporary folder."""

import pytest


@pytest.fixture(autouse=True)
def _out_dir(doctest_namespace: dict, tmp_path) -> None:
    doctest_namespace["out_dir"] = tmp_path
