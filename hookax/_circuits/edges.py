"""``hx.Edges``: a labelled table of the residual graph's edges and their scores."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._interp.components import Components

__all__ = ["Edges"]


@dataclasses.dataclass(frozen=True)
class Edges:
    """Edges from senders to receivers, each with a score; sorted as given.

    Attributes:
      sources: each edge's sender (``"embed"``, ``"L0H3"``, ``"MLP0"``).
      destinations: each edge's receiver (``"L1H2.k"``, ``"MLP1"``, ``"logits"``).
      scores: each edge's score, a float32 numpy array.
      components: the model's parts the edges were found with (what
        [`hx.run_circuit`][hookax.run_circuit] rewires).
    """

    sources: tuple[str, ...]
    destinations: tuple[str, ...]
    scores: np.ndarray
    components: Components | None = None

    def __len__(self) -> int:
        return len(self.sources)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        """The edges as ``(source, destination)`` pairs."""
        return iter(zip(self.sources, self.destinations))

    def __getitem__(self, edge: tuple[str, str]) -> float:
        """The score of the edge ``(source, destination)``."""
        for i, e in enumerate(self):
            if e == edge:
                return float(self.scores[i])
        raise KeyError(f"no edge {edge[0]} -> {edge[1]}")

    def _take(self, order: Any) -> Edges:
        order = np.asarray(order, int)
        return Edges(
            tuple(self.sources[i] for i in order),
            tuple(self.destinations[i] for i in order),
            self.scores[order],
            self.components,
        )

    def top(self, k: int) -> Edges:
        """The ``k`` edges of largest absolute score, largest first (ties in table order)."""
        order = np.argsort(-np.abs(self.scores), kind="stable")
        return self._take(order[:k])

    def above(self, threshold: float) -> Edges:
        """The edges whose absolute score is at least ``threshold``, largest first."""
        top = self.top(len(self))
        return top._take(np.flatnonzero(np.abs(top.scores) >= threshold))

    def grid(self, title: str = "") -> Any:
        from .._util.display import Grid

        rows = [
            (s, d, f"{v:+.4g}") for s, d, v in zip(self.sources, self.destinations, self.scores)
        ]
        return Grid(
            title,
            ("Source", "Destination", "Score"),
            rows,
            numeric=frozenset({2}),
            whole=frozenset({0, 1}),
            footer=(f"{len(self)} edges",),
            styles={0: "cyan", 1: "cyan"},
        )

    def __rich__(self) -> Any:
        return self.grid()

    def __str__(self) -> str:
        """The table as text at the terminal's width."""
        from .._util.display import terminal_width

        return self.grid().text(terminal_width())

    def __repr__(self) -> str:
        return f"<hx.Edges: {len(self)} edges>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text
        p.text(str(self))

    def _repr_html_(self) -> str:  # a notebook's table
        return self.grid().html()
