"""A griffe extension for the API page: a default spelled as a private name reads as ``...``.

Some parameters default to a private sentinel (``where=_DEFAULT``: every call site, or none when
``ops=`` is given) so that ``None`` keeps a meaning of its own. mkdocstrings shows a default as
its source text, and ``_DEFAULT`` (or ``_capture._DEFAULT``) names something a reader cannot
use. This extension writes such a default as ``...``, the convention of Python's stub files for
"has a default, described elsewhere"; the docstring's ``Args`` section says what it is. (The
sentinel's ``repr``, ``<default>``, is not Python, and the signature would lose its formatting.)
mkdocs.yml loads this file; it is not part of the package.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

PRIVATE_NAME = re.compile(r"(?:\w+\.)*_\w+")


class ReadableDefaults(griffe.Extension):
    """Write a default that is a private name (``_DEFAULT``, ``mod._DEFAULT``) as ``...``."""

    def on_function(self, *, func: griffe.Function, **kwargs: Any) -> None:
        for parameter in func.parameters:
            if parameter.default is not None and PRIVATE_NAME.fullmatch(str(parameter.default)):
                parameter.default = "..."
