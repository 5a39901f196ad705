"""``hx.splice_eval``: the loss with a call site's output replaced, against the clean and the
zero-ablated loss (the standard evaluation of a sparse autoencoder spliced into a model).

The replacement is a scoped forward hook (``hx.hooks(where=..., forward=...)``) entered inside
the jitted loss: the model is not edited, and the three programs (clean, spliced, zeroed) are
each compiled once for all batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from .._engine.select import Where
from .._util.errors import HookaxError
from ..frameworks._functions import as_program

__all__ = ["Splice", "splice_eval"]


@dataclasses.dataclass(frozen=True)
class Splice:
    """What [`hx.splice_eval`][hookax.splice_eval] measured, averaged over the batches.

    Attributes:
      loss: the model's own loss.
      spliced_loss: the loss with the call site's output replaced by ``replace(output)``.
      zero_loss: the loss with the call site's output replaced by zeros.
      recovered: the fraction of the loss recovered, ``(zero_loss - spliced_loss) /
        (zero_loss - loss)``: 1 when the replacement is exact, 0 when it is no better than
        zeros.
      batches: batches evaluated.
    """

    loss: float
    spliced_loss: float
    zero_loss: float
    recovered: float
    batches: int


def _jit(fn: Callable[..., Any], model: Any) -> Callable[..., Any]:
    import jax

    from .._capture.actgrad import is_nnx_module

    if is_nnx_module(model):  # an argument of jax.jit (nnx.split state if no pytree)
        from .._util import nnxsplit

        jitted = jax.jit(lambda packed, batch: fn(nnxsplit.lower(packed), batch))
        return lambda model, batch: jitted(nnxsplit.lift(model), batch)
    try:
        import equinox as eqx
    except ImportError:
        return jax.jit(fn)
    return eqx.filter_jit(fn)


def _total(value: Any) -> tuple[Any, Any]:
    """``(sum, count)`` of what ``loss_fn`` returned: a mean (count 1) or a ``(sum, count)``."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise HookaxError(
                f"hx.splice_eval: loss_fn returned a tuple of {len(value)}; it returns a scalar "
                f"loss or a (loss sum, count) pair."
            )
        return value
    return value, 1.0


def splice_eval(
    loss_fn: Callable[[Any, Any], Any],
    model: Any,
    batches: Iterable[Any],
    *,
    where: Where,
    replace: Callable[[Any], Any],
) -> Splice:
    """Evaluate ``loss_fn`` with the output of the ``where=`` call site replaced.

    Three jitted losses over every batch: the model's own; with each selected call site's output
    replaced by ``replace(output)`` (a sparse autoencoder's reconstruction); and with it replaced
    by zeros. ``replace`` is traced into the program, its arrays as constants (compiled once per
    [`hx.splice_eval`][hookax.splice_eval] call).

    Args:
      loss_fn: ``loss_fn(model, batch)``: a scalar mean loss (batches count equally), or a
        ``(loss sum, count)`` pair (every counted token counts equally, e.g. with padding).
      model: the model, passed to ``loss_fn`` as an argument (of ``jax.jit`` for an NNX
        module, of ``eqx.filter_jit`` otherwise: any pytree, such as Linen variables).
      batches: an iterable of batches; iterated once.
      where: the call site(s) to replace (as [`hx.hooks`][hookax.hooks]: its ``__call__``).
      replace: ``replace(output) -> new output`` of the same shape.

    Returns:
      A [`hx.Splice`][hookax.Splice] with the three losses and the fraction recovered.

    Raises:
      SelectorError: ``where=`` matches no call site that ``loss_fn`` runs (from
        [`hx.hooks`][hookax.hooks], naming the call sites that ran).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 1, rngs=rngs))
      >>> def loss_fn(model, x):
      ...     return ((model(x) - 1.0) ** 2).mean()
      >>> batches = [jnp.ones((8, 4)) * i for i in range(3)]
      >>> r = hx.splice_eval(loss_fn, model, batches, where="layers/0", replace=lambda y: y)
      >>> r.recovered, r.spliced_loss == r.loss
      (1.0, True)
      >>> zero = hx.splice_eval(
      ...     loss_fn, model, batches, where="layers/0", replace=lambda y: 0 * y
      ... )
      >>> zero.recovered
      0.0
    """
    loss_fn = as_program(loss_fn)  # a program without modules: its own call sites
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .._hooks.hooks import hooks

    def swap(module: Any, args: Any, output: Any) -> Any:
        return replace(output)

    def zero(module: Any, args: Any, output: Any) -> Any:
        return jax.tree.map(jnp.zeros_like, output)

    def clean(model: Any, batch: Any) -> Any:
        return _total(loss_fn(model, batch))

    def spliced(model: Any, batch: Any) -> Any:
        with hooks(where=where, forward=swap):
            return _total(loss_fn(model, batch))

    def zeroed(model: Any, batch: Any) -> Any:
        with hooks(where=where, forward=zero):
            return _total(loss_fn(model, batch))

    runs = [_jit(f, model) for f in (clean, spliced, zeroed)]
    sums = np.zeros(3)
    counts = np.zeros(3)
    n = 0
    for batch in batches:
        for i, run in enumerate(runs):
            total, count = run(model, batch)  # a where= matching nothing: SelectorError
            sums[i] += float(total)
            counts[i] += float(count)
        n += 1
    if n == 0:
        raise HookaxError("hx.splice_eval: batches is empty: there is nothing to evaluate.")
    loss, spliced_loss, zero_loss = (sums / counts).tolist()
    gap = zero_loss - loss
    recovered = (zero_loss - spliced_loss) / gap + 0.0 if gap != 0 else float("nan")  # no -0.0
    return Splice(loss, spliced_loss, zero_loss, recovered, n)
