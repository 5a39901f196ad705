"""The engine's plug-in points: where higher layers give the engine what it must not import.

The engine sits below the layers that implement hooks, layers of a scan and operations, so it
cannot import them. Each point it leaves open is a :class:`Slot` defined here, with a default
that says what is missing; the layer that fills it registers its implementation under its own
module name when it is imported (``import hookax`` imports them all). :data:`SLOTS` lists every
point and who filled it, so a reader finds the implementations from the engine's side.

Call sites come from framework adapters, registered in :mod:`hookax._engine.adapters`.

Examples:
  >>> import hookax
  >>> from hookax._engine import plugins
  >>> for name, slot in sorted(plugins.SLOTS.items()):
  ...     print(name, slot.provider)
  layer_gate hookax._hooks.layergate
  layer_of hookax._hooks.layergate
  run_method hookax._hooks.hookrun
  site_scope hookax._capture.ops
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["SLOTS", "Slot"]

F = TypeVar("F", bound=Callable[..., Any])


class Slot(Generic[F]):
    """One plug-in point: ``slot.fn`` is the implementation (the default until registered).

    Attributes:
      name: the point's name.
      doc: what the implementation does and who calls it.
      fn: the implementation the engine calls.
      provider: the module that registered it (None: the default).
    """

    __slots__ = ("doc", "fn", "name", "provider")

    def __init__(self, name: str, default: F, doc: str) -> None:
        self.name = name
        self.doc = doc
        self.fn: F = default
        self.provider: str | None = None
        SLOTS[name] = self

    def register(self, fn: F, provider: str) -> F:
        """Make ``fn`` the implementation, registered by the module ``provider``."""
        self.fn = fn
        self.provider = provider
        return fn

    def __repr__(self) -> str:
        return f"<slot {self.name}: {self.provider or 'default'}>"


SLOTS: dict[str, Slot[Any]] = {}
