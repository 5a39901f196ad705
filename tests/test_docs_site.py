"""The documentation site as a reader sees it: built strictly, then read back as HTML.

`mkdocs build --strict` fails on a broken link or a cross-reference that resolves nowhere; these
tests check what a clean build can still get wrong: docstring examples shown as run-together text
instead of code blocks, Sphinx roles (``:func:``) printed as they are, a private sentinel in a
signature, a page left out of the navigation, and images that are not in the site.
"""

import doctest
import html
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hookax

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings_handlers.python")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
HIGHLIGHT = re.compile(r'<div class="highlight">(.*?)</div>', re.S)
TAG = re.compile(r"<[^>]+>")
ROLE = re.compile(r":(func|class|meth|mod|data|attr|exc|obj):(<code>|`)")
CODE = re.compile(r"<code[^>]*>(.*)</code>", re.S)
IMG = re.compile(r"<img\b[^>]*\bsrc=\"([^\"]+)\"")
DOCTEST_FLAGS = re.compile(r"\s*#\s*doctest:.*$")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr}"
    assert "WARNING" not in run.stderr, run.stderr
    return out


def text(fragment: str) -> str:
    return html.unescape(TAG.sub("", fragment))


def public_docstrings() -> dict[str, str]:
    """The docstrings the API page renders: each name it lists and those classes' public members."""
    names = re.findall(r"^::: hookax\.(\w+)$", (DOCS / "reference/api.md").read_text(), re.M)
    docs = {}
    for name in names:
        obj = getattr(hookax, name)
        docs[name] = inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                own = isinstance(value, (property, classmethod, staticmethod))
                if (own or inspect.isfunction(value)) and not member.startswith("_"):
                    docs[f"{name}.{member}"] = inspect.getdoc(value) or ""
    return docs


def test_api_page_shows_every_docstring_example_as_a_code_block(site: Path) -> None:
    page = (site / "reference/api/index.html").read_text()
    code = "\n".join(text(block) for block in HIGHLIGHT.findall(page))
    with_examples = {k: d for k, d in public_docstrings().items() if ">>> " in d}
    assert {"intercept", "capture", "summary", "harvest"} <= set(with_examples)
    for name, doc in with_examples.items():
        for line in doc.splitlines():
            line = DOCTEST_FLAGS.sub("", line.strip())
            if line.startswith((">>> ", "... ")):
                assert line in code, f"hookax.{name}: {line!r} is not inside a code block"
    # No prompt anywhere on the page outside a code block (a blockquote of run-together text).
    assert "&gt;&gt;&gt;" not in HIGHLIGHT.sub("", page)


def test_api_page_example_of_intercept_is_highlighted_code(site: Path) -> None:
    page = (site / "reference/api/index.html").read_text()
    section = page[page.index('id="hookax.intercept"') : page.index('id="hookax.Interceptor"')]
    blocks = HIGHLIGHT.findall(section)
    assert len(blocks) == 1 and "<code" in blocks[0]
    assert "with hx.intercept(show):" in text(blocks[0])
    assert "Linear __call__ (4, 3)" in text(blocks[0])


def test_no_raw_sphinx_roles_or_private_defaults(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 10
    for page in pages:
        assert not ROLE.search(page.read_text()), f"{page.relative_to(site)} shows a Sphinx role"
    api = text((site / "reference/api/index.html").read_text())
    assert "_DEFAULT" not in api
    assert "where: Any = ...," in api


def test_every_page_is_in_the_navigation(site: Path) -> None:
    index = (site / "index.html").read_text()
    nav = set(re.findall(r'href="([^"]*)" class="md-nav__link', index))
    for md in sorted(DOCS.rglob("*.md")):
        rel = md.relative_to(DOCS).with_suffix("")
        url = "." if rel.name == "index" else f"{rel.as_posix()}/"
        assert url in nav, f"docs/{md.relative_to(DOCS)} is not in mkdocs.yml's nav"


def test_every_image_a_page_shows_is_in_the_site(site: Path) -> None:
    shown = set()
    for page in site.rglob("*.html"):
        for src in IMG.findall(page.read_text()):
            assert not re.match(r"[a-z]+:", src), f"{page.relative_to(site)}: remote image {src}"
            target = (page.parent / html.unescape(src)).resolve()
            assert target.is_file(), f"{page.relative_to(site)}: <img src={src!r}> is missing"
            shown.add(target.relative_to(site.resolve()).as_posix())
    assert {"images/attention.png", "images/sae.png", "images/layers.svg"} <= shown


def test_copy_button_copies_doctests_as_runnable_code(site: Path) -> None:
    """docs/javascripts/copy.js (run by node) turns each doctest block into its code alone."""
    for page in site.rglob("*.html"):
        assert "javascripts/copy.js" in page.read_text(), f"{page.relative_to(site)}: no copy.js"
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    blocks = [
        text(CODE.search(block)[1])
        for page in sorted(site.rglob("*.html"))
        for block in HIGHLIGHT.findall(page.read_text())
        if CODE.search(block)
    ]
    script = (
        f"const {{promptFree}} = require({json.dumps(str(DOCS / 'javascripts/copy.js'))});"
        "const blocks = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "console.log(JSON.stringify(blocks.map(promptFree)));"
    )
    run = subprocess.run(
        [node, "-e", script], input=json.dumps(blocks), capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    copied = json.loads(run.stdout)
    doctests = 0
    for block, code in zip(blocks, copied, strict=True):
        if not block.startswith(">>>"):
            assert code is None  # copied as shown
            continue
        doctests += 1
        compile(code, "copied block", "exec")  # pastes as Python
        examples = doctest.DocTestParser().get_examples(block)
        want = [line for e in examples for line in e.source.splitlines() if line.strip()]
        assert [line for line in code.splitlines() if line.strip()] == want
    assert doctests > 100


def test_home_page_says_what_hookax_is_how_to_install_and_shows_it(site: Path) -> None:
    index = (site / "index.html").read_text()
    body = index[index.index('<h1 id="hookax">') : index.index('<h2 id="recipes">')]
    assert "PyTorch-style hooks" in text(body)
    blocks = [text(block) for block in HIGHLIGHT.findall(body)]
    assert blocks[0].strip() == 'pip install "hookax[nnx]"'
    assert blocks[1].startswith(">>> import") and "hx.capture" in blocks[1]
    assert IMG.findall(body) == ["images/attention.png"]
