"""``hookax stats-plot``: the per-layer-over-steps figure of the statistics a training run logged.

hookax stats-plot runs/exp1 --stat grad_norm --stat act_max_abs --out stats.png [--where "blocks/*"]
"""

from __future__ import annotations

import argparse

from .._util.words import counted

__all__ = ["add_arguments", "run"]


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("logdir", help="the folder hx.StatsLogger wrote (TensorBoard event files)")
    c.add_argument(
        "--stat",
        action="append",
        help='a statistic to draw, one panel each ("grad_norm", "act_max_abs", ...); '
        "repeatable; default act_norm and grad_norm",
    )
    c.add_argument(
        "--where", help='which call sites (a glob over their keys, like "blocks/*"); default all'
    )
    c.add_argument("--out", default="stats.png", help="the PNG to write")


def run(args: argparse.Namespace) -> None:
    import os

    from .._diagnostics.gradflow import check_writable
    from .._diagnostics.logger import read_events
    from .._diagnostics.statsplot import DEFAULT_PANELS, plot_stats, series
    from .._util.errors import HookaxError, SelectorError
    from .common import UsageError, _first_line

    if not os.path.isdir(args.logdir):
        raise UsageError(f"LOGDIR {args.logdir!r} is not a folder")
    try:
        check_writable(args.out)
    except OSError as e:
        raise UsageError(f"cannot write {args.out!r}: {e.strerror or e}") from None
    stats = tuple(args.stat or DEFAULT_PANELS)
    try:
        plot_stats(args.logdir, stats, where=args.where, out=args.out)
    except SelectorError as e:
        raise UsageError(f"--where {args.where!r}: {_first_line(e)}") from None
    except HookaxError as e:
        msg = _first_line(e).replace("Fix: one of those names", "Fix: --stat NAME")
        raise UsageError(msg) from None
    except OSError as e:
        raise UsageError(f"cannot write {args.out!r}: {e.strerror or e}") from None
    events = read_events(args.logdir)
    for stat in stats:
        lines = series(events, stat, args.where)
        steps = sorted({s for steps, _ in lines.values() for s in steps})
        print(
            f"{stat}: {counted(len(lines), 'call site')}, "
            f"steps {steps[0]}..{steps[-1]} ({len(steps)})"
        )
    print(f"wrote {args.out}")
