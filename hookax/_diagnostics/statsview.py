"""``hx.Stats``: the statistics of a step as one array, read as ``stats[key]["grad"]["norm"]``.

A jitted function returns each leaf of its result as its own device buffer, and on a CPU each
costs a few microseconds per call: the 120 scalars of ten statistics of twelve layers, as
separate leaves, cost 0.3-0.5 ms a step, more than the statistics themselves
(``benchmarks/bench_train.py``). So all of a step's statistics are one float32 array (one
buffer), and ``Stats`` is a pytree over it with the layout (keys, their leading axes, the
statistics' names) as static data. Reading ``stats[key]`` slices that array: free inside a
jitted function, one small operation outside it (fetch the whole thing first with
``jax.device_get(stats)`` to read many values: then slices are numpy's).

Outside a jitted function ``Stats`` reads as a table: one row per call site (per layer of a
scanned stack: ``blocks/lin[2]``) and kind (``act``, its output; ``grad``, d loss / d output),
one column per statistic; printed at the terminal's width, an HTML table in a notebook.
``to_dict()`` gives the same values as Python floats in plain dicts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax

__all__ = ["SiteStats", "Stats"]

KINDS = ("act", "grad")


class SiteStats(Mapping[str, dict[str, Any]]):
    """One call site's statistics: ``{"act": {name: value}, "grad": {name: value}}``.

    ``array`` is the array behind them, ``(*leading axes, 2, len(names))``: row 0 the output's
    statistics, row 1 its gradient's.
    """

    __slots__ = ("array", "names")

    def __init__(self, array: Any, names: tuple[str, ...]) -> None:
        self.array = array
        self.names = names

    def __getitem__(self, kind: str) -> dict[str, Any]:
        if kind not in KINDS:
            raise KeyError(kind)
        row = KINDS.index(kind)
        return {name: self.array[..., row, i] for i, name in enumerate(self.names)}

    def __iter__(self) -> Iterator[str]:
        return iter(KINDS)

    def __len__(self) -> int:
        return len(KINDS)

    def __repr__(self) -> str:
        if not _concrete(self.array):
            return f"SiteStats(names={self.names!r})"
        return f"SiteStats({_plain(dict(self))!r})"

    def grid(self) -> Any:
        """This call site's table (as `Stats.grid` draws it)."""
        return _grid([(None, self.array)], self.names)

    def __str__(self) -> str:
        return _text(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text
        p.text(str(self) if _concrete(self.array) else repr(self))

    def _repr_html_(self) -> str | None:  # a notebook's table
        return self.grid().html() if _concrete(self.array) else None


@jax.tree_util.register_pytree_node_class
class Stats(Mapping[str, SiteStats]):
    """Per-call-site statistics of one step (``hx.value_grad_and_stats``): a mapping
    from call-site key, in the order the call sites finished, to a ``SiteStats``.

    A pytree with a single leaf, ``array`` (float32, the statistics of every call site one
    after the other, under any batch axes a ``vmap`` around the step added), so it leaves a
    jitted step as one buffer. ``layout`` holds each key's leading axes (one per layer of a
    scan, per call of a call site called several times, per example of a ``vmap`` inside the
    model); ``names`` the statistics.
    """

    __slots__ = ("array", "layout", "names")

    def __init__(self, array: Any, layout: tuple[tuple[str, tuple[int, ...]], ...], names: Any):
        self.array = array
        self.layout = layout
        self.names = tuple(names)

    def _span(self, key: str) -> tuple[int, int, tuple[int, ...]]:
        start = 0
        per = 2 * len(self.names)
        for k, lead in self.layout:
            size = math.prod(lead) * per
            if k == key:
                return start, size, lead
            start += size
        raise KeyError(key)

    def __getitem__(self, key: str) -> SiteStats:
        start, size, lead = self._span(key)
        v = self.array[..., start : start + size]
        batch = tuple(self.array.shape[:-1])
        return SiteStats(v.reshape(*batch, *lead, 2, len(self.names)), self.names)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self.layout)

    def __len__(self) -> int:
        return len(self.layout)

    def __repr__(self) -> str:
        keys = ", ".join(repr(k) for k in self)
        return f"Stats(keys=[{keys}], names={self.names!r})"

    def to_dict(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The same values as plain nested dicts ``{key: {"act": {...}, "grad": {...}}}``: a
        float per statistic (nested lists of floats under a scan's or a ``vmap``'s leading
        axes). Inside a jitted function, where the values are not known yet, the arrays.

        Examples:
          >>> import numpy as np
          >>> stats = Stats(np.arange(4.0), (("lin", ()),), ("norm", "mean"))
          >>> stats.to_dict()
          {'lin': {'act': {'norm': 0.0, 'mean': 1.0}, 'grad': {'norm': 2.0, 'mean': 3.0}}}
          >>> print(stats)
          Key  Kind  norm  mean
          ─────────────────────
          lin  act      0     1
               grad     2     3
        """
        out = {key: dict(site) for key, site in self.items()}
        return _plain(out) if _concrete(self.array) else out

    def grid(self) -> Any:
        """The table (a ``hookax._util.display.Grid``): a row per call site, per layer of a
        scan and per kind (``act``, ``grad``), a column per statistic."""
        return _grid([(key, site.array) for key, site in self.items()], self.names)

    def __str__(self) -> str:
        return _text(self)

    def __rich__(self) -> Any:
        return self.grid()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text
        p.text(str(self) if _concrete(self.array) else repr(self))

    def _repr_html_(self) -> str | None:  # a notebook's table
        return self.grid().html() if _concrete(self.array) else None

    def tree_flatten(self) -> tuple[tuple[Any], tuple[Any, ...]]:
        return (self.array,), (self.layout, self.names)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: Any) -> Stats:
        out = object.__new__(cls)
        out.array = children[0]
        out.layout, out.names = aux
        return out


def _concrete(array: Any) -> bool:
    """Whether ``array``'s values are known (not a tracer inside a jitted function)."""
    return not isinstance(array, jax.core.Tracer)


def _plain(tree: Any) -> Any:
    """``tree`` with every array as a Python float (or nested lists of floats)."""
    import numpy as np

    if isinstance(tree, dict):  # jax.tree.map would sort the keys
        return {k: _plain(v) for k, v in tree.items()}
    return np.asarray(tree, dtype=np.float64).tolist()


def _grid(sites: list[tuple[str | None, Any]], names: tuple[str, ...]) -> Any:
    """The table of `Stats.grid`: each key, each index of its leading axes, each kind."""
    import numpy as np

    from .._util.display import Grid

    rows: list[tuple[str, ...]] = []
    for key, array in sites:
        a = np.asarray(array, dtype=np.float64)
        for index in np.ndindex(*a.shape[:-2]):
            name = "" if key is None else key or "(model)"  # None: one site, no name
            label = name + "".join(f"[{i}]" for i in index)
            for row, kind in enumerate(KINDS):
                cells = tuple(f"{v:.4g}" for v in a[(*index, row)])
                rows.append((label if row == 0 else "", kind, *cells))
    numeric = frozenset(range(2, 2 + len(names)))
    return Grid("", ("Key", "Kind", *names), rows, numeric=numeric, boxed=False, styles={0: "cyan"})


def _text(stats: Any) -> str:
    from .._util.display import terminal_width

    if not _concrete(stats.array):
        return repr(stats)
    return stats.grid().text(terminal_width())
