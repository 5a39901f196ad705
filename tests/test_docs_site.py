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


API_PAGES = sorted(p for p in (DOCS / "reference").glob("*.md") if "::: hookax." in p.read_text())


def api_names(page: Path) -> list[str]:
    return re.findall(r"^::: hookax\.(\w+)$", page.read_text(), re.M)


def public_docstrings() -> dict[str, str]:
    """The docstrings the API pages render: each name they list and those classes' public
    members."""
    names = [name for page in API_PAGES for name in api_names(page)]
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


def api_html(site: Path) -> str:
    return "\n".join((site / f"reference/{p.stem}.html").read_text() for p in API_PAGES)


def test_api_page_shows_every_docstring_example_as_a_code_block(site: Path) -> None:
    page = api_html(site)
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
    page = (site / "reference/interceptors.html").read_text()
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
    api = text(api_html(site))
    assert "_DEFAULT" not in api
    assert "where: Where = ...," in api and "where: Any" not in api


def test_every_page_is_in_the_navigation(site: Path) -> None:
    index = (site / "index.html").read_text()
    nav = set(re.findall(r'href="([^"]*)" class="md-nav__link', index))
    for md in sorted(DOCS.rglob("*.md")):
        rel = md.relative_to(DOCS).with_suffix("")
        url = f"{rel.as_posix()}.html"  # use_directory_urls: false (opens from disk)
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
    assert "images/tl_block_every.png" in shown  # the TransformerLens page draws its sweep


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
    assert blocks[0].startswith('pip install ".[nnx]"')  # from a checkout: works today
    assert "make dist" in text(body) and "getting-started.html" in body
    assert blocks[1].startswith(">>> import") and "hx.capture" in blocks[1]
    assert IMG.findall(body) == ["images/attention.png"]


def test_api_reference_is_one_page_per_concept_with_a_table_first(site: Path) -> None:
    stems = {p.stem for p in API_PAGES}
    concepts = {"hooks", "interceptors", "capture", "operations", "patching", "statistics"}
    assert concepts | {"harvest", "summary"} <= stems and len(stems) >= 8
    listed = [name for page in API_PAGES for name in api_names(page)]
    assert sorted(listed) == sorted(hookax.__all__)  # every public name, once
    for page in API_PAGES:
        head = page.read_text().split("::: hookax.", 1)[0]
        table = re.findall(r"^\| \[`hx\.(\w+)`\]\(#hookax\.\w+\) \| .+ \|$", head, re.M)
        assert table == api_names(page), f"{page.name}: the table lists {table}"
        built = (site / f"reference/{page.stem}.html").read_text()
        first = built.index("<table>")
        assert first < built.index('class="doc doc-heading"'), page.name
        for name in table:  # each row links to its entry
            assert f'href="#hookax.{name}"' in built and f'id="hookax.{name}"' in built
    index = (DOCS / "reference/index.md").read_text()
    for page in [*API_PAGES, DOCS / "reference/cli.md"]:
        assert f"]({page.name})" in index, f"reference/index.md does not link {page.name}"


def test_cli_page_shows_the_commands_own_help(site: Path) -> None:
    page = text((site / "reference/cli.html").read_text())
    for sub in ["summary", "ops", "gradflow", "stats-plot", "profile", "harvest"]:
        assert f"usage: hookax {sub} [-h]" in page
    assert "did you mean" not in page and "<!-- hookax-help" not in page
    assert "what survives an interruption:" in page


def code_lines(site: Path) -> dict[str, list[str]]:
    out = {}
    for page in sorted(site.rglob("*.html")):
        lines = [
            line
            for block in HIGHLIGHT.findall(page.read_text())
            for line in text(block).splitlines()
        ]
        out[page.relative_to(site).as_posix()] = lines
    return out


def test_no_code_line_is_wider_than_88_columns(site: Path) -> None:
    """A code block wider than the page's column is cut and needs sideways scrolling: no line
    of any page's code blocks (recipes, printed tables, docstring examples) is over 88."""
    wide = {
        page: [line for line in lines if len(line) > 88] for page, lines in code_lines(site).items()
    }
    over = {page: lines for page, lines in wide.items() if lines}
    assert over == {}, "\n".join(f"{p}: {len(v)} lines, {v[0]!r}" for p, v in over.items())
    assert len(wide) > 10


def test_getting_started_benchmarks_and_the_light_dark_toggle(site: Path) -> None:
    index = (site / "index.html").read_text()
    nav = re.findall(r'href="([^"]*)" class="md-nav__link', index)
    assert {"getting-started.html", "tour.html", "benchmarks.html", "reference/index.html"} <= set(
        nav
    )
    started = text((site / "getting-started.html").read_text())
    assert 'pip install ".[nnx]"' in started and "hx.capture" in started
    assert "hx.register_forward_hook" in started and "hx.show" in started
    # the light/dark toggle: two palettes, each with the switch to the other
    assert index.count('data-md-color-scheme="default"') + index.count("slate") >= 2
    assert "Switch to the dark theme" in index and "Switch to the light theme" in index


HREF = re.compile(r'\b(?:href|src)="([^"#?]+)[^"]*"')


def test_every_link_opens_from_disk(site: Path) -> None:
    """Opened as files (site/index.html in a browser, no server), every relative link of every
    page names a file, never a folder (a browser shows a folder as a listing)."""
    broken = []
    for page in site.rglob("*.html"):
        for link in HREF.findall(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", link) or link.startswith(("/", "//")):
                continue  # another site, data:, mailto:
            target = (page.parent / html.unescape(link)).resolve()
            if not target.is_file():
                broken.append(f"{page.relative_to(site)} -> {link}")
    assert not broken, "\n".join(broken[:20])


def test_code_blocks_fit_88_columns_or_wrap(site: Path) -> None:
    """The stylesheet that fits 88 columns of code at 1280 px (the width of every code line:
    test_no_code_line_is_wider_than_88_columns) and wraps a longer line rather than cutting it
    is in the site."""
    assert 'href="stylesheets/extra.css"' in (site / "index.html").read_text()
    css = (site / "stylesheets" / "extra.css").read_text()
    assert "white-space: pre-wrap" in css and "font-size: 0.74em" in css
