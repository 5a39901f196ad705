"""Framework adapters: how each framework's modules become call sites.

An adapter is loaded the first time hookax is used while its framework is imported, so
``import hookax`` imports no framework. Each adapter provides:

* ``install()``: make every module class's methods interceptable (once, never undone);
* ``iter_modules(root)``: ``(path, module)`` pairs below ``root``;
* ``aliases(module)``: ``module`` and the outer modules it stands for inside transforms;
* ``root_done()``: called when the outermost call site on this thread returns.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

__all__ = ["adapter_for", "ensure_installed", "installed"]

_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {}


def ensure_installed() -> None:
    """Install the adapter of every supported framework that is imported (cheap when done)."""
    if "nnx" not in _INSTALLED and "flax.nnx" in sys.modules:
        with _LOCK:
            if "nnx" not in _INSTALLED:
                from . import _nnx

                _nnx.install()
                _INSTALLED["nnx"] = _nnx.ADAPTER


def installed() -> dict[str, Any]:
    return _INSTALLED


def adapter_for(obj: Any) -> Any | None:
    """The adapter whose framework ``obj`` is a module of, or None."""
    ensure_installed()
    for adapter in _INSTALLED.values():
        if adapter.is_module(obj):
            return adapter
    return None
