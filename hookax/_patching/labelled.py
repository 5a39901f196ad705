"""``hx.LabelledArray``: a patching grid (or a logit lens) that names its axes, still an array.

A result of ``hx.patch_grid`` was a bare array: which row is which call site, which column which
position, and what the metric was on the clean and corrupted runs, lived in the caller's head.
A :class:`LabelledArray` carries them: ``labels`` (one tuple of names per axis, or None),
``axes`` (the axes' names), and ``clean`` / ``corrupted`` (the metric of the unpatched runs).

It stays an array wherever one was used. JAX no longer calls ``__jax_array__`` when it
abstracts a value (``jax.jit``'s arguments, ``jax.lax`` primitives), so an array-like object
alone is not enough; a :class:`LabelledArray` is

* a registered pytree whose one leaf is the array: ``jax.jit``, ``jax.vmap``, ``jax.grad``,
  ``jax.device_put``, ``jax.block_until_ready`` and ``jax.tree`` functions see that array, and
  a grid returned from a jitted function comes back labelled (its labels are static data);
* a Python subclass of ``jax.Array`` (``isinstance(grid, jax.Array)`` holds, as it did), its
  abstract value its array's (``jax.typeof``, which Flax NNX's transforms ask);
* with ``__jax_array__`` (every ``jax.numpy`` function takes it), ``__array__`` (NumPy and its
  testing helpers), and arithmetic, comparisons, indexing and every method and property of
  ``jax.Array`` delegated to the array, returning plain arrays.

``jax.lax`` primitives called on it eagerly still refuse it: pass ``grid.values``.

Examples:
  >>> import jax.numpy as jnp
  >>> g = LabelledArray(jnp.array([[1.0, 2.0], [3.0, 4.0]]), ("target", "position"),
  ...                   (("embed", "layers/0"), ("0", "1")), clean=4.0, corrupted=1.0)
  >>> g.rows, g.columns
  (('embed', 'layers/0'), ('0', '1'))
  >>> jnp.argmax(g), (g - 1)[1, 1], g.shape
  (Array(3, dtype=int32), Array(3., dtype=float32), (2, 2))
  >>> print(np.asarray(g.normalized()).round(2))  # (values - corrupted) / (clean - corrupted)
  [[0.   0.33]
   [0.67 1.  ]]
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._engine import eager as _eager
from .._util import jaxcompat
from .unpatched import Unpatched

__all__ = ["LabelledArray", "Unpatched", "labels_of_columns"]

Labels = tuple[tuple[str, ...] | None, ...]


@jax.tree_util.register_pytree_with_keys_class
class LabelledArray(jax.Array):
    """An array with the names of its rows and columns and the metric's clean and corrupted
    values: what [`hx.patch_grid`][hookax.patch_grid],
    [`hx.attribution_patch`][hookax.attribution_patch],
    [`hx.patch_block_every`][hookax.patch_block_every],
    [`hx.patch_head_every`][hookax.patch_head_every], [`hx.logit_lens`][hookax.logit_lens]
    and [`hx.path_patch`][hookax.path_patch] return.

    It is used as the array it holds: ``np.asarray(grid)``, ``grid[0, 2]``, ``grid - m``,
    ``jnp.abs(grid)``, ``grid.shape``, ``grid.reshape(...)``, NumPy's testing helpers, and
    ``jax.jit`` / ``jax.vmap`` (a pytree whose one leaf is the array, the labels static) all
    work, and every one of them returns a plain array. ``jax.lax`` primitives take only arrays:
    pass ``grid.values``. A grid passed whole into your own jitted function is traced again for
    each new grid (its metric values are static data); ``grid.values`` shares one trace. In a
    notebook it shows as a heatmap; printed, as a table that fits the terminal;
    [`plot`][hookax.LabelledArray.plot] draws it with matplotlib.

    Attributes:
      values: the array.
      axes: the name of each labelled axis (``("target", "position")``); axes past them (a
        metric that returns an array) have none.
      labels: for each axis of ``axes``, its entries' names, or None (an axis of numbers).
      clean: the metric of the clean run, a float (None: no metric, not a scalar, or computed
        under a transform); a grid runs the unpatched forwards the first time it is read (by
        you, a picture or ``normalized``), one small program, and until then holds the
        arrays of both runs (the model's weights and the inputs as they were at the call).
      corrupted: the metric of the corrupted run, likewise.
      delta: whether the values are changes of the metric from the corrupted run
        (``hx.attribution_patch``'s estimates) rather than the metric itself.
      title: what the values are, for pictures and tables.
    """

    __array_priority__ = 100  # NumPy's scalars and arrays defer to the reflected operators

    def __init__(
        self,
        values: Any,
        axes: Sequence[str],
        labels: Sequence[Sequence[str] | None],
        *,
        clean: Any = None,
        corrupted: Any = None,
        delta: bool = False,
        title: str = "",
        unpatched: Unpatched | None = None,
    ) -> None:
        _eager.install()  # JAX's own functions given the array (ARRAY_HOLDERS)
        self.values = values
        self.axes = tuple(axes)
        self.labels: Labels = tuple(None if ls is None else tuple(map(str, ls)) for ls in labels)
        self.unpatched = Unpatched(clean, corrupted) if unpatched is None else unpatched
        self.delta = delta
        self.title = title

    # -- pytree: the array is the one leaf, everything else static ----------------------------

    def _aux(self) -> tuple[Any, ...]:
        return (self.axes, self.labels, self.unpatched, self.delta, self.title)

    def tree_flatten_with_keys(self) -> tuple[Any, Any]:
        return ((jax.tree_util.GetAttrKey("values"), self.values),), self._aux()

    def tree_flatten(self) -> tuple[Any, Any]:
        return (self.values,), self._aux()

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: Any) -> LabelledArray:
        out = object.__new__(cls)
        out.values = children[0]
        out.axes, out.labels, out.unpatched, out.delta, out.title = aux
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (
            self.values,
            self.axes,
            self.labels,
            self.clean,
            self.corrupted,
            self.delta,
            self.title,
        )

    def replace(self, values: Any, **changes: Any) -> LabelledArray:
        """The same labels (and metric values, unless ``changes`` say otherwise) on new values
        of the same shape."""
        kw: dict[str, Any] = dict(unpatched=self.unpatched, delta=self.delta, title=self.title)
        if "clean" in changes or "corrupted" in changes:
            kw["unpatched"] = None
            changes = {"clean": self.clean, "corrupted": self.corrupted, **changes}
        kw.update(changes)
        return LabelledArray(values, self.axes, self.labels, **kw)

    @property
    def clean(self) -> float | None:
        """The metric of the clean run (None: no metric, a metric that is not a scalar, or a
        result computed inside a transform); for a grid, computed when first read."""
        return self.unpatched.get()[0]

    @property
    def corrupted(self) -> float | None:
        """The metric of the corrupted run, as ``clean``."""
        return self.unpatched.get()[1]

    # -- the labels ----------------------------------------------------------------------------

    @property
    def rows(self) -> tuple[str, ...] | None:
        """The first axis' labels (call sites, layers, components)."""
        return self.labels[0] if self.labels else None

    @property
    def columns(self) -> tuple[str, ...] | None:
        """The last labelled axis' labels (positions, heads); None for one axis."""
        return self.labels[-1] if len(self.labels) > 1 else None

    def normalized(self) -> LabelledArray:
        """``(values - corrupted) / (clean - corrupted)`` (``values / (clean - corrupted)`` for
        changes of the metric): 0 where a patch changes nothing, 1 where it restores the clean
        metric, as TransformerLens' tutorials normalise.

        Raises:
          HookaxError: the metric's clean and corrupted values are unknown (no metric, a
            metric that is not a scalar, or a grid computed under a transform) or equal.
        """
        from .._util.errors import HookaxError

        if self.clean is None or self.corrupted is None:
            raise HookaxError(
                "LabelledArray.normalized: the metric's clean and corrupted values are unknown "
                "here (a result without a scalar metric, or computed inside a transform). Fix: "
                "normalise by hand, (np.asarray(grid) - m_corrupt) / (m_clean - m_corrupt)."
            )
        span = self.clean - self.corrupted
        if span == 0:
            raise HookaxError(
                f"LabelledArray.normalized: the clean and corrupted metric are equal "
                f"({self.clean}): nothing to normalise by. Fix: a metric that tells the runs "
                f"apart."
            )
        shifted = self.values if self.delta else self.values - self.corrupted
        title = f"{self.title} (normalised)" if self.title else "normalised"
        return self.replace(shifted / span, clean=1.0, corrupted=0.0, delta=False, title=title)

    # -- an array (see the delegation below the class) -----------------------------------------

    def __jax_array__(self) -> Any:
        return self.values

    def __array__(self, dtype: Any = None, context: Any = None, copy: Any = None) -> np.ndarray:
        out = np.asarray(self.values, dtype=dtype)
        return out.copy() if copy else out

    def __getattr__(self, name: str) -> Any:  # tolist, block_until_ready, devices, aval, ...
        if name.startswith("__") or name == "values":
            raise AttributeError(name)
        return getattr(self.values, name)

    # -- display (:mod:`.picture`) ---------------------------------------------------------------

    def __repr__(self) -> str:
        from .picture import describe

        return describe(self)

    def __str__(self) -> str:
        from .picture import text

        return text(self)

    def __rich__(self) -> Any:
        from .picture import Table

        return Table(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text, coloured on a tty
        from .picture import text

        p.text(text(self, color=None))

    def _repr_html_(self) -> str | None:  # a notebook's heatmap
        from .picture import html

        return html(self)

    def plot(
        self,
        *,
        normalize: bool = False,
        ax: Any = None,
        title: str | None = None,
        cmap: str = "RdBu",
        out: str | None = None,
    ) -> Any:
        """The values as a heatmap (a matplotlib ``Figure``), rows and columns labelled, the
        colour scale diverging around the corrupted run's metric (0 for changes and for
        ``normalize=True``). Arrays of more than two labelled axes stack their leading axes
        as rows (``layers/0 H1``).

        Args:
          normalize: draw [`normalized`][hookax.LabelledArray.normalized] values.
          ax: a matplotlib ``Axes`` to draw on; default a new figure.
          title: the figure's title; default what the values are.
          cmap: a diverging matplotlib colormap.
          out: where to write a PNG.

        Raises:
          MissingExtraError: matplotlib is not installed (``hookax[plot]``).
        """
        from .picture import plot

        return plot(self, normalize=normalize, ax=ax, title=title, cmap=cmap, out=out)


# jax.Array's own methods and properties (abstract there), and the array protocol's dunders,
# each delegated to the array: whatever they return is a plain array.
_OWN = {"__doc__", "__hash__", "__module__", "__slots__", "__weakref__", "__numpy_dtype__"}
_BINARY = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
    "lshift", "rshift", "divmod",
)  # fmt: skip
_MORE = (
    "__len__", "__iter__", "__reversed__", "__bool__", "__float__", "__int__", "__complex__",
    "__index__", "__format__", "__dlpack__", "__dlpack_device__",
)  # fmt: skip


def _method(name: str) -> Callable[..., Any]:
    def method(self: LabelledArray, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.values, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _operator(name: str, reflected: bool) -> Callable[..., Any]:
    op = getattr(operator, name + "_" if name in ("and", "or") else name, None) or divmod

    def method(self: LabelledArray, other: Any) -> Any:
        other = other.values if isinstance(other, LabelledArray) else other
        return op(other, self.values) if reflected else op(self.values, other)

    method.__name__ = f"__{'r' if reflected else ''}{name}__"
    return method


for _name, _attr in vars(jax.Array).items():
    if _name in _OWN:
        continue
    if isinstance(_attr, property):
        setattr(LabelledArray, _name, property(operator.attrgetter(f"values.{_name}")))
    elif callable(_attr):
        setattr(LabelledArray, _name, _method(_name))
for _name in _MORE:
    setattr(LabelledArray, _name, _method(_name))
for _name in _BINARY:
    setattr(LabelledArray, f"__{_name}__", _operator(_name, False))
    setattr(LabelledArray, f"__r{_name}__", _operator(_name, True))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(LabelledArray, f"__{_name}__", _operator(_name, False))


def _aval(x: LabelledArray) -> Any:
    """``jax.typeof`` of a labelled array: its array's; a scalar's for one rebuilt around a
    placeholder (the prefix trees Flax NNX's transforms build), which no reference is."""
    v = x.__dict__.get("values")
    if isinstance(v, (jax.Array, np.ndarray, np.generic)):
        return jax.typeof(v)
    return jaxcompat.core.ShapedArray((), np.dtype(np.float32))


jaxcompat.register_aval(LabelledArray, _aval)
_eager.ARRAY_HOLDERS.append(LabelledArray)  # jnp.abs(grid): the array's program, every grid


def _rebuild(
    values: Any, axes: Any, labels: Any, clean: Any, corrupted: Any, delta: bool, title: str
) -> LabelledArray:
    """A pickled :class:`LabelledArray` (its metric values read before pickling)."""
    return LabelledArray(
        values, axes, labels, clean=clean, corrupted=corrupted, delta=delta, title=title
    )


def labels_of_columns(cols: Any) -> tuple[str, ...]:
    """A grid's column labels from its patches: each index (``positions="each"``, or 1-d
    indices), else the patch's number (masks, several indices, traced patches) as ``#i``."""
    n = int(np.shape(cols)[0])
    if not isinstance(cols, jax.core.Tracer) and np.ndim(cols) == 1:
        a = np.asarray(cols)
        if a.dtype.kind in "iu":
            return tuple(str(int(i)) for i in a)
    return tuple(f"#{i}" for i in range(n))
