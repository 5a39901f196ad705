# `make demo` and `make test` each create the venv of their Python when missing, install the
# project and run. PYTHON picks the Python (python3.11 unless told: `make PYTHON=python3.12 test`)
# and with it everything else: the venv (.venv for 3.11, .venv-3.12, .venv-3.13: one per Python,
# so switching back and forth reinstalls nothing), its lock (requirements-dev.lock for 3.11,
# requirements-dev-py312.lock, requirements-dev-py313.lock: the newest versions, pinned) and the
# Python of the nox test sessions (HOOKAX_PYTHON, read by noxfile.py). The venv holds its lock
# and the project in editable mode; nox's test sessions live in .nox/ (see noxfile.py).
PYTHON ?= python3.11
# PYTHON as a command that runs (pyenv's installed but unselected versions included), its X.Y.
PY := $(shell sh .ci/python_path "$(PYTHON)")
PYVER := $(if $(PY),$(shell "$(PY)" -c 'import sys; print("%d.%d" % sys.version_info[:2])'))
VENV := $(if $(filter 3.11,$(PYVER)),.venv,.venv-$(PYVER))
LOCK := $(if $(filter 3.11,$(PYVER)),requirements-dev.lock,requirements-dev-py$(subst .,,$(PYVER)).lock)
BIN := $(VENV)/bin
export HOOKAX_PYTHON := $(PYVER)
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export NO_MKDOCS_2_WARNING := 1
export UV_PYTHON_DOWNLOADS := never

.PHONY: demo dist test test-newest test-oldest test-slow test-wheel test-py312 test-py313 test-latest test-parity test-models lock-models lint typecheck docs bench lock install-dev install compat

$(BIN)/python:
	@[ -n "$(PY)" ] || { echo "make: $(PYTHON) does not run on this machine. Fix: install it (pyenv install $(patsubst python%,%,$(notdir $(PYTHON))), or your system's $(notdir $(PYTHON)) package), or point PYTHON at an interpreter: make PYTHON=/path/to/$(notdir $(PYTHON)) $(MAKECMDGOALS)"; exit 1; }
	@[ -f "$(LOCK)" ] || { echo "make: $(PYTHON) is Python $(PYVER); hookax's development sets are locked for Python 3.11, 3.12 and 3.13 ($(LOCK) does not exist). Fix: make PYTHON=python3.11 (or python3.12, python3.13)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-cli: $(BIN)/python pyproject.toml $(LOCK)
	$(BIN)/python -m pip install -q -c $(LOCK) -e ".[cli]"
	@touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml $(LOCK)
	$(BIN)/python -m pip install -q -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps -e .
	@touch $@ $(VENV)/.installed-cli

install: $(VENV)/.installed-cli
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed-cli
	$(BIN)/hookax summary --example transformer

# The source distribution and the wheel, in dist/: `pip install "dist/hookax-0.1.0-py3-none-any.whl[nnx]"`
# installs it anywhere. `make test-wheel` checks a wheel the same way, one fresh venv per extra.
dist: $(BIN)/python
	$(BIN)/python -m pip install -q build
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check hookax tests benchmarks docs noxfile.py .ci conftest.py
	$(BIN)/ruff format --check hookax tests benchmarks docs noxfile.py .ci conftest.py

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

# The whole suite on the locked newest set, a representative subset on the oldest supported set,
# the docs site, each on PYTHON (the oldest set has no Python 3.13 wheels: with PYTHON=python3.13
# it runs on 3.11, and says so). About 18 minutes on 2 cores (Python 3.11). CI (.ci/run) also runs
# test-wheel: the built wheel installed with each extra into fresh venvs (about a minute more).
test: lint typecheck test-newest test-oldest docs

test-newest: $(VENV)/.installed-dev
	$(BIN)/nox -s newest

test-oldest: $(VENV)/.installed-dev
	$(BIN)/nox -s oldest

# The tests marked `slow` (CI runs them after `make test`).
test-slow: $(VENV)/.installed-dev
	$(BIN)/nox -s slow oldest-slow

test-wheel: $(VENV)/.installed-dev
	$(BIN)/nox -s wheel

# The newest JAX (0.12 needs Python >= 3.12), each Python on its own lock: on 3.12 the whole
# suite, the slow tests and the docs; on 3.13 the suite as `make test` runs it. CI runs both.
# nox finds pyenv's 3.12 and 3.13 where they are not the global version (noxfile.py).
test-py312: $(VENV)/.installed-dev
	$(BIN)/nox -s py312

test-py313: $(VENV)/.installed-dev
	$(BIN)/nox -s py313

# Today's releases, unlocked, on Python 3.12: what a user installing now gets (CI runs it).
test-latest: $(VENV)/.installed-dev
	$(BIN)/nox -s latest

# hookax against TransformerLens 3.9 on the same GPT weights, in a venv of its own with torch
# (CPU) and transformer-lens (tests/parity/; a few minutes; CI runs it). `.nox/parity/bin/python
# -m tests.parity.report` (or `nox -s parity -- report`) prints the agreement and the timings.
# Then against TransformerLens 4's TransformerBridge on a tiny GPT-2 (parity_bridge, its own venv).
test-parity: $(VENV)/.installed-dev
	$(BIN)/nox -s parity parity_bridge

# The site, strict (any warning fails) and not quiet, so a warning is seen where it fails;
# tests/test_docs_site.py checks what the pages hold (code blocks, links, images).
docs: $(VENV)/.installed-dev
	$(BIN)/mkdocs build --strict

bench: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks

# Refresh the development locks, one per Python, to the newest releases (run `make test-latest`
# first).
lock: $(VENV)/.installed-dev
	$(BIN)/python -m uv pip compile pyproject.toml --extra dev --python-version 3.11 -q \
		--upgrade --custom-compile-command "make lock" -o requirements-dev.lock
	$(BIN)/python -m uv pip compile pyproject.toml --extra dev --python-version 3.12 -q \
		--upgrade --custom-compile-command "make lock" -o requirements-dev-py312.lock
	$(BIN)/python -m uv pip compile pyproject.toml --extra dev --python-version 3.13 -q \
		--upgrade --custom-compile-command "make lock" -o requirements-dev-py313.lock

# tests/models/: every feature on the codebases users run (gemma, EasyDeL, MaxText, AlphaFold; a
# Levanter-like model), each installed from the registry at its lock's versions, on Python 3.11
# (EasyDeL, AlphaFold) and 3.12 (gemma 4, MaxText). Heavy installs: not part of
# `make test`; CI runs it last.
test-models: $(VENV)/.installed-dev
	$(BIN)/nox -s models

# Refresh the locks of tests/models/ from their .in files.
lock-models: $(VENV)/.installed-dev
	$(BIN)/python -m uv pip compile tests/models/py311.in -c requirements-dev.lock -q \
		--python-version 3.11 --find-links /opt/wheels --custom-compile-command "make lock-models" \
		-o tests/models/py311.lock
	$(BIN)/python -m uv pip compile tests/models/py312.in -c requirements-dev-py312.lock -q \
		--python-version 3.12 --custom-compile-command "make lock-models" -o tests/models/py312.lock

# Flax's NNX and Linen tests and Equinox's tests, without hookax, with it imported and with a no-op
# interceptor and hooks around every test; prints a table. Slow (own venv and sources in
# ~/.cache/hookax-compat), not part of `make test`, on Python 3.11's and 3.12's locks.
# COMPAT_ARGS=--full runs every test file.
compat: $(VENV)/.installed-dev
	$(BIN)/nox -s compat -- $(COMPAT_ARGS)
