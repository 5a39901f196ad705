"""Test sessions on the two ends of the supported range, and the wheel as a user installs it.

    nox                     # newest (locked) + oldest + wheel: what CI (.ci/run) runs
    nox -s newest           # the whole suite on requirements-dev.lock (the newest set, locked)
    nox -s oldest           # a representative subset on the lower bounds (constraints-oldest.txt)
    nox -s latest           # the whole suite on today's releases, unlocked (Python 3.11 and 3.12)
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
nox.options.sessions = ["newest", "oldest", "slow", "oldest-slow", "wheel"]

PYTHON = "3.11"
ENV = {
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8"),
    "UV_PYTHON_DOWNLOADS": "never",  # use the machine's Python; never fetch one
}
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

# The oldest set runs the tests that exercise what differs between versions: every framework
# adapter (the conformance suite on NNX, Linen and Equinox; paths through their transforms),
# capture and activation gradients through the transforms (the per-primitive rules), summary and
# its FLOPs, harvest's TensorStore, the public namespace and extras, and the README (whose
# operations example runs Flax's attention path; tests/test_ops.py passed on the oldest set by
# hand: 26 passed, 1 skipped, and stays out to keep `make test` short). The rest
# (property, memory, thread and sharding soaks, the CLI's subprocess runs, the recipes) runs on
# the newest set only. Run everything on the oldest set with `nox -s oldest -- tests hookax docs
# README.md -k "not (nnx_capture or perturb)"`: the five tests left out compare with
# `nnx.capture`, which Flax 0.12.5 does not have yet.
OLDEST_TESTS = [
    "tests/test_conformance.py",
    "tests/test_frameworks.py",
    "tests/test_capture.py",
    "tests/test_capture_grad.py",
    "tests/test_transforms.py",
    "tests/test_summary.py",
    "tests/test_harvest.py",
    "tests/test_packaging.py",
    "README.md",
]
# nnx.capture, the reference these compare with, is new in Flax 0.12.6
# Two pytest workers: the suite is mostly single-threaded tracing, and CI has two cores.
WORKERS = ["-n", os.environ.get("HOOKAX_TEST_WORKERS", "2")]
OLDEST_DESELECT = "not (test_parity_with_nnx_capture or test_equals_perturb)"


@nox.session(python=PYTHON)
def newest(session: nox.Session) -> None:
    """The whole suite (tests, doctests of hookax/, docs/ and the README) on the locked set."""
    session.install("-r", "requirements-dev.lock")
    session.install("--no-deps", "-e", ".")
    args = session.posargs or ["-m", "not slow"]
    session.run("python", "-m", "pytest", "-q", *WORKERS, *args, env=ENV)


@nox.session(python=PYTHON)
def slow(session: nox.Session) -> None:
    """The tests marked ``slow`` (soaks, subprocess and signal runs), on the locked newest set."""
    session.install("-r", "requirements-dev.lock")
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "pytest", "-q", *WORKERS, "-m", "slow", *session.posargs, env=ENV)


@nox.session(python=PYTHON)
def oldest(session: nox.Session) -> None:
    """The representative subset on the lower bounds of every range in pyproject.toml.

    Old releases of Flax and Equinox use JAX APIs that newer JAX deprecates, so deprecation
    warnings are not errors here (they are on the newest set).
    """
    session.install("-c", "constraints-oldest.txt", "-e", ".[test]")
    session.run("python", ".ci/check_pins.py", "constraints-oldest.txt")
    args = session.posargs or [*OLDEST_TESTS, "-k", OLDEST_DESELECT, "-m", "not slow"]
    warnings = ["-W", "ignore::DeprecationWarning"]
    session.run("python", "-m", "pytest", "-q", *WORKERS, *warnings, *args, env=ENV)


@nox.session(python=PYTHON, name="oldest-slow")
def oldest_slow(session: nox.Session) -> None:
    """The oldest set's tests marked ``slow`` (CI runs them after ``make test``, so the oldest
    set checks everything it did before tests moved to the ``slow`` marker)."""
    session.install("-c", "constraints-oldest.txt", "-e", ".[test]")
    args = session.posargs or [*OLDEST_TESTS, "-k", OLDEST_DESELECT, "-m", "slow"]
    warnings = ["-W", "ignore::DeprecationWarning"]
    session.run("python", "-m", "pytest", "-q", *WORKERS, *warnings, *args, env=ENV)


@nox.session(python=[PYTHON, "3.12"])
def latest(session: nox.Session) -> None:
    """The whole suite on the newest releases, unlocked: run it before refreshing the lock.

    On Python 3.12 the registry serves newer JAX and Flax than on 3.11 (JAX 0.12 dropped 3.11).
    """
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
