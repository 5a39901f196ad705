"""Run the benchmarks: ``python -m benchmarks`` (all) or ``python -m benchmarks dispatch ...``.

``--json PATH`` also writes the figures of the run to ``PATH`` as ``{name: figures}``: a benchmark
whose ``main()`` returns a dict contributes it (the README's tables and any check read one run).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from typing import Any

import benchmarks


def main(argv: list[str]) -> None:
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        if i + 1 >= len(argv):
            sys.exit("python -m benchmarks: --json needs a PATH")
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2 :]
    names = argv or sorted(
        m.name.removeprefix("bench_")
        for m in pkgutil.iter_modules(benchmarks.__path__)
        if m.name.startswith("bench_")
    )
    figures: dict[str, Any] = {}
    for name in names:
        print(f"\n== {name} ==", flush=True)
        result = importlib.import_module(f"benchmarks.bench_{name}").main()
        if isinstance(result, dict):
            figures[name] = result
    if out is not None:
        with open(out, "w") as f:
            json.dump(figures, f, indent=2, default=float)
        print(f"\nfigures written to {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
