"""The progress of a :func:`hookax.harvest` run, where it runs: a bar on a terminal (percentage and
time left when the number of batches is known), a line rewritten in place in a notebook, and at the
end one final line (what was stored, how fast) that stays, also in a saved notebook."""

from __future__ import annotations

import sys
import time
from typing import Any

from .._util.words import counted

__all__ = ["Progress", "shown"]

_EVERY = 0.2  # seconds between two rewrites of a notebook's line


def shown(progress: bool | None) -> bool:
    """Whether a run with ``progress=`` shows its progress (None: on a terminal, in a notebook)."""
    if progress is not None:
        return progress
    from .._util.display import in_notebook

    return _isatty(sys.stderr) or in_notebook()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """Batches done (of ``total`` when known), rows and MB/s while the run goes; nothing when
    off. Called by the writer after each commit; :meth:`finish` prints the final line."""

    def __init__(self, on: bool, total: int | None, start: int, stream: Any = None) -> None:
        self.on, self.total, self.done = on, total, start
        self.stream = sys.stderr if stream is None else stream
        self._bar: Any = None
        self._t0 = self._last = time.perf_counter()
        self._start = start

    def __enter__(self) -> Progress:
        if self.on and _isatty(self.stream):
            self._bar, self._task = _rich_bar(self.stream, self.total, self.done)
        elif self.on:
            self._line(self.done, 0, 0)
        return self

    def __call__(self, batches: int, rows: int, written: int) -> None:
        if not self.on:
            return
        self.done = batches
        mbs = written / 1e6 / max(time.perf_counter() - self._t0, 1e-9)
        if self._bar is not None:
            self._bar.update(self._task, completed=batches, rows=rows, mbs=mbs)
        elif time.perf_counter() - self._last >= _EVERY or batches == self.total:
            self._line(batches, rows, mbs)

    def _line(self, batches: int, rows: int, mbs: float) -> None:
        """The notebook's line, rewritten in place (``\\r``)."""
        self._last = time.perf_counter()
        text = f"harvest: batch {batches}"
        if self.total:
            share = min(batches / self.total, 1.0)
            bar = "█" * round(20 * share) + "·" * (20 - round(20 * share))
            text = f"harvest: {bar} {100 * share:3.0f}% batch {batches}/{self.total}"
            left = self._left(batches)
            text += f", {counted(rows, 'row', ',')}, {mbs:.1f} MB/s" + (
                f", {left} left" if left else ""
            )
        else:
            text += f", {counted(rows, 'row', ',')}, {mbs:.1f} MB/s"
        self.stream.write("\r" + text.ljust(getattr(self, "_width", 0)))
        self._width = len(text)
        self.stream.flush()

    def _left(self, batches: int) -> str:
        """The time left, at this run's pace so far (``""`` until a batch is done)."""
        ran = batches - self._start
        if not self.total or ran <= 0:
            return ""
        seconds = (time.perf_counter() - self._t0) / ran * (self.total - batches)
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()  # transient: the bar goes, the final line stays
            self._bar = None
        elif self.on and exc[0] is not None:
            self.stream.write("\n")

    def finish(self, line: str) -> None:
        """The final line, in place of the bar (a notebook's line ends and stays)."""
        if not self.on:
            return
        start = "\r" if not _isatty(self.stream) else ""
        pad = " " * max(getattr(self, "_width", 0) - len(line), 0)
        self.stream.write(f"{start}{line}{pad}\n")
        self.stream.flush()


def _rich_bar(stream: Any, total: int | None, done: int) -> tuple[Any, Any]:
    """A rich bar on the terminal: percentage and time left when ``total`` is known, a spinner
    and the count otherwise. It disappears when stopped (the final line replaces it)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if total:
        columns: list[Any] = [
            TextColumn("harvest"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TextColumn("batch {task.completed}/{task.total}"),
        ]
    else:
        columns = [SpinnerColumn(), TextColumn("harvest: batch {task.completed}")]
    columns += [
        TextColumn("{task.fields[rows]:,} rows"),
        TextColumn("{task.fields[mbs]:.1f} MB/s"),
        TimeElapsedColumn(),
    ]
    if total:
        columns += [TextColumn("left"), TimeRemainingColumn()]
    bar = Progress(*columns, console=Console(file=stream), transient=True)
    bar.start()
    task = bar.add_task("harvest", total=total, completed=done, rows=0, mbs=0.0)
    return bar, task
