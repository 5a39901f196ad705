"""``hx.find_nonfinite``: the first call site whose output or gradient holds a NaN or an Inf.

One compiled pass of the loss and its gradient with the ``"nonfinite"`` statistic
(``hookax._diagnostics.stats``) gives, for every selected call site (and every layer of a
scanned stack), the count of non-finite values in its output and in d loss / d (its output).
The answer is the first non-zero count in execution order: the forward pass in the order the
call sites finished (a layer's sublayers before the layer; the layers of a scan one after the
other), then the backward pass, which visits them in reverse.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._capture import actgrad as _actgrad
from .._capture import capture as _capture
from .._util.errors import HookaxError
from . import stats as _stats

__all__ = ["Nonfinite", "find_nonfinite"]

WHO = "hx.find_nonfinite"


@dataclasses.dataclass(frozen=True)
class Nonfinite:
    """Where a step first produced a NaN or an Inf (``find_nonfinite``).

    Attributes:
      phase: ``"forward"`` (a call site's output), ``"loss"`` (every output finite, the loss
        not: the loss function outside the call sites), ``"backward"`` (d loss / d (a call
        site's output)), ``"parameters"`` (every such gradient finite, a parameter's not).
      key: the call site's key (``phase`` forward/backward); the parameter's path (parameters);
        ``None`` for the loss.
      layer: the index of the layer of a scanned stack (a tuple for nested scans); else None.
      count: how many values are non-finite there (summed over a ``vmap`` inside the model).
      before: the label of the call site visited just before it in that pass, whose values were
        all finite (None for the first one): the NaN arose between the two.
      loss: the loss of the step (a float; non-finite after a forward NaN).
    """

    phase: str
    key: str | None
    layer: int | tuple[int, ...] | None
    count: int
    before: str | None
    loss: float

    @property
    def label(self) -> str:
        """The call site with its layer: ``"blocks/lin[2]"``; ``"(loss)"`` for the loss."""
        if self.key is None:
            return "(loss)"
        idx = self.layer if isinstance(self.layer, tuple) else (self.layer,)
        return self.key + "".join(f"[{i}]" for i in idx if i is not None)

    def __str__(self) -> str:
        site = repr(self.label)
        after = (
            f" ({self.before!r} just before it was finite: it arose between the two)"
            if self.before is not None
            else ""
        )
        if self.phase == "forward":
            return f"forward: the output of {site} holds {self.count} non-finite values{after}"
        if self.phase == "loss":
            return (
                "forward: every selected call site's output is finite, the loss is not: it "
                "arises in the loss function, outside the selected call sites"
            )
        if self.phase == "backward":
            return (
                f"backward (the forward pass is finite): d loss / d (output of {site}) holds "
                f"{self.count} non-finite values{after}"
            )
        return (
            f"backward: every selected call site's gradient is finite, the gradient of "
            f"parameter {site} is not ({self.count} values)"
        )


@dataclasses.dataclass(frozen=True)
class _Site:
    """One call site's record in a pass: its label, key, layer and non-finite counts."""

    key: str
    layer: tuple[int, ...] | None
    forward: int
    backward: int

    @property
    def label(self) -> str:
        return self.key + "".join(f"[{i}]" for i in self.layer or ())


def _groups(records: list[Any]) -> Iterator[list[int]]:
    """Record indices in runs: consecutive records that left the same scans together (one scan
    body) or a single record outside any scan. A call site may run several times in one layer
    (a rotary embedding for queries and keys); a new run starts where the body's keys start
    again from its first (another scan over the same layers)."""
    keys = [r[0] for r in records]
    run: list[int] = []
    for i, (_, _, _, (axes, _)) in enumerate(records):
        scanned = _stats.layer_axes(axes) > 0
        same = (
            run and scanned and records[run[0]][3][0] == axes and not _starts_again(keys, run[0], i)
        )
        if run and not same:
            yield run
            run = []
        run.append(i)
    if run:
        yield run


def _starts_again(keys: list[str], start: int, i: int) -> bool:
    """Whether the keys from ``i`` repeat those of the run from ``start`` to ``i``."""
    n = i - start
    return keys[i] == keys[start] and keys[i : i + n] == keys[start:i]


def _sites(records: list[Any], counts: list[np.ndarray]) -> list[_Site]:
    """Every call site (and layer) in forward execution order, with its non-finite counts."""
    out: list[_Site] = []
    for run in _groups(records):
        lead = _stats.layer_axes(records[run[0]][3][0])
        per = []
        for pos, i in enumerate(run):
            key, _, _, (_, layered) = records[i]
            # a one-layer selection ("blocks/lin[2]"): its site, and only its layers count
            site_key, layers, _ = layered.get(key, (key, None, ""))
            c = counts[i]  # (*layers, *batch, 2): sum the batch axes of a vmap in the model
            c = c.reshape(*c.shape[:lead], -1, 2).sum(axis=-2)
            for idx in np.ndindex(*c.shape[:lead]):
                if layers is not None and idx[-1] not in layers:
                    continue
                layer = idx if lead else None
                site = _Site(site_key, layer, int(c[idx][0]), int(c[idx][1]))
                per.append(((idx, pos), site))
        out.extend(site for _, site in sorted(per, key=lambda t: t[0]))
    return out


def _first_param(grads: Any) -> tuple[str, int] | None:
    """The path and non-finite count of the first parameter gradient that holds one."""
    import jax

    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        g = np.asarray(g)
        if np.issubdtype(g.dtype, np.inexact) and not np.isfinite(g).all():
            return _path(path), int((~np.isfinite(g)).sum())
    return None


def _path(path: tuple[Any, ...]) -> str:
    """A pytree path as ``"head/bias"`` (the ``.value`` of an NNX variable left out)."""
    names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return "/".join(names[:-1] if len(names) > 1 and names[-1] == "value" else names)


def find_nonfinite(
    loss_fn: Callable[..., Any],
    *args: Any,
    where: Any = None,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
) -> Nonfinite | None:
    """Run one step and name the first call site whose output or gradient holds a NaN or Inf.

    ``hx.find_nonfinite(loss_fn, model, x, y)`` runs ``loss_fn(model, x, y)`` and its gradient
    once, compiled (``jax.jit``; ``eqx.filter_jit`` for Equinox), with every selected call site
    counting the non-finite values of its output and of d loss / d (its output) in place
    (``hx.value_grad_and_stats``), and returns the first non-zero count in execution
    order: the forward pass (call sites in the order they finished, each layer of a scan in
    turn), then the backward pass (the reverse), then the parameters' gradients. ``None`` when
    the loss, every output and every gradient are finite. The arguments are not changed (a
    module's state updates, such as batch statistics or random-number counters, stay inside the
    compiled copy).

    A call site whose output does not reach the loss is seen in the forward pass only if the
    backward pass runs its rule, which JAX skips for it: select the loss's call sites.

    Args:
      loss_fn: the step's loss function (what it differentiates).
      *args: its arguments, as the step passes them.
      where: which call sites; default every module's ``__call__``.
      argnums: the arguments the step differentiates (for the parameters' gradients).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      A ``Nonfinite`` (``str()`` says it in words), or None.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs))
      >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
      >>> print(hx.find_nonfinite(loss_fn, model, jnp.ones((4, 2))))
      None
      >>> model.layers[1].kernel[0, 0] = jnp.inf
      >>> print(hx.find_nonfinite(loss_fn, model, jnp.ones((4, 2))))
      forward: the output of 'layers/1' holds 4 non-finite values ('layers/0' just before it ...)
    """
    import jax

    if not callable(loss_fn):
        raise HookaxError(
            f"{WHO} expects the step's loss function and its arguments, got {loss_fn!r} of type "
            f"{type(loss_fn).__name__}. Fix: hx.find_nonfinite(loss_fn, model, x, y)."
        )
    where, _ = _capture.where_and_ops(where, None, WHO)
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    marker = functools.partial(_stats.StatsMarker, names=("nonfinite",))
    found: list[Any] = []  # the records, as the trace found them (static facts, not values)

    def step(*a: Any) -> tuple[Any, Any, list[Any]]:
        value, grads, records, g = _stats.run(
            loss_fn, a, {}, nums, argnums, where, has_aux, marker, WHO
        )
        found[:] = records
        return (value[0] if has_aux else value), grads, g

    jit: Any = jax.jit
    if _actgrad.framework_mode(loss_fn, args, {}) == "equinox":  # modules hold non-arrays
        import equinox as eqx

        jit = eqx.filter_jit
    loss, grads, counts = jax.device_get(jit(step)(*args))
    sites = _sites(found, [np.asarray(c) for c in counts])
    return _first(sites, float(loss), grads)


def _first(sites: list[_Site], loss: float, grads: Any) -> Nonfinite | None:
    before = None
    for s in sites:
        if s.forward:
            return Nonfinite("forward", s.key, _layer(s.layer), s.forward, before, loss)
        before = s.label
    if not np.isfinite(loss):
        return Nonfinite("loss", None, None, 0, before, loss)
    before = None
    for s in reversed(sites):
        if s.backward:
            return Nonfinite("backward", s.key, _layer(s.layer), s.backward, before, loss)
        before = s.label
    param = _first_param(grads)
    if param is not None:
        return Nonfinite("parameters", param[0], None, param[1], None, loss)
    return None


def _layer(layer: tuple[int, ...] | None) -> int | tuple[int, ...] | None:
    return layer[0] if layer is not None and len(layer) == 1 else layer
