"""The project's files speak of the project: not of how, when or by whom it was built.

Words about the work that made them (who did it, in which sitting, which ticket) belong to the
history (CHANGELOG.md keeps it), not to the README, the docs, the docstrings or the tests that a
reader of the project reads. ``WORDS`` lists them; the examples below are assembled from parts
so that this file does not contain them either."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORDS = re.compile(
    r"\b(?:this|previous|earlier|these)[ ]sessions?\b"
    r"|\bnone[ ]was[ ]lent\b"
    r"|\bother[ ]agents\b"
    r"|\bissue[ ]#?\d+"
    r'|\bissues?[ ]"[A-Z]'
    r"|\bno[ ]GPU[ ]run[ ]yet\b",
    re.I,
)
TEXT = {".md", ".py", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".ipynb", ".js", ""}


def project_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed if Path(name).suffix in TEXT]


def test_no_file_speaks_of_how_it_was_made():
    files = project_files()
    assert any(f.name == "README.md" for f in files) and len(files) > 50
    found = []
    for path in files:
        if path.name == "CHANGELOG.md" or path == Path(__file__) or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if WORDS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "Targets on this CPU (" + "issue" + " 30): grid",
        "No GPU run yet (" + "none was" + " lent).",
        "(other " + "agents share the 2 cores)",
        "The reader in earlier " + "sessions: warm",
        "Before the scan cut (this " + "session)",
        "notebook (" + "issue" + ' "The first hour"): a',
    ],
)
def test_the_words_are_recognised(line):
    assert WORDS.search(line)


def test_the_technical_word_session_is_not_one_of_them():
    assert not WORDS.search("Mark what this capture session carries; the session's records")
