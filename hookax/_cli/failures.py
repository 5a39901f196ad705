"""How the command line words an exception of the model's run: an input that does not fit the
model, or the model's own exception.

The input does not fit when JAX (or NumPy, Flax, Equinox) itself refused it: the exception is a
``TypeError`` or ``ValueError`` raised inside those libraries, the shape and dtype rules of an
operation (``dot_general requires contracting dimensions to have the same shape``). Anything
else is the model's: an exception its own code raised (``raise ValueError("boom")``), or one of
another kind, shown with the call site and the line of the model's code where it happened.
"""

from __future__ import annotations

import os
import sysconfig
from types import FrameType
from typing import Any

__all__ = ["first_line", "model_failed"]

# packages whose TypeError or ValueError is a refusal of the input (shape and dtype rules)
_LIBRARIES = frozenset({"jax", "jaxlib", "numpy", "ml_dtypes", "opt_einsum", "flax", "equinox"})
_TRACING_ERRORS = (
    "ConcretizationTypeError",
    "TracerArrayConversionError",
    "TracerBoolConversionError",
    "TracerIntegerConversionError",
    "UnexpectedTracerError",
)
_STDLIB = os.path.normcase(sysconfig.get_paths()["stdlib"])


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type's name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def model_failed(e: BaseException, loaded: Any) -> str:
    """The one-line message for ``e``, raised while running ``loaded`` (a
    :class:`~hookax._cli.common.LoadedModel`)."""
    frames = _frames(e)
    shown = _inputs(loaded)
    where = _call_site(e)
    if frames and _input_refused(e, frames[-1][0]):
        site = f"{where}: " if where else ""
        return f"input {shown} does not fit the model: {site}{type(e).__name__}: {first_line(e)}"
    parts = [where.split(" rejected its input")[0]] if where else []
    if (line := _model_line(frames)) is not None:
        parts.append(f"at {line}")
    place = f" ({', '.join(parts)})" if parts else ""
    return (
        f"model {loaded.name!r} raised {type(e).__name__}: {first_line(e)}{place}; "
        f"its input was {shown}"
    )


def _inputs(loaded: Any) -> str:
    import jax

    from .._util.specs import describe

    leaves = [*loaded.args, *jax.tree.leaves(loaded.kwargs)]
    return ", ".join(describe(x) for x in leaves) or "no arguments"


def _call_site(e: BaseException) -> str | None:
    from .._summary.trace import rejection

    return rejection(e)


def _frames(e: BaseException) -> list[tuple[FrameType, int]]:
    """The frames from the command down to where ``e`` was raised, JAX's own included (JAX
    keeps them on ``e.__cause__`` when it filters the traceback)."""
    cause = e.__cause__
    tb = e.__traceback__
    if cause is not None and type(cause).__name__ == "UnfilteredStackTrace":
        tb = cause.__traceback__
    out = []
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _package(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", "")).split(".")[0]


def _input_refused(e: BaseException, raised: FrameType) -> bool:
    if not isinstance(e, TypeError | ValueError) or type(e).__name__ in _TRACING_ERRORS:
        return False
    return _package(raised) in _LIBRARIES


def _is_model_code(frame: FrameType) -> bool:
    name = str(frame.f_globals.get("__name__", ""))
    if name.startswith("hookax.examples"):
        return True
    if _package(frame) in _LIBRARIES or name.split(".")[0] == "hookax":
        return False
    path = os.path.normcase(os.path.abspath(frame.f_code.co_filename))
    return not path.startswith(_STDLIB) and "site-packages" not in path


def _model_line(frames: list[tuple[FrameType, int]]) -> str | None:
    """``file:line in function`` of the innermost frame of the model's own code."""
    for frame, line in reversed(frames):
        if _is_model_code(frame):
            path = os.path.abspath(frame.f_code.co_filename)
            try:
                shown = os.path.relpath(path)
            except ValueError:  # pragma: no cover - another drive (Windows)
                shown = path
            if shown.startswith(".."):
                shown = path
            qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            return f"{shown}:{line} in {qualname}"
    return None
