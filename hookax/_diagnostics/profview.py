"""What ``hx.profile`` returns: the rows, the step's time, and the table people read."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from .._util.words import counted

__all__ = ["Profile", "ProfileRow"]


@dataclasses.dataclass(frozen=True)
class ProfileRow:
    """One call site (or one layer of a scanned one) in [`hx.Profile`][hookax.Profile].

    Attributes:
      key: the call site's key, with the layer for one layer of a scanned stack
        (``"blocks/lin[2]"``).
      site: the call site's key without the layer.
      layer: the layer's index in a scanned stack; None outside one.
      type: the module's class name.
      method: the method called.
      depth: how many call sites it runs inside (0: the model).
      forward_ms: device time of its own forward operations (child call sites excluded), mean
        over the runs.
      backward_ms: the same for its backward operations.
      forward_total_ms: forward time with its child call sites.
      backward_total_ms: backward time with its child call sites.
    """

    key: str
    site: str
    layer: int | None
    type: str
    method: str
    depth: int
    forward_ms: float
    backward_ms: float
    forward_total_ms: float
    backward_total_ms: float

    @property
    def total_ms(self) -> float:
        """Forward and backward, with the child call sites."""
        return self.forward_total_ms + self.backward_total_ms


@dataclasses.dataclass(frozen=True)
class Profile:
    """Device time per call site of a step ([`hx.profile`][hookax.profile]).

    The rows' own times (``forward_ms + backward_ms``), ``other_ms`` and ``idle_ms`` add up to
    ``step_ms``.

    Attributes:
      rows: one per call site, in tree order (a call site, then those it calls); one per layer
        of a scanned stack where the layers are told apart.
      other_forward_ms: operations outside every call site in the forward pass (the loss).
      other_backward_ms: the same in the backward pass (and the optimizer update).
      idle_ms: moments of the step when no operation runs.
      step_ms: the step: from the start of its first operation to the end of its last.
      runs: how many runs the means are over.
      device: the device it ran on.
      notes: what the table could not tell apart.
    """

    rows: list[ProfileRow]
    other_forward_ms: float
    other_backward_ms: float
    idle_ms: float
    step_ms: float
    runs: int
    device: str
    notes: tuple[str, ...] = ()

    @property
    def other_ms(self) -> float:
        """Operations outside every call site, forward and backward."""
        return self.other_forward_ms + self.other_backward_ms

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[ProfileRow]:
        return iter(self.rows)

    def __getitem__(self, key: str) -> ProfileRow:
        """The row of a call site's key (``"blocks/lin[2]"`` for one layer)."""
        for row in self.rows:
            if row.key == key:
                return row
        keys = ", ".join(repr(r.key) for r in self.rows[:8])
        raise KeyError(f"hx.Profile has no row {key!r}; its rows include {keys}.")

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps(d, indent=1)

    def grid(self) -> Any:
        """The table as a ``hookax._util.display.Grid`` (what ``print`` and notebooks show)."""
        from .._util.display import Grid

        step = self.step_ms or 1.0
        scale, unit = (1.0, "ms") if self.step_ms >= 1 else (1000.0, "µs")

        def t(ms: float) -> str:
            return f"{ms * scale:.3f}" if unit == "ms" else f"{ms * scale:.1f}"

        def share(ms: float) -> str:
            return f"{100 * ms / step:.1f}%"

        rows: list[tuple[str, ...]] = []
        above: list[str] = []  # the keys of the rows this one is inside, by depth
        for r in self.rows:
            del above[r.depth :]
            name = r.key or "(model)"
            parent = above[-1] if above else ""
            if parent and name.startswith(parent + "/"):
                name = name[len(parent) + 1 :]
            above.append(r.site)
            kind = r.type if r.method == "__call__" else f"{r.type}.{r.method}"
            rows.append(
                (
                    "  " * r.depth + name,
                    kind,
                    t(r.forward_ms),
                    t(r.backward_ms),
                    share(r.forward_ms + r.backward_ms),
                    t(r.total_ms),
                )
            )
        end = len(rows)
        rows.append(
            (
                "(other)",
                "outside call sites",
                t(self.other_forward_ms),
                t(self.other_backward_ms),
                share(self.other_ms),
                t(self.other_ms),
            )
        )
        rows.append(("(idle)", "no operation", "", "", share(self.idle_ms), t(self.idle_ms)))
        rows.append(("step", "", "", "", "100.0%", t(self.step_ms)))
        footer = (
            f"Device time of XLA operations per call site, mean of {self.runs} "
            f"run{'s' if self.runs != 1 else ''} on {self.device} (jax.profiler). Forward/"
            "Backward: the call site's own operations; Total: with the call sites inside it. "
            "Own times + other + idle = step.",
            *self.notes,
        )
        heads = ("Call site", "Type", *(f"{h} {unit}" for h in ("Forward", "Backward")))
        heads = (*heads, "Share", f"Total {unit}")
        return Grid(
            "",
            heads,
            rows,
            numeric=frozenset({2, 3, 4, 5}),
            sections=frozenset({end, end + 2}),
            footer=footer,
            styles={0: "cyan", 1: "dim"},
        )

    def __rich__(self) -> Any:
        return self.grid()

    def __str__(self) -> str:
        """The table as text at the terminal's width (natural when piped or in a notebook)."""
        from .._util.display import terminal_width

        return self.grid().text(terminal_width())

    def __repr__(self) -> str:
        return f"<hx.Profile: {counted(len(self.rows), 'call site')}, step {self.step_ms:.3f} ms>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text
        p.text(str(self))

    def _repr_html_(self) -> str:  # a notebook's table
        return self.grid().html()
