"""Gradient flow: per-layer gradient norms from one backward pass, and their bar chart.

:func:`layer_grad_norms` is the one place that decides what a layer's gradient norm is; today it
is the norm of the gradient of the layer's own parameters (``nnx.grad``, grouped by the module
that holds each parameter). Switching to activation gradients means changing that function only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ._extras import require

__all__ = ["layer_grad_norms", "mean_square_loss", "plot_grad_norms", "random_inputs"]


def mean_square_loss(model: Any, *inputs: Any) -> Any:
    """A loss for any model: the mean square of its floating-point outputs."""
    import jax
    import jax.numpy as jnp

    outs = [y for y in jax.tree.leaves(model(*inputs)) if jnp.issubdtype(y.dtype, jnp.inexact)]
    return sum(jnp.mean(jnp.square(y.astype(jnp.float32))) for y in outs)


def random_inputs(specs: tuple[Any, ...], seed: int = 0, int_high: int = 2) -> tuple[Any, ...]:
    """Random arrays for ``ShapeDtypeStruct`` specs: normal floats, ints in ``[0, int_high)``."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), max(len(specs), 1))
    out = []
    for key, spec in zip(keys, specs):
        if jnp.issubdtype(spec.dtype, jnp.inexact):
            out.append(jax.random.normal(key, spec.shape, spec.dtype))
        elif spec.dtype == jnp.bool_:
            out.append(jax.random.bernoulli(key, 0.5, spec.shape))
        else:
            out.append(jax.random.randint(key, spec.shape, 0, int_high, spec.dtype))
    return tuple(out)


def layer_grad_norms(
    model: Any, *inputs: Any, loss_fn: Callable[..., Any] = mean_square_loss
) -> dict[str, float]:
    """The norm of the loss gradient at each layer's output, from one backward pass.

    Keys are call-site keys in call order (``"layers/0"``; the model's own output is left out);
    a call site called several times gets the norm over all its calls. Computed with
    :func:`hookax.value_and_grad` under ``nnx.jit``: the model is not edited.
    """
    require("flax", "nnx", "hx.layer_grad_norms (it takes Flax NNX models)")
    from flax import nnx

    from ._actgrad import value_and_grad
    from ._intercept import intercept
    from ._select import Select

    order: dict[str, int] = {}

    def record(next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: Any) -> Any:
        order.setdefault(context.key, len(order))
        return next_fun(*args, **kwargs)

    grads_of = nnx.jit(lambda m, *xs: value_and_grad(loss_fn)(m, *xs)[2])
    with intercept(record, where=Select(methods="__call__")):
        act_grads = grads_of(model, *inputs)
    norms = {}
    for key in sorted(act_grads, key=lambda k: order.get(k, len(order))):
        if key == "":
            continue
        leaves = [g for g in jax_leaves(act_grads[key]) if g is not None]
        total = sum(float((g.astype("float32") ** 2).sum()) for g in leaves)
        norms[key] = math.sqrt(total)
    return norms


def jax_leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(tree)


def plot_grad_norms(norms: dict[str, float], out: str, title: str = "gradient flow") -> None:
    """Write a bar chart of ``norms`` (log axis, layers in the given order) to ``out`` (PNG)."""
    require("matplotlib", "plot", "hx.plot_grad_norms")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(norms)
    values = [v if v > 0 else float("nan") for v in norms.values()]
    fig = Figure(figsize=(max(6.0, 0.3 * len(names) + 2.0), 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(range(len(names)), values, color="tab:blue", edgecolor="tab:gray")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    ax.set_ylabel("‖∂loss/∂params‖₂ (log)")
    ax.set_xlabel("layer (call order)")
    ax.set_title(title)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, format="png")
