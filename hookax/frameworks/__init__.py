"""Framework adapters: how each framework's modules become call sites.

An adapter is loaded the first time hookax is used while its framework is imported, so
``import hookax`` imports no framework. Each adapter provides:

* ``install()``: make every module class's methods interceptable (once, never undone);
* ``iter_modules(root)``: ``(path, module)`` pairs below ``root``;
* ``aliases(module)``: ``module`` and the outer modules it stands for inside transforms;
* ``root_done()``: called when the outermost call site on this thread returns.

Optional: ``relative_path(root, module)`` (a path without walking the model, where modules know
their own: Linen) and ``immutable`` (modules take only scoped hooks: Linen, Equinox).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

__all__ = ["adapter_for", "ensure_installed", "installed"]

_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {}


# adapter name -> (the framework's module that must be imported, the adapter's module)
_FRAMEWORKS: tuple[tuple[str, str, str], ...] = (
    ("nnx", "flax.nnx", "_nnx"),
    ("linen", "flax.linen", "_linen"),
    ("equinox", "equinox", "_equinox"),
)


def ensure_installed() -> None:
    """Install the adapter of every supported framework that is imported (cheap when done)."""
    if len(_INSTALLED) == len(_FRAMEWORKS):
        return
    for name, framework, module in _FRAMEWORKS:
        if name not in _INSTALLED and framework in sys.modules:
            with _LOCK:
                if name not in _INSTALLED:
                    import importlib

                    adapter = importlib.import_module(f"{__name__}.{module}")
                    adapter.install()
                    _INSTALLED[name] = adapter.ADAPTER


def installed() -> dict[str, Any]:
    return _INSTALLED


def adapter_for(obj: Any) -> Any | None:
    """The adapter whose framework ``obj`` is a module of, or None."""
    ensure_installed()
    for adapter in _INSTALLED.values():
        if adapter.is_module(obj):
            return adapter
    return None
