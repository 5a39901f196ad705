"""The command's help as a reader at an 80-column terminal sees it, and the answer to a typo.

argparse wraps every help text at the terminal's width (``COLUMNS``), between words only; a
flag the subcommand does not know is answered with its usage and the nearest flag."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hookax._cli.main import _parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUBCOMMANDS = ["", "summary", "gradflow", "ops", "stats-plot", "profile", "harvest"]


def help_text(monkeypatch: pytest.MonkeyPatch, sub: str, columns: int) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    p = _parser()
    if not sub:
        return p.format_help()
    (subs,) = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
    return subs.choices[sub].format_help()


def words(text: str) -> set[str]:
    return set(text.split())


@pytest.mark.parametrize("sub", SUBCOMMANDS)
@pytest.mark.parametrize("columns", [60, 80, 120])
def test_help_fits_the_terminal_and_cuts_no_word(monkeypatch, sub, columns):
    text = help_text(monkeypatch, sub, columns)
    long = [line for line in text.splitlines() if len(line) > columns]
    assert long == [], f"hookax {sub} --help at COLUMNS={columns}: {long}"
    # every word is a word of the same help drawn with room for every line: none was cut
    whole = words(help_text(monkeypatch, sub, 10_000))
    assert words(text) <= whole, words(text) - whole


def test_help_paragraphs_use_the_width(monkeypatch):
    """Paragraphs are refilled at the terminal's width, not kept at a hand-wrapped width."""
    for columns in (80, 160):
        text = help_text(monkeypatch, "harvest", columns)
        safety = text[text.index("safety:") : text.index("what survives")]
        lines = [line for line in safety.splitlines()[1:] if line.strip()]
        assert all(line.startswith("  ") for line in lines)
        assert max(len(line) for line in lines) > columns - 16  # filled, not short
    assert len(help_text(monkeypatch, "harvest", 160).splitlines()) < len(
        help_text(monkeypatch, "harvest", 80).splitlines()
    )


def test_help_at_80_columns_from_the_command(tmp_path):
    """The installed command, as a terminal runs it."""
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": ROOT}
    for sub in ["summary", "harvest"]:
        run = subprocess.run(
            [sys.executable, "-m", "hookax", sub, "--help"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
            check=True,
        )
        assert max(len(line) for line in run.stdout.splitlines()) <= 80
        assert "usage: hookax " + sub in run.stdout


def test_a_typo_gets_the_nearest_flag_and_the_subcommands_usage(capsys):
    assert main(["summary", "--exmaple", "mlp"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith("usage: hookax summary [-h] [--example EXAMPLE]")
    assert lines[-1] == (
        "hookax: error: unrecognized arguments: --exmaple; did you mean --example? "
        "(see: hookax summary --help)"
    )


def test_a_flag_of_another_subcommand_names_them(capsys):
    assert main(["summary", "--example", "mlp", "--runs", "3"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "--runs is a flag of hookax profile, not of hookax summary" in last


def test_an_unknown_flag_far_from_any_gets_no_guess(capsys):
    assert main(["ops", "--example", "mlp", "--zzz"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hookax ops ")
    assert re.search(r"unrecognized arguments: --zzz \(see: hookax ops --help\)\n$", err)
    assert "did you mean" not in err
