# `make demo` and `make test` each create .venv when missing, install the project and run.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: demo test lint typecheck bench install-dev install compat

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-cli: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e ".[all]"
	@touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@ $(VENV)/.installed-cli

install: $(VENV)/.installed-cli
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed-cli
	$(BIN)/hookax summary --example transformer

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check hookax tests benchmarks docs
	$(BIN)/ruff format --check hookax tests benchmarks docs

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks

# Flax's NNX and Linen tests and Equinox's tests, without hookax, with it imported and with a no-op
# interceptor and hooks around every test; prints a table. Slow (own venv and sources in
# ~/.cache/hookax-compat), not part of `make test`. COMPAT_ARGS=--full runs every test file.
compat:
	$(PYTHON) compat/run.py $(COMPAT_ARGS)
