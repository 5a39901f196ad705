"""Wrapping the methods of a framework's module classes: once, where defined, never undone.

Used by the NNX and Equinox adapters. Each class's own public methods and ``__call__`` are
replaced by a wrapper (built by the adapter) at install time for existing classes, and from
``__init_subclass__`` for classes defined later. staticmethods, classmethods, properties,
function-valued class attributes and the base class's own methods are left alone.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["MARK", "install_on"]

MARK = "__hookax_wrapped__"  # set on each wrapper; holds the function it wraps


def _is_call_site(cls: type, name: str, value: Any, base_names: frozenset[str]) -> bool:
    if name in base_names or not (name == "__call__" or not name.startswith("_")):
        return False
    if not isinstance(value, types.FunctionType) or hasattr(value, MARK):
        return False
    if getattr(value, "__isabstractmethod__", False):
        return False
    # A function defined in the class body; `act = some_function` assigned from outside is
    # an attribute that happens to be a function, not a method of this module.
    return value.__qualname__.startswith(cls.__qualname__ + ".")


def _subclasses(cls: type) -> Iterator[type]:
    sub: type
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def install_on(
    base: type,
    wrap: Callable[[Callable[..., Any], str], Callable[..., Any]],
    is_internal: Callable[[type], bool],
) -> Callable[[type], None]:
    """Wrap every subclass of ``base`` now and every one defined later; returns ``wrap_class``."""
    base_names = frozenset(n for n in dir(base) if n != "__call__")

    def wrap_class(cls: type) -> None:
        """Make the methods ``cls`` itself defines interceptable (idempotent)."""
        if cls.__dict__.get("__hookax_class__") or is_internal(cls):
            return
        for name, value in list(vars(cls).items()):
            if _is_call_site(cls, name, value, base_names):
                wrapper = wrap(value, name)
                setattr(wrapper, MARK, value)
                type.__setattr__(cls, name, wrapper)
        type.__setattr__(cls, "__hookax_class__", True)

    prev = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        if prev is not None:
            prev.__get__(None, cls)(**kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]
        wrap_class(cls)

    base.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
    for cls in list(_subclasses(base)):
        wrap_class(cls)
    return wrap_class
