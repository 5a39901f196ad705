"""``hx.Edges``: a labelled table of the residual graph's edges and their scores."""

from __future__ import annotations

import dataclasses
import re
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

    def plot(
        self,
        k: int | None = None,
        *,
        ax: Any = None,
        title: str | None = None,
        out: str | None = None,
    ) -> Any:
        """The graph drawn (a matplotlib ``Figure``): every node of these edges by layer, and
        the ``k`` edges of largest absolute score as arrows, their width by absolute score,
        blue for a positive score and red for a negative one.

        Rows bottom to top: the embeddings, then each layer's heads (``L1H0``: an edge into
        ``L1H0.q``, ``.k`` or ``.v`` ends at the head, dotted, dashed or solid) and its MLP,
        then the logits. Each arrow's ``gid`` is ``"source->destination"``.

        Args:
          k: how many of the top edges to draw; default every edge.
          ax: a matplotlib ``Axes`` to draw on; default a new figure.
          title: the figure's title; default how many edges it draws.
          out: where to write a PNG.

        Raises:
          MissingExtraError: matplotlib is not installed (``hookax[plot]``).
        """
        from .._util.extras import require

        require("matplotlib", "plot", "Edges.plot (it draws a chart)")
        from matplotlib.lines import Line2D
        from matplotlib.patches import FancyArrowPatch

        shown = self.top(len(self) if k is None else k)
        nodes = list(dict.fromkeys(n for e in self for n in (e[0], _node(e[1]))))
        rank = {n: _rank(n) for n in nodes}
        rows = sorted(set(rank.values()))
        row_of = {n: rows.index(rank[n]) for n in nodes}
        at: dict[str, tuple[float, int]] = {}
        width = 1
        for r in range(len(rows)):
            here = sorted(
                (n for n in nodes if row_of[n] == r), key=lambda n: (_head(n), nodes.index(n))
            )
            width = max(width, len(here))
            for i, n in enumerate(here):
                at[n] = (i - (len(here) - 1) / 2, r)
        if ax is None:
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            from .._util.figure import Figure

            fig = Figure(
                figsize=(max(5.0, 1.2 * width + 2.0), 1.1 * len(rows) + 1.0),
                dpi=100,
                layout="constrained",
            )
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
        fig = ax.figure
        top = float(np.abs(shown.scores).max()) if len(shown) else 1.0
        top = top or 1.0
        boxes = {
            n: ax.text(
                x,
                y,
                n,
                ha="center",
                va="center",
                fontsize=7,
                zorder=3,
                bbox=dict(boxstyle="round,pad=0.4", facecolor="white", edgecolor="0.3"),
            )
            for n, (x, y) in at.items()
        }
        styles: dict[str, Any] = {"q": ":", "k": "--", "v": "-"}
        bends = {"q": 0.25, "k": 0.0, "v": -0.25}
        for s, d, v in reversed(list(zip(shown.sources, shown.destinations, shown.scores))):
            kind = d.rsplit(".", 1)[1] if "." in d else ""
            (x0, y0), (x1, y1) = at[s], at[_node(d)]
            bend = bends.get(kind, 0.1)
            if y1 - y0 > 1 and abs(x1 - x0) < 0.5:  # past the nodes between them
                bend += 0.35 if bend >= 0 else -0.35
            arrow = FancyArrowPatch(
                at[s],
                at[_node(d)],
                arrowstyle="-|>",
                mutation_scale=10,
                connectionstyle=f"arc3,rad={bend}",
                linestyle=styles.get(kind, "-"),
                linewidth=0.6 + 4.4 * abs(float(v)) / top,
                color="tab:blue" if v >= 0 else "tab:red",
                alpha=0.8,
                patchA=boxes[s].get_bbox_patch(),
                patchB=boxes[_node(d)].get_bbox_patch(),
                shrinkA=1,
                shrinkB=1,
                zorder=1,
            )
            arrow.set_gid(f"{s}->{d}")
            ax.add_patch(arrow)
        ax.set_xlim(-width / 2 - 0.2, width / 2 + 0.2)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_yticks(range(len(rows)), [_row_name(r) for r in rows], fontsize=8)
        ax.set_xticks([])
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        keys = [
            Line2D([], [], color="tab:blue", label="score > 0"),
            Line2D([], [], color="tab:red", label="score < 0"),
        ] + [
            Line2D([], [], color="0.4", linestyle=st, label=f"into .{q}")
            for q, st in styles.items()
        ]
        ax.legend(handles=keys, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title(
            title if title is not None else f"the top {len(shown)} of {len(self)} edges", fontsize=9
        )
        if out is not None:
            from .._util.figure import save_png

            save_png(fig, out)
        return fig

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


_HEAD = re.compile(r"L(\d+)H\d+")
_MLP = re.compile(r"MLP(\d+)")


def _node(receiver: str) -> str:
    """The node a receiver belongs to: a head's query, key or value input is the head."""
    return receiver.rsplit(".", 1)[0] if _HEAD.fullmatch(receiver.rsplit(".", 1)[0]) else receiver


def _head(node: str) -> int:
    """A head's index in its layer (0 for every other node)."""
    m = re.fullmatch(r"L\d+H(\d+)", node)
    return int(m[1]) if m else 0


def _rank(node: str) -> float:
    """The row of a node: the embeddings 0, layer ``l``'s heads ``1 + 2l`` and its MLP
    ``2 + 2l``, the logits above every layer."""
    head, mlp = _HEAD.fullmatch(node), _MLP.fullmatch(node)
    if head:
        return 1 + 2 * int(head[1])
    if mlp:
        return 2 + 2 * int(mlp[1])
    return float("inf") if node == "logits" else 0


def _row_name(rank: float) -> str:
    if rank == 0:
        return "embeddings"
    if rank == float("inf"):
        return "logits"
    layer, part = divmod(int(rank) - 1, 2)
    return f"layer {layer} {'MLP' if part else 'heads'}"
