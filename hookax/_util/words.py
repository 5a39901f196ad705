"""Counts in words: ``1 call site``, ``2 call sites``, wherever hookax prints a count."""

from __future__ import annotations

__all__ = ["counted"]

# Plurals that are not the word with an "s".
_PLURALS = {"batch": "batches"}


def counted(n: int, word: str, fmt: str = "") -> str:
    """``n`` and ``word``, plural unless ``n`` is 1; ``fmt`` formats ``n`` (``","``).

    Examples:
      >>> counted(1, "call site"), counted(2, "call site"), counted(0, "batch")
      ('1 call site', '2 call sites', '0 batches')
      >>> counted(12345, "row", ",")
      '12,345 rows'
    """
    return f"{n:{fmt}} {word if n == 1 else _PLURALS.get(word, word + 's')}"
