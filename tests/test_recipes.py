"""The recipes in docs/: every page is listed in the index, and every code block on it runs.

The pages themselves run as doctests (pytest's ``--doctest-glob='*.md'`` over ``docs/``); these
tests guard what a doctest run cannot see: a page missing from the index, a broken link, or a
code block without ``>>>`` prompts, which doctest would silently skip.
"""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)#]+\.md)\)")
# Pages that also show shell commands (```bash) or printed results (```text): the install and
# benchmark commands, which the test suite does not run (the benchmarks run with `make bench`).
SHOWN_ONLY = {
    "benchmarks.md",
    "circuits.md",  # the full induction model's printout (`python -m hookax.examples.induction`)
    "from_transformer_lens.md",
    "getting-started.md",
    "models.md",  # its examples need the codebases: tests/models/test_models_page.py runs them
    "programs.md",  # jax-llm-examples' code is not on the registry: shown, its own model runs
    "tour.md",
}


def test_index_lists_every_page_once_and_links_resolve() -> None:
    index = (DOCS / "index.md").read_text()
    linked = [p for p in LINK.findall(index) if not p.startswith("reference/")]
    assert sorted(linked) == PAGES


@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_is_a_doctest(page: str) -> None:
    text = (DOCS / page).read_text()
    blocks = BLOCK.findall(text)
    assert blocks, f"{page} has no code block"
    assert any(lang == "python" for lang, _ in blocks) or page in SHOWN_ONLY, page
    for lang, body in blocks:
        if lang in ("bash", "text") and page in SHOWN_ONLY:
            continue  # shell commands and printed results, named so (never run)
        assert lang == "python", f"{page}: a ```{lang} block is not executed; use ```python"
        assert body.lstrip().startswith(">>> "), f"{page}: a block without >>> is not executed"
        # A block must end with a blank line so doctest stops comparing before the fence.
        assert body.endswith("\n\n"), f"{page}: end each block with a blank line before ```"
    for target in LINK.findall(text):
        assert (DOCS / target).is_file(), f"{page} links to missing {target}"
