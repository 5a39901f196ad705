"""The import layers of the package: each sub-package imports only the ones below it, no circles.

Every ``import`` and ``from ... import`` in ``hookax/`` counts, also those inside functions (a
lazy import is still a dependency). Each sub-package's ``__init__.py`` docstring says the same in
words; ``docs/design.md`` draws it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hookax"

# Lowest first: each of these may import the ones before it.
STACK = ["_util", "_engine", "_transforms", "_hooks", "frameworks", "_capture"]
FEATURES = ["_summary", "_harvest", "_patching"]  # side by side: none imports another
# A part may import itself and the parts listed for it, nothing else of hookax.
LAYERS: dict[str, set[str]] = {part: set(STACK[:i]) for i, part in enumerate(STACK)}
LAYERS |= {part: set(STACK) for part in FEATURES}
LAYERS["_diagnostics"] = {*STACK, *FEATURES}
LAYERS["_interp"] = {*STACK, "_patching"}  # TransformerLens' conveniences, on patching
LAYERS["_circuits"] = {*STACK, "_patching", "_interp"}  # edges of TransformerLens' components
LAYERS["_cli"] = {*STACK, *FEATURES, "_diagnostics", "examples"}
# The example models import nothing of hookax; the induction example also finds its circuit.
LAYERS["examples"] = {*STACK, "_patching", "_interp", "_circuits"}
# The public facade: hookax/__init__.py and __main__.py import anything; nothing imports them.
FACADE = {"hookax", "hookax.__main__"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, text: str | None = None) -> set[str]:
    """The hookax modules ``path`` imports (a name imported from a package counts as its module
    when it is one); ``text`` stands for the file's contents when given."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "hookax"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] != "hookax":
                continue
            for a in node.names:
                sub = f"{src}.{a.name}"
                out.add(sub if _exists(sub) else src)
    return out


def _exists(mod: str) -> bool:
    p = PACKAGE.parent.joinpath(*mod.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = sorted(root.rglob("*.py"))
    return {_module(p): _imports(p) for p in files}


def _part(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and mod not in FACADE else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        part = _part(mod)
        if part is None:
            continue
        if part not in LAYERS:
            bad.append(f"{mod}: its part {part!r} has no entry in LAYERS")
            continue
        for dep in sorted(deps):
            if dep in FACADE:
                bad.append(f"{mod} imports the public facade {dep}")
                continue
            target = _part(dep)
            if target is not None and target != part and target not in LAYERS[part]:
                bad.append(f"{mod} imports {dep}: {part} may import only {sorted(LAYERS[part])}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_part_imports_only_the_layers_below_it():
    assert layer_violations(_graph()) == []


def test_no_import_circles():
    graph = {m: d for m, d in _graph().items() if m not in FACADE}
    assert cycles(graph) == []


def test_every_part_has_a_docstring_saying_what_it_owns_and_may_import():
    for part in set(LAYERS) - {"examples"}:
        doc = ast.get_docstring(ast.parse((PACKAGE / part / "__init__.py").read_text()))
        assert doc and "May import" in doc, part


@pytest.mark.parametrize(
    "where, line, message",
    [
        ("_engine/select.py", "from .._hooks import intercept", "_engine may import only"),
        ("_util/errors.py", "from .._engine import context", "_util may import only"),
        ("_capture/ops.py", "import hookax", "imports the public facade"),
        ("_hooks/grad.py", "from ..frameworks import _nnx", "_hooks may import only"),
    ],
)
def test_a_forbidden_import_is_reported(where, line, message):
    graph = _graph()
    path = PACKAGE / where
    text = path.read_text() + "\n\ndef _added():\n    " + line.strip() + "\n"
    graph[_module(path)] = _imports(path, text)
    assert any(message in v for v in layer_violations(graph)), layer_violations(graph)


def test_a_circle_is_reported():
    graph = _graph()
    graph["hookax._util.errors"] = graph["hookax._util.errors"] | {"hookax._util.fnkey"}
    graph["hookax._util.fnkey"] = graph["hookax._util.fnkey"] | {"hookax._util.errors"}
    assert ["hookax._util.errors", "hookax._util.fnkey"] in cycles(graph)
