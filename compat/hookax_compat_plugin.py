"""pytest plugin for ``make compat``: hookax imported and installed, optionally a no-op scope.

Loaded with ``-p hookax_compat_plugin`` into a framework's own test suite. ``HOOKAX_COMPAT_WAY``:

* ``imported``: import the frameworks, then hookax, and install its adapters (nothing active);
* ``scoped``: the same, plus a no-op ``hx.intercept`` and no-op ``hx.hooks`` (forward pre-hook
  and forward hook) active around every test's call (a unittest test's ``setUp`` included).
* ``ops``: the same, plus a no-op ``hx.intercept_op`` on every operation of every call site
  (``ops="**:*#*"``): every module call pushes its name-stack scope and runs under the trace
  that counts its operations (and ``jax.nn.softmax`` runs as JAX's custom_jvp softmax, as
  documented). Not among the default ways: ``python compat/run.py --ways plain,ops``.

At the end it writes how many call sites the no-op interceptor saw to ``HOOKAX_COMPAT_STATS``,
the proof that hookax was really in the way.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

WAY = os.environ.get("HOOKAX_COMPAT_WAY", "imported")
SEEN = {"intercepted": 0, "hooked": 0, "tests": 0}


def _noop(next_fun: Any, args: tuple, kwargs: dict, context: Any) -> Any:
    SEEN["intercepted"] += 1
    return next_fun(*args, **kwargs)


def _pre(module: Any, args: tuple) -> None:
    SEEN["hooked"] += 1


def _post(module: Any, args: tuple, output: Any) -> None:
    return None


def pytest_configure(config: pytest.Config) -> None:
    for name in ("flax.linen", "flax.nnx", "equinox", "haiku"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    import hookax
    from hookax._engine import adapters as frameworks

    frameworks.ensure_installed()
    SEEN["hookax"] = hookax.__file__
    SEEN["installed"] = sorted(frameworks.installed())


@contextlib.contextmanager
def _scope() -> Iterator[None]:
    import hookax as hx

    with hx.intercept(_noop), hx.hooks(forward_pre=_pre, forward=_post):
        yield


def _noop_edit(value: Any, op: Any) -> None:
    SEEN["ops"] = SEEN.get("ops", 0) + 1


@contextlib.contextmanager
def _ops_scope() -> Iterator[None]:
    import hookax as hx

    try:
        with hx.intercept_op(_noop_edit, ops="**:*#*"), hx.intercept(_noop):
            yield
    except hx.SelectorError:  # call sites ran, none with an operation: nothing was in the way
        pass


_SCOPES = {"scoped": _scope, "ops": _ops_scope}

if WAY in _SCOPES:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
        SEEN["tests"] += 1
        with _SCOPES[WAY]():
            yield


def pytest_unconfigure(config: pytest.Config) -> None:
    path = os.environ.get("HOOKAX_COMPAT_STATS")
    if path:
        with open(path, "w") as f:
            json.dump({"way": WAY, **SEEN}, f)
