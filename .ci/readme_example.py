"""Paste a README's first Python example into a plain interactive interpreter, as a reader does.

``python .ci/readme_example.py README.md``: the block goes to ``python -i`` on its standard input,
line by line as a paste would; it passes when the interpreter reports no error and what the
example prints equals its ``# output`` comments (the comment lines right after a ``print``).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

PROMPTS = re.compile(r"(>>> |\.\.\. )+")


def first_example(readme: str) -> str:
    text = pathlib.Path(readme).read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]


def expected(code: str) -> list[str]:
    """The ``# output`` comment lines that follow a line calling ``print``."""
    out, after_print = [], False
    for line in code.splitlines():
        if after_print and line.startswith("# "):
            out.append(line[2:])
            continue
        after_print = "print(" in line
    return out


def main(readme: str) -> int:
    code = first_example(readme)
    assert ">>>" not in code, "the example keeps doctest prompts: a plain prompt refuses them"
    run = subprocess.run(
        [sys.executable, "-q", "-i"], input=code + "\n", capture_output=True, text=True
    )
    errors = PROMPTS.sub("", run.stderr).strip()
    printed = run.stdout.strip().splitlines()
    want = expected(code)
    ok = run.returncode == 0 and not errors and printed == want
    print("pasted:", "ok" if ok else f"FAILED\nprinted {printed}\nexpected {want}\n{errors}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
