"""The README's first example as a reader uses it: pasted into a plain ``python3`` prompt (no
doctest prompts), it runs without an error and prints what its ``# output`` comments say."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_first_example_pastes_into_a_plain_prompt(capsys):
    check = runpy.run_path(str(ROOT / ".ci" / "readme_example.py"))
    assert check["main"](str(ROOT / "README.md")) == 0, capsys.readouterr().out


def test_expected_output_is_the_comment_after_a_print():
    check = runpy.run_path(str(ROOT / ".ci" / "readme_example.py"))
    code = "x = 1\nprint(x)\n# 1\n# still output\ny = 2  # not output\n# a remark\n"
    assert check["expected"](code) == ["1", "still output"]
