"""Gradient flow: per-layer gradients from one backward pass, and their two-panel figure.

Two things are measured, from the same backward pass ([`hx.value_and_grad`][hookax.value_and_grad]):

* **d loss / d (layer output)**: the 2-norm of the gradient with respect to each call site's
  output (``layer_grad_norms``). A call site inside a scan over layers is one value per layer
  (stacked on the scan axis), shown as ``layers[3]/mlp``.
* **d loss / d (parameters)**: the mean and the largest absolute value of the gradient of each
  module's own parameters (``param_grad_stats``), the two series of the familiar
  ``plot_grad_flow`` figures. Parameter-free models have none.

``plot_grad_flow`` draws both on log axes that span every value (markers, not bars: a bar on a
log axis is measured from an arbitrary floor and exaggerates ratios); zero and non-finite
gradients are drawn as their own markers, never dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._util.words import counted

if TYPE_CHECKING:
    from .._engine.select import Where

__all__ = [
    "GradFlow",
    "grad_flow",
    "layer_grad_norms",
    "mean_square_loss",
    "param_grad_stats",
    "plot_grad_flow",
    "random_inputs",
]

OUTPUT_LABEL = "‖∂loss/∂(layer output)‖₂"
PARAM_LABEL = "|∂loss/∂params| of the layer"


def mean_square_loss(model: Any, *inputs: Any, **kwargs: Any) -> Any:
    """A loss for any model: the mean square of its floating-point outputs."""
    import jax
    import jax.numpy as jnp

    outs = [
        y for y in jax.tree.leaves(model(*inputs, **kwargs)) if jnp.issubdtype(y.dtype, jnp.inexact)
    ]
    return sum(jnp.mean(jnp.square(y.astype(jnp.float32))) for y in outs)


def random_inputs(specs: tuple[Any, ...], seed: int = 0, int_high: int = 2) -> tuple[Any, ...]:
    """Random arrays for ``ShapeDtypeStruct`` specs: normal floats, ints in ``[0, int_high)``;
    specs inside a pytree (a NamedArray, a dict) are replaced in place.

    Leaves that are not specs (arrays, ints, bools, None, PRNG keys) are passed through.
    """
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(specs)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
    out: list[Any] = []
    for key, spec in zip(keys, leaves):
        if not isinstance(spec, jax.ShapeDtypeStruct):
            out.append(spec)
        elif jnp.issubdtype(spec.dtype, jax.dtypes.prng_key):
            out.append(jax.random.key(seed))
        elif jnp.issubdtype(spec.dtype, jnp.inexact):
            out.append(jax.random.normal(key, spec.shape, spec.dtype))
        elif spec.dtype == jnp.bool_:
            out.append(jax.random.bernoulli(key, 0.5, spec.shape))
        else:
            out.append(jax.random.randint(key, spec.shape, 0, int_high, spec.dtype))
    return tuple(jax.tree.unflatten(treedef, out))


@dataclasses.dataclass(frozen=True)
class GradFlow:
    """One backward pass, summarised per layer (keys in call order).

    Attributes:
      outputs: call-site label -> 2-norm of d loss / d (its output), all its calls together.
      params: module label -> (mean, max) of the absolute values of d loss / d (its own
        parameters); empty for a model without parameters.
    """

    outputs: dict[str, float]
    params: dict[str, tuple[float, float]]

    def grid(self) -> Any:
        """The table (a ``hookax._util.display.Grid``): one row per layer, the values
        to 4 significant digits."""
        from .._util.display import Grid

        rows = []
        for key in [*self.outputs, *(k for k in self.params if k not in self.outputs)]:
            out = self.outputs.get(key)
            mean, top = self.params.get(key, (None, None))
            rows.append((key or "(model)", *(_g(v) for v in (out, mean, top))))
        sites = counted(len(self.outputs), "call site")
        title = f"Gradient flow: {sites}, {len(self.params)} with parameters"
        heads = ("Layer", "‖∂loss/∂output‖₂", "mean |∂loss/∂params|", "max |∂loss/∂params|")
        return Grid(title, heads, rows, numeric=frozenset({1, 2, 3}), styles={0: "cyan"})

    def __str__(self) -> str:
        """The table as text at the terminal's width (natural when piped or in a notebook)."""
        from .._util.display import terminal_width

        return self.grid().text(terminal_width())

    def __repr__(self) -> str:
        norms = [v for v in self.outputs.values() if math.isfinite(v)]
        span = f"; ‖∂loss/∂output‖₂ {_g(min(norms))} to {_g(max(norms))}" if norms else ""
        return (
            f"<hx.GradFlow: {counted(len(self.outputs), 'call site')}, {len(self.params)} with "
            f"parameters{span}>"
        )

    def __rich__(self) -> Any:
        return self.grid()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text
        p.text(str(self))

    def _repr_html_(self) -> str:  # a notebook: the figure (when matplotlib is there), the table
        import importlib.util

        table = self.grid().html()
        if importlib.util.find_spec("matplotlib") is None or not (self.outputs or self.params):
            return table
        from .._util.figure import png_html

        return png_html(plot_grad_flow(self)) + "\n" + table


def _g(v: float | None) -> str:
    """A gradient statistic to 4 significant digits (``-`` when there is none)."""
    return "-" if v is None else f"{v:.4g}"


def layer_grad_norms(
    model: Any,
    *inputs: Any,
    loss_fn: Callable[..., Any] = mean_square_loss,
    where: Where = None,
    **kwargs: Any,
) -> dict[str, float]:
    """The 2-norm of the loss gradient at each layer's output, from one backward pass.

    Keys are call-site keys in call order (``"layers/0"``; the model's own output is left out);
    a call site called several times gets the norm over all its calls; a call site inside a
    scan over layers gets one key per layer (``"layers[3]/mlp"``). Computed with
    [`hx.value_and_grad`][hookax.value_and_grad] under ``nnx.jit``: the model is not edited.

    Args:
      model: a Flax NNX or Equinox module.
      *inputs: its positional arguments (arrays).
      loss_fn: ``loss_fn(model, *inputs, **kwargs) -> scalar``; by default the mean square of
        the model's floating-point outputs.
      where: which call sites (any ``where=`` selector); default every module's ``__call__``.
      **kwargs: keyword arguments of the model.

    Returns:
      ``{label: norm}`` in call order.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs))
      >>> norms = layer_grad_norms(model, jnp.ones((2, 3)))
      >>> list(norms)
      ['layers/0', 'layers/1']
      >>> all(v > 0 for v in norms.values())
      True
    """
    return grad_flow(model, *inputs, loss_fn=loss_fn, where=where, **kwargs).outputs


def param_grad_stats(
    model: Any, *inputs: Any, loss_fn: Callable[..., Any] = mean_square_loss, **kwargs: Any
) -> dict[str, tuple[float, float]]:
    """Mean and max of ``|d loss / d (parameters)|`` of each module's own parameters.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs))
      >>> list(param_grad_stats(model, jnp.ones((2, 3))))
      ['layers/0', 'layers/1']
    """
    return grad_flow(model, *inputs, loss_fn=loss_fn, **kwargs).params


def grad_flow(
    model: Any,
    *inputs: Any,
    loss_fn: Callable[..., Any] = mean_square_loss,
    where: Where = None,
    **kwargs: Any,
) -> GradFlow:
    """Both measurements of one backward pass (see [`hx.GradFlow`][hookax.GradFlow]).

    ``model`` is a Flax NNX or Equinox module, or a Linen module bound to its variables
    (``module.bind(variables)``: the gradients are taken with respect to its ``params``).
    """
    fw = _framework(model)
    layout = _Layout.of(fw, model, inputs, kwargs, loss_fn)
    grads, act_grads = fw.gradients(loss_fn, where, model, inputs, kwargs)
    if where is not None and not act_grads:
        from .._util.errors import SelectorError

        keys = ", ".join(repr(k) for k in list(layout.keys)[1:6]) or "none"
        raise SelectorError(
            f"where={where!r} matches no call site of {type(model).__name__} (its call sites: "
            f"{keys}{', ...' if len(layout.keys) > 6 else ''}). Fix: a glob over those keys."
        )
    outputs = {
        label: math.sqrt(sum(_sum_sq(g) for g in leaves))
        for label, leaves in layout.labelled((k, v) for k, v in act_grads.items() if k != "")
    }
    return GradFlow(outputs, _param_stats(fw.param_grads(grads), layout))


class _Jitted:
    """A framework whose models are arguments of its own jit (NNX, Equinox)."""

    @staticmethod
    def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
        raise NotImplementedError

    @classmethod
    def gradients(
        cls, loss_fn: Any, where: Any, model: Any, inputs: tuple, kwargs: dict
    ) -> tuple[Any, dict[str, Any]]:
        """``(grads, act_grads)`` of ``hx.value_and_grad``, jitted the framework's way."""
        from .._capture.actgrad import value_and_grad

        run = cls.jit(lambda m, *xs, **kw: value_and_grad(loss_fn, where=where)(m, *xs, **kw)[1:])
        return run(model, *inputs, **kwargs)


class _NNX(_Jitted):
    """How gradflow splits, jits and reads the gradients of a Flax NNX model."""

    @staticmethod
    def split(model: Any) -> tuple[Any, Callable[[Any], Any]]:
        from flax import nnx

        graphdef, state = nnx.split(model)
        return state, lambda state: nnx.merge(graphdef, state)

    @staticmethod
    def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
        from flax import nnx

        return nnx.jit(fn)

    @staticmethod
    def param_grads(grads: Any) -> dict[str, list[Any]]:
        """Module key -> gradients of its own parameters."""
        from flax import nnx

        from .._engine.context import path_str

        out: dict[str, list[Any]] = {}
        for path, value in nnx.to_flat_state(grads):
            g = value.get_value() if hasattr(value, "get_value") else value
            out.setdefault(path_str(tuple(path[:-1])), []).append(g)
        return out


class _Equinox(_Jitted):
    """How gradflow splits, jits and reads the gradients of an Equinox model."""

    @staticmethod
    def split(model: Any) -> tuple[Any, Callable[[Any], Any]]:
        import equinox as eqx

        dyn, static = eqx.partition(model, eqx.is_array)
        return dyn, lambda dyn: eqx.combine(dyn, static)

    @staticmethod
    def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
        import equinox as eqx

        return eqx.filter_jit(fn)

    @staticmethod
    def param_grads(grads: Any) -> dict[str, list[Any]]:
        import equinox as eqx
        import jax

        from .._engine.context import path_str
        from ..frameworks import _equinox

        out: dict[str, list[Any]] = {}
        for path, module in _equinox.ADAPTER.iter_modules(grads):
            is_sub = lambda x, m=module: x is not m and isinstance(x, eqx.Module)  # noqa: E731
            own = [x for x in jax.tree.leaves(module, is_leaf=is_sub) if eqx.is_inexact_array(x)]
            if own:
                out[path_str(path)] = own
        return out


class _Linen:
    """How gradflow splits, differentiates and reads the gradients of a bound Linen module."""

    @staticmethod
    def split(model: Any) -> tuple[Any, Callable[[Any], Any]]:
        module, variables = model.unbind()
        return variables, module.bind

    @classmethod
    def gradients(
        cls, loss_fn: Any, where: Any, model: Any, inputs: tuple, kwargs: dict
    ) -> tuple[Any, dict[str, Any]]:
        import jax

        from .._capture.actgrad import value_and_grad

        variables, bind = cls.split(model)
        params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}

        def loss(params: Any, *xs: Any) -> Any:  # keyword arguments stay Python values
            return loss_fn(bind({"params": params, **rest}), *xs, **kwargs)

        run = jax.jit(lambda p, *xs: value_and_grad(loss, where=where)(p, *xs)[1:])
        return run(params, *inputs)

    @staticmethod
    def param_grads(grads: Any) -> dict[str, list[Any]]:
        """Module key (``"Dense_0"``, ``"block/Dense_1"``) -> gradients of its own parameters."""
        import jax

        from .._engine.context import path_str

        out: dict[str, list[Any]] = {}
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path[:-1])
            out.setdefault(path_str(keys), []).append(g)
        return out


def _framework(model: Any) -> Any:
    import sys

    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(model, nnx.Module):
        return _NNX
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(model, eqx.Module):
        return _Equinox
    nn = sys.modules.get("flax.linen")
    if nn is not None and isinstance(model, nn.Module):
        if model.scope is not None:
            return _Linen
        from .._engine.adapters import linen_needs_variables

        raise linen_needs_variables("gradient flow", model)
    from .._util.errors import HookaxError

    raise HookaxError(
        f"gradient flow takes a Flax NNX or Equinox model or a bound Linen module, got "
        f"{type(model).__name__}."
    )


def _sum_sq(g: Any) -> float:
    return float((g.astype("float32") ** 2).sum())


def _param_stats(grads: dict[str, list[Any]], layout: _Layout) -> dict[str, tuple[float, float]]:
    stats: dict[str, tuple[float, float]] = {}
    for label, leaves in layout.labelled(grads.items()):
        n = sum(int(g.size) for g in leaves)
        total = sum(float(abs(g.astype("float32")).sum()) for g in leaves)
        top = max(float(abs(g.astype("float32")).max()) for g in leaves)
        stats[label] = (total / max(n, 1), top)
    return stats


@dataclasses.dataclass
class _Layout:
    """Call order of the call sites, and which run inside a scan (from one abstract trace)."""

    keys: dict[str, int]  # key -> call order
    scanned: dict[str, tuple[str, int]]  # key -> (key of the scanned module, trip count)

    @classmethod
    def of(
        cls,
        fw: Any,
        model: Any,
        inputs: tuple,
        kwargs: dict,
        loss_fn: Callable[..., Any] = mean_square_loss,
    ) -> _Layout:
        from .._summary import cost
        from .._summary.trace import Flat, abstract, trace_whole

        state, merge = fw.split(model)
        flat = Flat.of((inputs, kwargs))

        def loss(state: Any, dynamic: list[Any]) -> Any:
            a, k = flat.rebuild(dynamic)
            return loss_fn(merge(state), *a, **k)

        whole = trace_whole(loss, (abstract(state), flat.dynamic), lambda *_: None)
        trips = cost.site_trips(whole.traced.jaxpr.jaxpr)
        keys: dict[str, int] = {}
        scanned: dict[str, tuple[str, int]] = {}
        outer: dict[str, str] = {}  # key inside a scan -> the outermost scanned key around it
        for i, rec in enumerate(whole.records):
            keys.setdefault(rec.key, i)
            n = trips.get(i, 1)
            if n is not None and n > 1 and rec.key not in scanned:
                parent = next(
                    (outer[k] for k in outer if rec.key.startswith(k + "/") or rec.key == k),
                    rec.key,
                )
                outer[rec.key] = parent
                scanned[rec.key] = (parent, n)
        return cls(keys, scanned)

    def labelled(self, items: Any) -> list[tuple[str, list[Any]]]:
        """``(key, value)`` pairs as ``(label, leaves)`` in call order, one per layer of a scan.

        Layers of a scan are interleaved: ``layers[0]``, ``layers[0]/mlp``, ``layers[1]``, ...
        """
        import jax

        out = []
        for key, value in items:
            leaves = [g for g in jax.tree.leaves(value) if g is not None]
            order = self.keys.get(key, len(self.keys))
            parent, n = self.scanned.get(key, (key, 1))
            if n > 1 and leaves and all(g.ndim and g.shape[0] == n for g in leaves):
                first = self.keys.get(parent, order)
                for i in range(n):
                    out.append(
                        ((first, i, order), _layer_label(key, parent, i), [g[i] for g in leaves])
                    )
            else:
                out.append(((order, -1, order), key, leaves))
        return [(label, leaves) for _, label, leaves in sorted(out, key=lambda t: t[0])]


def _layer_label(key: str, parent: str, i: int) -> str:
    """``layers/mlp`` in the scan over ``layers``, layer 3: ``layers[3]/mlp``."""
    return f"{parent}[{i}]{key[len(parent) :]}"


def check_writable(out: str) -> None:
    """Raise ``OSError`` now if ``out`` cannot be written (before any backward pass runs)."""
    import os

    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise IsADirectoryError(21, "is a directory", out)
    if not os.path.isdir(folder):
        raise FileNotFoundError(2, "no such directory", folder)
    target = out if os.path.exists(out) else folder
    if not os.access(target, os.W_OK):
        raise PermissionError(13, "permission denied", target)


def plot_grad_flow(flow: GradFlow, out: str | None = None, title: str = "gradient flow") -> Any:
    """The figure of ``flow`` (matplotlib ``Figure``), written to ``out`` (PNG) when given.

    A notebook shows the figure as an image (it is not one of pyplot's figures: nothing else
    shows it, and it is freed with the last reference to it).

    Top panel: d loss / d (layer output) per call site; bottom panel (models with parameters):
    mean and max of |d loss / d params| per layer. Log axes span whole decades around every
    value; zero and non-finite values are marked at the bottom of the axis.
    """
    from .._util.extras import require

    require("matplotlib", "plot", "hx.plot_grad_flow (it draws a chart)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from .._util.figure import Figure, save_png

    panels: list[tuple[dict[str, list[float]], str]] = [
        ({"‖grad‖₂": list(flow.outputs.values())}, OUTPUT_LABEL)
    ]
    names = [list(flow.outputs)]
    if flow.params:
        values = list(flow.params.values())
        panels.append(
            ({"mean": [m for m, _ in values], "max": [x for _, x in values]}, PARAM_LABEL)
        )
        names.append(list(flow.params))
    width = max(6.0, 0.3 * max(len(n) for n in names) + 2.0)
    fig = Figure(figsize=(width, 3.6 * len(panels) + 1.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (series, ylabel), labels in zip(axes, panels, names):
        _panel(ax, labels, series, ylabel)
    axes[0].set_title(title)
    axes[-1].set_xlabel("layer (call order)")
    fig.tight_layout()
    if out is not None:
        save_png(fig, out)
    return fig


def _panel(ax: Any, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    xs = range(len(labels))
    finite = [v for vs in series.values() for v in vs if math.isfinite(v) and v > 0]
    lo = 10.0 ** math.floor(math.log10(min(finite))) if finite else 1e-8
    hi = 10.0 ** math.ceil(math.log10(max(finite))) if finite else 1.0
    lo = lo / 10 if finite and lo >= min(finite) * 0.999 else lo  # no marker on the edge
    hi = hi * 10 if finite and hi <= max(finite) * 1.001 else hi
    markers = {"‖grad‖₂": ("o", "tab:blue"), "mean": ("o", "tab:blue"), "max": ("^", "tab:orange")}
    legend = len(series) > 1
    for name, values in series.items():
        marker, color = markers[name]
        shown = [v if math.isfinite(v) and v > 0 else math.nan for v in values]
        ax.plot(xs, shown, marker=marker, color=color, linestyle="-", linewidth=0.8, label=name)
        zeros = [i for i, v in enumerate(values) if v == 0]
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        legend = legend or bool(zeros or bad)
        if zeros:
            ax.plot(zeros, [lo] * len(zeros), "v", color="tab:gray", label=f"{name} = 0")
        if bad:
            ax.plot(bad, [hi] * len(bad), "X", color="tab:red", label=f"{name} not finite")
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    ax.set_ylabel(ylabel + " (log)")
    ax.grid(axis="y", which="both", alpha=0.3)
    if legend:
        ax.legend(fontsize=7)
