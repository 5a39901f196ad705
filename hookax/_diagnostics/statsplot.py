"""``hx.plot_stats``: one statistic of every layer over the training steps, from the logged files.

Reads the event files ``hx.StatsLogger`` wrote (``hx.read_events``) and draws,
for each statistic asked for (``"grad_norm"``, ``"act_max_abs"``, ...), one panel: a line per
call site and layer over the steps, coloured from the first layer to the last (viridis), on a log
axis when every value is positive. Non-finite values are marked at the top of the panel, never
dropped. ``hookax stats-plot LOGDIR`` draws it from the command line.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from .._engine.select import check_glob, glob_to_regex
from .._util.errors import HookaxError
from . import logger as _logger

__all__ = ["DEFAULT_PANELS", "plot_stats", "series"]

DEFAULT_PANELS = ("act_norm", "grad_norm")
_LAYER = re.compile(r"((?:\[\d+\])*)$")


def _natural(label: str) -> tuple[Any, ...]:
    """Sort key: numbers as numbers (``layers/2`` before ``layers/10``), the model first."""
    parts = re.split(r"(\d+)", label)
    return (label != _logger.ROOT, *[(0, int(p)) if p.isdigit() else (1, p) for p in parts])


def series(
    events: dict[str, tuple[list[int], list[float]]], stat: str, where: str | None = None
) -> dict[str, tuple[list[int], list[float]]]:
    """``{label: (steps, values)}`` of one statistic (``"grad_norm"``), labels in layer order;
    ``where`` is a path glob over the call-site keys (every layer of a matching key is kept).

    Examples:
      >>> ev = {"grad_norm/layers/10": ([0], [1.0]), "grad_norm/layers/2": ([0], [2.0]),
      ...       "act_norm/layers/2": ([0], [3.0]), "grad_norm/blocks[1]": ([0], [4.0])}
      >>> list(series(ev, "grad_norm"))
      ['blocks[1]', 'layers/2', 'layers/10']
      >>> list(series(ev, "grad_norm", where="layers/*"))
      ['layers/2', 'layers/10']
    """
    prefix = stat + "/"
    pattern = None
    if where is not None:
        check_glob(where)
        pattern = glob_to_regex(where)
    out = {}
    for tag, values in events.items():
        if not tag.startswith(prefix):
            continue
        label = tag[len(prefix) :]
        key = _LAYER.sub("", label)
        key = "" if key == _logger.ROOT else key
        if pattern is None or pattern.fullmatch(key):
            out[label] = values
    return {label: out[label] for label in sorted(out, key=_natural)}


def plot_stats(
    logdir: str | os.PathLike[str],
    stats: tuple[str, ...] | str = DEFAULT_PANELS,
    *,
    where: str | None = None,
    out: str | os.PathLike[str] | None = None,
    title: str | None = None,
) -> Any:
    """The per-layer-over-steps figure of the statistics in ``logdir`` (matplotlib ``Figure``),
    written to ``out`` (PNG) when given.

    Args:
      logdir: the folder [`hx.StatsLogger`][hookax.StatsLogger] wrote.
      stats: the statistics, one panel each: ``"{act|grad}_{statistic}"`` (``"grad_norm"``).
      where: a path glob over the call-site keys (``"blocks/*"``); default every one.
      out: where to write the PNG.
      title: the figure's title; default the folder's name.

    Raises:
      HookaxError: a statistic that is not in the files (the message lists those that are).
    """
    from .._util.extras import require

    require("matplotlib", "plot", "hx.plot_stats (it draws a chart)")
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from .._util.figure import Figure, save_png  # a notebook shows it as its image, pyplot or not

    names = (stats,) if isinstance(stats, str) else tuple(stats)
    events = _logger.read_events(logdir)
    panels = [(name, series(events, name, where)) for name in names]
    for name, lines in panels:
        if not lines:
            have = sorted({t.split("/", 1)[0] for t in events if "/" in t})
            raise HookaxError(
                f"{os.fspath(logdir)!r} holds no statistic {name!r}"
                f"{f' of a call site matching {where!r}' if where else ''}; it has: "
                f"{', '.join(have) or 'none'}. Fix: one of those names."
            )
    fig = Figure(figsize=(9.0, 3.4 * len(panels) + 0.8), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (name, lines) in zip(axes, panels):
        _panel(ax, name, lines, colormaps["viridis"])
    axes[0].set_title(title or f"per-layer statistics: {os.path.basename(os.fspath(logdir))}")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    if out is not None:
        save_png(fig, out)
    return fig


def _panel(ax: Any, name: str, lines: dict[str, tuple[list[int], list[float]]], cmap: Any) -> None:
    finite = [v for _, vs in lines.values() for v in vs if math.isfinite(v)]
    log = bool(finite) and min(finite) > 0
    top = max(finite) if finite else 1.0
    n = len(lines)
    for i, (label, (steps, values)) in enumerate(lines.items()):
        color = cmap(i / max(n - 1, 1))
        shown = [v if math.isfinite(v) else math.nan for v in values]
        ax.plot(steps, shown, color=color, linewidth=1.0, label=label)
        bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
        if bad:
            ax.plot(bad, [top] * len(bad), "X", color="tab:red", markersize=6)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(name + (" (log)" if log else ""))
    ax.grid(alpha=0.3, which="both")
    if n <= 16:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    else:  # too many for a legend: the colours run from the first call site to the last
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        bar = ax.figure.colorbar(
            ScalarMappable(norm=Normalize(0, n - 1), cmap=cmap), ax=ax, pad=0.01
        )
        first, last = next(iter(lines)), list(lines)[-1]
        bar.set_label(f"call site, {first} ... {last}", fontsize=7)
