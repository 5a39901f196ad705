"""Test sessions on the two ends of the supported range, and the wheel as a user installs it.

    nox                     # newest (locked) + oldest + wheel: what `make test` runs
    nox -s newest           # the whole suite on requirements-dev.lock (the newest set, locked)
    nox -s oldest           # a representative subset on the lower bounds (constraints-oldest.txt)
    nox -s latest           # the whole suite on whatever the registry serves today (unlocked)
    nox -s wheel            # build the wheel, install it with each extra into a fresh venv, run it

Sessions reuse their virtualenvs (under .nox/) and install with uv when it is there, so a second
run spends its time in the tests, not in installing.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile

import nox

nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["newest", "oldest", "wheel"]

PYTHON = "3.11"
ENV = {
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8"),
    "UV_PYTHON_DOWNLOADS": "never",  # use the machine's Python; never fetch one
}
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

# The oldest set runs the tests that exercise what differs between versions: every framework
# adapter (conformance suite: NNX, Linen, Equinox), capture and activation gradients through the
# transforms, the summary, the CLI and the docs' recipes. The slow property/soak/thread files run
# on the newest set only. Measured: see README "Supported versions".
OLDEST_TESTS = [
    "tests/test_conformance.py",
    "tests/test_frameworks.py",
    "tests/test_capture.py",
    "tests/test_capture_grad.py",
    "tests/test_hooks_grad.py",
    "tests/test_intercept.py",
    "tests/test_summary.py",
    "tests/test_cli.py",
    "tests/test_packaging.py",
    "README.md",
    "docs/gradients.md",
]


# Fails unless every package pinned in the constraints file is installed at exactly that version.
_CHECK_PINS = """
import sys
from importlib.metadata import version
pins = [ln.split("==") for ln in open(sys.argv[1]) if "==" in ln and not ln.startswith("#")]
got = {name: version(name) for name, _ in pins}
bad = {name: (pin.strip(), got[name]) for name, pin in pins if got[name] != pin.strip()}
print("oldest set:", ", ".join(f"{n} {v}" for n, v in got.items()))
sys.exit(f"not the oldest set (wanted, got): {bad}" if bad else 0)
"""


@nox.session(python=PYTHON)
def newest(session: nox.Session) -> None:
    """The whole suite (tests, doctests of hookax/, docs/ and the README) on the locked set."""
    session.install("-r", "requirements-dev.lock")
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "pytest", "-q", *session.posargs, env=ENV)


@nox.session(python=PYTHON)
def oldest(session: nox.Session) -> None:
    """The representative subset on the lower bounds of every range in pyproject.toml.

    Old releases of Flax and Equinox use JAX APIs that newer JAX deprecates, so deprecation
    warnings are not errors here (they are on the newest set).
    """
    session.install("-c", "constraints-oldest.txt", "-e", ".[test]")
    session.run("python", "-c", _CHECK_PINS, "constraints-oldest.txt")
    args = session.posargs or OLDEST_TESTS
    session.run("python", "-m", "pytest", "-q", "-W", "ignore::DeprecationWarning", *args, env=ENV)


@nox.session(python=PYTHON)
def latest(session: nox.Session) -> None:
    """The whole suite on the newest releases, unlocked: run it before refreshing the lock."""
    session.install("--upgrade", "-e", ".[test]")
    session.run("python", "-m", "pytest", "-q", *session.posargs, env=ENV)


@nox.session(python=PYTHON, venv_backend="none")
def wheel(session: nox.Session) -> None:
    """Build the wheel; install it with only ``pip install "dist/hookax-*.whl[extra]"`` into a
    fresh venv per extra (nnx, equinox, all) and run what a user would run first."""
    out = tempfile.mkdtemp(prefix="hookax-wheel-")
    try:
        session.run(sys.executable, "-m", "uv", "build", "-q", "--wheel", "--out-dir", out)
        (whl,) = glob.glob(os.path.join(out, "hookax-*.whl"))
        session.run(sys.executable, ".ci/wheel_check.py", whl, out, env=ENV)
    finally:
        shutil.rmtree(out, ignore_errors=True)
