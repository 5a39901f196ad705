"""A matplotlib ``Figure`` that a notebook shows as an image, without pyplot (imported only when a
figure is drawn: ``import hookax`` does not import matplotlib)."""

from __future__ import annotations

import base64
import io
import os
import tempfile
from typing import Any

from matplotlib.figure import Figure as _Figure

__all__ = ["Figure", "png", "png_html", "save_png"]


def png(fig: _Figure) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def save_png(fig: _Figure, out: Any) -> None:
    """Write the figure as a PNG to ``out`` (a path or a binary file). A path is written whole or
    not at all: the bytes go to a new temporary file beside it (made here, so nothing else is
    ever overwritten or removed), renamed over ``out`` at the end, so an interrupt (Ctrl-C)
    never leaves a truncated image."""
    if hasattr(out, "write"):
        fig.savefig(out, format="png")
        return
    path = os.path.abspath(os.fspath(out))
    data = png(fig)
    fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)  # the file mkstemp made for this write, and only that
        raise


def png_html(fig: _Figure) -> str:
    """The figure as an ``<img>`` with the PNG inline (base64)."""
    data = base64.b64encode(png(fig)).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{fig.axes[0].get_title()}"/>'


class Figure(_Figure):
    """A ``matplotlib.figure.Figure`` that IPython shows as a PNG (``_repr_png_``).

    A figure made without pyplot is shown by a notebook as its text
    (``<Figure size 600x840 with 2 Axes>``) unless pyplot's inline backend happens to be active;
    this one always shows as the image, once.
    """

    def _repr_png_(self) -> bytes:
        return png(self)
