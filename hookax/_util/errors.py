"""The hookax error family.

Every error hookax raises itself is a :class:`HookaxError`; the subclasses also derive from the
builtin a caller would catch for that kind of mistake.
"""

from __future__ import annotations

__all__ = ["HookError", "HookaxError", "SelectorError", "StoreError"]


class HookaxError(Exception):
    """Base class of every error raised by hookax itself."""


class HookError(HookaxError, TypeError):
    """A hook returned a value of the wrong kind, structure, shape or dtype."""


class SelectorError(HookaxError, ValueError):
    """A ``where=`` selector is malformed, or matches no module where one is required."""


class StoreError(HookaxError, OSError):
    """``hx.harvest`` could not write or read its store: the path is a file or under one, the
    location is read-only, the disk is full, or the store was moved or replaced while it ran.

    The message names the store, the cause and the batch reached. Batches committed before the
    fault are kept, and a rerun with the same arguments resumes after them.
    """


_NOTED = "__hookax_noted__"


def is_noted(e: BaseException) -> bool:
    """Whether hookax already added its note to ``e`` (only the innermost call site notes)."""
    return getattr(e, _NOTED, False)


def add_note(e: BaseException, note: str) -> None:
    """Add ``note`` to ``e`` once: the innermost call site that saw the exception names itself."""
    if is_noted(e):
        return
    try:
        setattr(e, _NOTED, True)
    except Exception:  # pragma: no cover - exceptions with __slots__ and no __dict__
        return
    e.add_note(note)
