"""``hx.show``: captured values as a table of names, shapes and statistics, not of numbers.

A capture's ``acts`` is a plain ``dict`` (``{key: (value per call, ...)}``): printed, it is every
number of every array. ``hx.show(acts)`` is its overview: one row per array with its shape,
dtype, mean, standard deviation, minimum and maximum (4 significant digits), as text at the
terminal's width and as an HTML table in a notebook; the values stay in ``acts``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._util.words import counted

__all__ = ["ValueRow", "Values", "show"]


@dataclasses.dataclass(frozen=True)
class ValueRow:
    """One array of ``show``'s table.

    Attributes:
      name: the call-site key (``"(model)"`` for the model's own), ``#i`` for its i-th call
        when it ran several times, then the path of a leaf inside a pytree output.
      shape: the array's shape.
      dtype: its dtype's name (a leaf that is not an array: its type's name).
      mean, std, min, max: its statistics over every element, as floats (None for an
        abstract value or an empty array; NaN when the array holds NaN).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    mean: float | None
    std: float | None
    min: float | None
    max: float | None


class Values:
    """The overview [`hx.show`][hookax.show] returns: ``rows`` (``ValueRow``), a table when printed,
    an HTML table in a notebook."""

    def __init__(self, rows: list[ValueRow]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def grid(self) -> Any:
        from .._util.display import Grid

        rows = [
            (r.name, _spec(r), *(_g(v) for v in (r.mean, r.std, r.min, r.max))) for r in self.rows
        ]
        heads = ("Name", "Shape", "Mean", "Std", "Min", "Max")
        return Grid("", heads, rows, numeric=frozenset({2, 3, 4, 5}), styles={0: "cyan"})

    def __str__(self) -> str:
        from .._util.display import terminal_width

        return self.grid().text(terminal_width())

    def __repr__(self) -> str:
        return f"<hx.Values: {counted(len(self.rows), 'array')}>"

    def __rich__(self) -> Any:
        return self.grid()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text
        p.text(str(self))

    def _repr_html_(self) -> str:  # a notebook's table
        return self.grid().html()


def _spec(r: ValueRow) -> str:
    """``f32[2,32,64]``, as hookax writes shapes everywhere."""
    from .._util.specs import format_spec

    try:
        return format_spec(r.shape, r.dtype)
    except TypeError:  # not an array: its type's name
        return r.dtype


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def show(values: Any) -> Any:
    """An overview of captured values: one row per array, with its shape and statistics; or the
    table of any other hookax result.

    Args:
      values: what [`hx.capture`][hookax.capture] returned (``{key: (value per call, ...)}``),
        any pytree of arrays (rows named by their paths), or a hookax result that is a table
        of its own ([`hx.Stats`][hookax.Stats], [`hx.Summary`][hookax.Summary],
        [`hx.Ops`][hookax.Ops], [`hx.Profile`][hookax.Profile],
        [`hx.GradFlow`][hookax.GradFlow], [`hx.Nonfinite`][hookax.Nonfinite], a grid's
        [`hx.LabelledArray`][hookax.LabelledArray], ...).

    Returns:
      For arrays, a [`hx.Values`][hookax.Values]; for a hookax result, the result itself.
      Either prints as a table at the terminal's width and shows as an HTML table in a notebook.
      The arrays themselves stay in ``values``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu)
      >>> y, acts = hx.capture(model)(jnp.ones((4, 2)))
      >>> [(r.name, r.shape, r.dtype) for r in hx.show(acts).rows]
      [('(model)', (4, 3), 'float32'), ('layers/0', (4, 3), 'float32')]
      >>> hx.show({"x": jnp.arange(4.0)}).rows[0].mean
      1.5
      >>> s = hx.summary(model, jnp.ones((4, 2)))
      >>> hx.show(s) is s  # a hookax result shows its own table
      True
    """
    if _is_result(values):
        return values
    named: list[tuple[str, Any]] = []
    if isinstance(values, dict) and all(isinstance(v, tuple) for v in values.values()):
        for key, calls in values.items():  # a capture's acts: one tuple of calls per key
            for i, out in enumerate(calls):
                name = (str(key) or "(model)") + (f"#{i}" if len(calls) > 1 else "")
                named += _leaves(name, out)
    else:
        named = _leaves("", values)
    return Values([_row(name, leaf) for name, leaf in named])


def _is_result(obj: Any) -> bool:
    """Whether ``obj`` is a hookax result that draws its own table (``hx.Stats``, ``hx.Summary``,
    ``hx.Ops``, ...): an object of a hookax class with a notebook display of its own."""
    return type(obj).__module__.startswith("hookax.") and hasattr(obj, "_repr_html_")


def _leaves(prefix: str, tree: Any) -> list[tuple[str, Any]]:
    import jax

    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [_part(p) for p in path]
        out.append(("/".join([prefix, *parts] if prefix else parts) or "(value)", leaf))
    return out


def _part(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _row(name: str, leaf: Any) -> ValueRow:
    import numpy as np

    shape = tuple(getattr(leaf, "shape", ()))
    dtype = getattr(leaf, "dtype", None)
    dname = np.dtype(dtype).name if dtype is not None else type(leaf).__name__
    stats: list[float | None] = [None] * 4
    try:
        a = np.asarray(leaf)
    except Exception:  # a tracer: no statistics
        a = None
    # numbers (bfloat16 and the other ml_dtypes are kind "V"); not an abstract value ("O")
    if a is not None and a.size and a.dtype.kind in "biufV":
        x = a.astype(np.float32 if a.dtype.kind == "V" else a.dtype).astype(np.float64)
        stats = [float(x.mean()), float(x.std()), float(x.min()), float(x.max())]
    return ValueRow(name, shape, dname, *stats)
