"""Fail unless every package pinned in a constraints file is installed at exactly that version.

python .ci/check_pins.py constraints-oldest.txt
"""

import pathlib
import sys
from importlib.metadata import version

lines = pathlib.Path(sys.argv[1]).read_text().splitlines()
pins = [ln.split("==") for ln in lines if "==" in ln and not ln.startswith("#")]
got = {name: version(name) for name, _ in pins}
bad = {name: (pin, got[name]) for name, pin in pins if got[name] != pin}
print("installed:", ", ".join(f"{n} {v}" for n, v in got.items()))
sys.exit(f"not the pinned set (wanted, got): {bad}" if bad else 0)
