"""Test sessions on the two ends of the supported range, and the wheel as a user installs it.

    nox                     # newest (locked) + oldest + wheel: what CI (.ci/run) runs
    nox -s newest           # the whole suite on the newest set, locked (requirements-dev.lock)
    nox -s oldest           # a representative subset on the lower bounds (constraints-oldest.txt)
    nox -s py312            # the whole suite, the slow tests and the docs on Python 3.12's lock
    nox -s py313            # what reads Python's own machinery, on Python 3.13's lock
    nox -s latest           # today's releases, unlocked (Python 3.12): the suite where they
                            # differ from 3.12's lock
    nox -s wheel            # build the wheel, install it with each extra into a fresh venv, run it
    nox -s compat           # the frameworks' own suites with hookax imported (Python 3.11, 3.12)
    nox -s parity           # hookax against TransformerLens 3.9 on the same weights (torch, CPU)
    nox -s parity -- report # its agreement table and warm timings side by side, as Markdown
    nox -s parity_bridge    # hookax against TransformerLens 4's TransformerBridge (a tiny GPT-2)
    nox -s parity_circuits  # EAP and induction scores against auto-circuit and TransformerLens 2
    nox -s models           # tests/models/: gemma, EasyDeL, MaxText, AlphaFold

Each Python has its lock (``make lock`` refreshes all three): ``requirements-dev.lock`` (3.11,
the lowest supported Python, where the registry's newest JAX is 0.10), and
``requirements-dev-py312.lock`` / ``requirements-dev-py313.lock`` (JAX 0.12 needs Python >= 3.12).

``newest``, ``slow`` and ``oldest`` run on Python 3.11, or on the Python that ``HOOKAX_PYTHON``
names (``3.12``; ``make PYTHON=python3.12 test`` sets it), with that Python's lock; the oldest
set has no Python 3.13 wheels, so on 3.13 ``oldest`` runs on 3.11 and says so.

Sessions reuse their virtualenvs (under .nox/) and install with uv when it is there, so a second
run spends its time in the tests, not in installing.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import nox

nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["newest", "oldest", "slow", "oldest-slow", "wheel"]

LOCKS = {
    "3.11": "requirements-dev.lock",
    "3.12": "requirements-dev-py312.lock",
    "3.13": "requirements-dev-py313.lock",
}
# The Python of the sessions that do not name one: 3.11, the lowest supported.
BASE = "3.11"
# The Python of `make test`'s sessions (newest, oldest, slow): the Makefile's PYTHON, as X.Y in
# HOOKAX_PYTHON (`make PYTHON=python3.12 test`), else 3.11. Each installs its Python's lock.
PYTHON = os.environ.get("HOOKAX_PYTHON") or BASE
if PYTHON not in LOCKS:
    raise SystemExit(
        f"noxfile.py: HOOKAX_PYTHON={PYTHON!r}; the development sets are locked for Python "
        f"{', '.join(LOCKS)}. Fix: HOOKAX_PYTHON=3.11 (or make PYTHON=python3.11)."
    )
# The oldest set (matplotlib 3.9.0, tensorstore 0.1.62, ...) has no Python 3.13 wheels: on 3.13
# the oldest sessions run on 3.11.
OLDEST_PYTHON = PYTHON if PYTHON in ("3.11", "3.12") else BASE


def _pyenv_pythons() -> None:
    """Make every installed Python 3.11-3.13 reachable as ``python3.X`` where pyenv manages them.

    pyenv's shims run only the versions ``PYENV_VERSION`` (or ``pyenv global``) names, so on a
    machine whose global version is 3.11, ``python3.12`` fails although 3.12 is installed. The
    global version stays first (``python3`` is unchanged); a ``PYENV_VERSION`` already set wins.
    """
    if "PYENV_VERSION" in os.environ or shutil.which("pyenv") is None:
        return
    try:
        first = subprocess.run(
            ["pyenv", "global"], capture_output=True, text=True, check=True
        ).stdout.split()
        bare = subprocess.run(
            ["pyenv", "versions", "--bare"], capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return
    found = [v for v in bare if re.fullmatch(r"3\.1[123]\.\d+", v)]
    found.sort(key=lambda v: tuple(map(int, v.split("."))))
    newest = {v.rsplit(".", 1)[0]: v for v in found}  # the highest patch of each minor
    names = [*first, *(v for v in newest.values() if v not in first)]
    os.environ["PYENV_VERSION"] = ":".join(names)


_pyenv_pythons()
ENV = {
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8"),
    "UV_PYTHON_DOWNLOADS": "never",  # use the machine's Python; never fetch one
}
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

# The oldest set runs the tests that exercise what differs between versions: every framework
# adapter (the conformance suite on NNX, Linen and Equinox; paths through their transforms),
# capture and activation gradients through the transforms (the per-primitive rules), summary and
# its FLOPs, harvest's TensorStore, the public namespace and extras, and the README's first
# example pasted into a plain prompt (tests/test_ops.py passed on the oldest set by hand: 26
# passed, 1 skipped, and stays out to keep `make test` short). The rest
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
    "tests/test_readme.py",
]
# nnx.capture, the reference these compare with, is new in Flax 0.12.6
# Two pytest workers: the suite is mostly single-threaded tracing, and CI has two cores.
WORKERS = ["-n", os.environ.get("HOOKAX_TEST_WORKERS", "2")]
OLDEST_DESELECT = "not (test_parity_with_nnx_capture or test_equals_perturb)"


@nox.session(python=PYTHON)
def newest(session: nox.Session) -> None:
    """The whole suite (tests, doctests of hookax/, docs/ and the README) on the locked set."""
    _locked(session)
    args = session.posargs or ["-m", "not slow"]
    session.run("python", "-m", "pytest", "-q", *WORKERS, *args, env=ENV)


@nox.session(python=PYTHON)
def slow(session: nox.Session) -> None:
    """The tests marked ``slow`` (soaks, subprocess and signal runs), on the locked newest set."""
    _locked(session)
    session.run("python", "-m", "pytest", "-q", *WORKERS, "-m", "slow", *session.posargs, env=ENV)


@nox.session(python=OLDEST_PYTHON)
def oldest(session: nox.Session) -> None:
    """The representative subset on the lower bounds of every range in pyproject.toml.

    Old releases of Flax and Equinox use JAX APIs that newer JAX deprecates, so deprecation
    warnings are not errors here (they are on the newest set).
    """
    _oldest_python(session)
    session.install("-c", "constraints-oldest.txt", "-e", ".[test]")
    session.run("python", ".ci/check_pins.py", "constraints-oldest.txt")
    args = session.posargs or [*OLDEST_TESTS, "-k", OLDEST_DESELECT, "-m", "not slow"]
    warnings = ["-W", "ignore::DeprecationWarning"]
    session.run("python", "-m", "pytest", "-q", *WORKERS, *warnings, *args, env=ENV)


@nox.session(python=OLDEST_PYTHON, name="oldest-slow")
def oldest_slow(session: nox.Session) -> None:
    """The oldest set's tests marked ``slow`` (CI runs them after ``make test``, so the oldest
    set checks everything it did before tests moved to the ``slow`` marker)."""
    _oldest_python(session)
    session.install("-c", "constraints-oldest.txt", "-e", ".[test]")
    args = session.posargs or [*OLDEST_TESTS, "-k", OLDEST_DESELECT, "-m", "slow"]
    warnings = ["-W", "ignore::DeprecationWarning"]
    session.run("python", "-m", "pytest", "-q", *WORKERS, *warnings, *args, env=ENV)


def _oldest_python(session: nox.Session) -> None:
    if OLDEST_PYTHON != PYTHON:
        session.log(
            f"the oldest set has no Python {PYTHON} wheels (matplotlib 3.9.0, tensorstore "
            f"0.1.62): it runs on Python {OLDEST_PYTHON}"
        )


# Python 3.12's run of the slow tests: those whose outcome depends on the JAX release beyond
# what the suite's faster variants check there (each slow test of tests/ has a faster variant
# in the suite: another framework or mode): every page's examples (the docs' doctests), Haiku's
# own behaviours, a Llama written the jax-llm-examples way, the induction model trained and its
# circuit found. The rest of the slow set (the machine and the interpreter: pages pasted into a
# fresh interpreter, child processes, signals, pickling, memory soaks; and the slower variants)
# runs on Python 3.11 (``slow``).
SLOW_ON_312 = [
    "docs",
    "tests/test_haiku.py",
    "tests/models/test_model_jaxllm_like.py",
    "tests/test_induction.py",
]


def _locked(session: nox.Session) -> None:
    """Install the lock of the session's Python and hookax (editable, no dependencies)."""
    session.install("-r", LOCKS[str(session.python)])
    session.install("--no-deps", "-e", ".")


@nox.session(python="3.12")
def py312(session: nox.Session) -> None:
    """Python 3.12 with its lock (the newest JAX, Flax and Equinox): the whole suite, the tests
    marked ``slow`` that depend on the JAX release (``SLOW_ON_312``), and the docs site, strict."""
    _locked(session)
    if session.posargs:
        session.run("python", "-m", "pytest", "-q", *WORKERS, *session.posargs, env=ENV)
        return
    session.run("python", "-m", "pytest", "-q", *WORKERS, "-m", "not slow", env=ENV)
    session.run("python", "-m", "pytest", "-q", *WORKERS, "-m", "slow", *SLOW_ON_312, env=ENV)
    site = tempfile.mkdtemp(prefix="hookax-site-")
    try:
        session.run("mkdocs", "build", "--strict", "-q", "--site-dir", site, env=ENV)
    finally:
        shutil.rmtree(site, ignore_errors=True)


# Python 3.13's lock has the same JAX, Flax, Equinox and Haiku as 3.12's, on which py312 runs
# everything; what differs is Python itself, so 3.13 runs the tests of what reads Python's own
# machinery (frames and profile hooks for programs without modules, closures and code objects for
# function keys, class wrapping, the command line) and of what its install decides (the public
# namespace and extras, the README's example pasted into a prompt), not the whole suite again.
PYTHON_TESTS = [
    "tests/test_packaging.py",
    "tests/test_readme.py",
    "tests/test_programs.py",
    "tests/test_intercept.py",
    "tests/test_hooks.py",
    "tests/test_rebuilt_modules.py",
    "tests/test_user_idioms.py",
    "tests/test_invisible.py",
    "tests/test_cli.py",
    "tests/test_inner_modules.py",
]


@nox.session(python="3.13")
def py313(session: nox.Session) -> None:
    """Python 3.13 with its lock: the tests that read Python's own machinery and what the install
    decides (``PYTHON_TESTS``; ``nox -s py313 -- tests`` runs everything)."""
    _locked(session)
    args = session.posargs or [*PYTHON_TESTS, "-m", "not slow"]
    session.run("python", "-m", "pytest", "-q", *WORKERS, *args, env=ENV)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock_pins(path: str) -> dict[str, str]:
    """``{normalised name: version}`` of a uv lock's ``name==version`` lines."""
    with open(path) as f:
        lines = [line.strip() for line in f if re.match(r"[A-Za-z0-9]", line)]
    return {_normal(n): v for n, _, v in (line.partition("==") for line in lines) if v}


_FREEZE = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
)


# The releases whose change reruns the whole suite in `latest`: what hookax reads the internals
# or the behaviour of (a new release of a test tool, such as hypothesis, which releases most
# days, is logged and does not).
HOOKAX_READS = {
    "jax",
    "jaxlib",
    "flax",
    "equinox",
    "dm-haiku",
    "numpy",
    "ml-dtypes",
    "optax",
    "rich",
    "matplotlib",
    "tensorstore",
    "grain",
    "tensorboardx",
    "cloudpickle",
}


@nox.session(python="3.12")
def latest(session: nox.Session) -> None:
    """Today's releases, unlocked (what a user who installs hookax now gets): a new JAX, Flax or
    Equinox release that breaks hookax fails here the day it appears. Run it before refreshing
    the locks (``make lock``). Where every release hookax reads (``HOOKAX_READS``: JAX, the
    frameworks, the array and display libraries) is the one Python 3.12's lock pins (py312 ran
    the whole suite on these), the suite would repeat py312's, so only what the install itself
    decides runs (the public namespace and extras, the README's example); any of them that
    differs runs the whole suite. Every other release that differs is logged."""
    import json

    session.install("--upgrade", "-e", ".[test]")
    session.run("python", "-c", _VERSIONS)
    if session.posargs:
        session.run("python", "-m", "pytest", "-q", *WORKERS, *session.posargs, env=ENV)
        return
    out = session.run("python", "-c", _FREEZE, silent=True) or "{}"
    installed = {_normal(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    pins = _lock_pins(LOCKS["3.12"])
    new = {
        name: f"{name} {version} (lock: {pins.get(name, 'absent')})"
        for name, version in installed.items()
        if name not in ("hookax", "pip", "setuptools", "wheel") and pins.get(name) != version
    }
    if new:
        session.log("releases other than Python 3.12's lock: " + ", ".join(sorted(new.values())))
    if set(new) & HOOKAX_READS:
        args = ["-m", "not slow"]
    else:  # py312 ran everything on these: what the extras install is what remains
        session.log("JAX, the frameworks and the array libraries are Python 3.12's lock")
        args = ["tests/test_packaging.py", "tests/test_readme.py", "-m", "not slow"]
    session.run("python", "-m", "pytest", "-q", *WORKERS, *args, env=ENV)


_VERSIONS = (
    "import sys, jax, flax, equinox; print('python', sys.version.split()[0], 'jax', "
    "jax.__version__, 'flax', flax.__version__, 'equinox', equinox.__version__)"
)


@nox.session(python=[BASE, "3.12"])
def compat(session: nox.Session) -> None:
    """The frameworks' own test suites with hookax imported (``compat/run.py``), on the
    frameworks of the session's lock."""
    session.run("python", "compat/run.py", "--lock", LOCKS[str(session.python)], *session.posargs)


PARITY_PINS = "tests/parity/constraints.txt"


def _pins(path: str) -> dict[str, str]:
    """``{name: "name==version"}`` of a constraints file."""
    with open(path) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return {line.split("==")[0]: line for line in lines if line}


# pip, not uv: torch's pinned release is a local CPU wheel that pip's configuration finds and uv
# does not (uv would fetch a multi-GB CUDA build).
@nox.session(python=BASE, venv_backend="venv")
def parity(session: nox.Session) -> None:
    """hookax against TransformerLens on the same random GPT weights (tests/parity/): the cache,
    the residual-stream views, direct logit attribution, the block-every sweep and attribution
    patching agree to 1e-5. Its own venv: torch first (a plain requirement would pull a CUDA
    build), then TransformerLens with torch held to its pin, then hookax on the lock.
    ``nox -s parity -- report`` prints the agreement table and the timings instead; other
    arguments go to pytest. Slow (a few minutes; not ``make test``): ``make test-parity``."""
    pins = _pins(PARITY_PINS)
    session.install(pins["torch"])
    session.install("-c", PARITY_PINS, pins["transformer-lens"])
    session.install("-c", LOCKS[BASE], "-c", PARITY_PINS, "-e", ".[test]")
    if session.posargs[:1] == ["report"]:
        session.run("python", "-m", "tests.parity.report", *session.posargs[1:], env=ENV)
        return
    args = session.posargs or ["tests/parity"]
    session.run("python", "-m", "pytest", "-q", *args, env=ENV)


BRIDGE_PINS = "tests/parity/constraints-bridge.txt"


@nox.session(python=BASE, venv_backend="venv", name="parity_bridge")
def parity_bridge(session: nox.Session) -> None:
    """hookax against the current TransformerLens' ``TransformerBridge`` (4.x, which removed
    ``HookedTransformer``) on a random tiny GPT-2 built offline (tests/parity/test_bridge.py):
    the logits and the cache agree to 1e-5. Its own venv (TransformerLens 4 needs transformers
    5), installed as ``parity`` installs: torch first, then TransformerLens, then hookax on the
    lock, everything held to tests/parity/constraints-bridge.txt. Nothing is downloaded from the
    Hugging Face Hub: the model and its tokenizer are made in the test. ``make test-parity``."""
    pins = _pins(BRIDGE_PINS)
    session.install(pins["torch"])
    session.install("-c", BRIDGE_PINS, pins["transformer-lens"])
    session.install("-c", LOCKS[BASE], "-c", BRIDGE_PINS, "-e", ".[test]")
    env = {**ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = session.posargs or ["tests/parity/test_bridge.py"]
    session.run("python", "-m", "pytest", "-q", *args, env=env)


CIRCUITS_PINS = "tests/parity/constraints-circuits.txt"
# What the hookax side writes and the torch side reads, under nox's cache dir (.nox/.cache).
CIRCUITS_DATA = "parity_circuits.npz"


@nox.session(python=BASE, name="parity_circuits_hookax")
def parity_circuits_hookax(session: nox.Session) -> None:
    """The hookax side of ``parity_circuits`` (which runs it first): the small induction model
    of docs/circuits.md, trained once and cached by ``induction.load_or_train`` (under
    ``$HOOKAX_CACHE`` or ``~/.cache/hookax``), its weights, prompts, logits, induction scores
    and ``hx.edge_attribution`` scores written to .nox/.cache/parity_circuits.npz. hookax with
    the NNX extra and optax, on the lock."""
    session.install("-c", LOCKS[BASE], "-e", ".[nnx]", "optax")
    out = str(session.cache_dir / CIRCUITS_DATA)
    session.run("python", "-m", "tests.parity.circuits_hookax", out, env=ENV)


@nox.session(
    python=BASE, venv_backend="venv", name="parity_circuits", requires=["parity_circuits_hookax"]
)
def parity_circuits(session: nox.Session) -> None:
    """hookax's edge attribution patching and induction scores against auto-circuit 1.0.1 and
    TransformerLens 2.16.1 on the same trained weights (tests/parity/test_circuits_parity.py):
    the logits and induction scores agree to 1e-5, EAP's scores to 1e-4 of the largest, the top
    edges in the same order; EAP-IG's to 1e-4 of the largest against its definition (Hanna et
    al. 2024) computed with TransformerLens' hooks. Two venvs: auto-circuit needs NumPy < 2
    (TransformerLens 2.16.1), JAX 0.10 NumPy >= 2; ``parity_circuits_hookax`` computes hookax's
    side and this one, installed as ``parity`` installs (torch first, then the rest held to
    tests/parity/constraints-circuits.txt), the torch side. About 4 minutes on 2 cores from
    nothing (3 of them installing the torch side), 40 s with both venvs and the weights there;
    not ``make test`` nor ``make test-parity``."""
    pins = _pins(CIRCUITS_PINS)
    session.install(pins["torch"])
    wanted = ("transformer-lens", "auto-circuit", "datasets", "pyarrow", "attrs", "pytest")
    session.install("-c", CIRCUITS_PINS, *(pins[name] for name in wanted))
    env = {**ENV, "HOOKAX_PARITY_CIRCUITS": str(session.cache_dir / CIRCUITS_DATA)}
    args = session.posargs or ["tests/parity/test_circuits_parity.py"]
    session.run("python", "-m", "pytest", "-q", *args, env=env)


# The codebases of tests/models/, per Python: each its lock (``make lock-models`` refreshes them
# from the ``.in`` files) and the packages installed without their dependencies. EasyDeL pins a
# JAX below 0.12 (Python 3.11); MaxText and gemma 4 need Python >= 3.12; AlphaFold runs on both.
MODELS = {
    "3.11": ("tests/models/py311.lock", "tests/models/py311-nodeps.txt"),  # EasyDeL
    "3.12": ("tests/models/py312.lock", "tests/models/py312-nodeps.txt"),  # gemma 4, MaxText
}
# torch (CPU), which EasyDeL's import needs, is a local wheel on these machines.
WHEELS = "/opt/wheels"


@nox.session(python=["3.11", "3.12"])
def models(session: nox.Session) -> None:
    """Every feature on the third-party codebases users run (``tests/models/``), each installed
    from the package registry at the versions of its lock. Not part of ``make test``: ``make
    test-models``. A codebase that is not installed skips. The models written the way Levanter
    and jax-llm-examples write theirs need nothing more: ``make test`` runs them, not this."""
    lock, nodeps = MODELS[str(session.python)]
    links = ["--find-links", WHEELS] if os.path.isdir(WHEELS) else []
    _locked(session)
    session.install(*links, "-r", lock)
    session.install("--no-deps", "-r", nodeps)
    env = {
        **ENV,
        # MaxText's mesh takes every device; one CPU device keeps the tiny batch unsharded.
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "EASYDEL_AUTO": "0",  # else EasyDeL appends GPU-only flags to XLA_FLAGS at import
    }
    # Third-party code warns about its own use of deprecated JAX and Flax APIs.
    args = session.posargs or [
        "tests/models",
        "--ignore=tests/models/test_model_levanter_like.py",
        "--ignore=tests/models/test_model_jaxllm_like.py",
    ]
    session.run("python", "-m", "pytest", "-q", "-W", "ignore::DeprecationWarning", *args, env=env)


@nox.session(python=BASE, venv_backend="none")
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
