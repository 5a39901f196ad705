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

import jax
import numpy as np

from .._capture import actgrad as _actgrad
from .._capture import capture as _capture
from .._engine import firstcall
from .._engine.select import Where
from .._patching import compiled
from .._util import nnxsplit
from .._util.errors import HookaxError
from .._util.words import counted
from ..frameworks._functions import as_program
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
        return _label(self.key, tuple(i for i in idx if i is not None))

    def __str__(self) -> str:
        what = "output"
        site = self.label
        if self.key is not None and self.key.endswith(":in"):  # a call site's input
            what, site = "input", site.removesuffix(":in")
        site = repr(site)
        after = (
            f" ({self.before!r} just before it was finite: it arose between the two)"
            if self.before is not None
            else ""
        )
        values = f"{self.count} non-finite value{'' if self.count == 1 else 's'}"
        if self.phase == "forward":
            return f"forward: the {what} of {site} holds {values}{after}"
        if self.phase == "loss":
            return (
                "forward: every selected call site's output is finite, the loss is not: it "
                "arises in the loss function, outside the selected call sites"
            )
        if self.phase == "backward":
            return (
                f"backward (the forward pass is finite): d loss / d ({what} of {site}) holds "
                f"{values}{after}"
            )
        return (
            f"backward: every selected call site's gradient is finite, the gradient of "
            f"parameter {site} is not ({counted(self.count, 'value')})"
        )

    def __repr__(self) -> str:
        """The sentence (``str``): what a notebook or the REPL shows; the fields are attributes."""
        return str(self)

    def _repr_html_(self) -> str:  # a notebook: the sentence, then the fields
        import html

        fields = [
            ("phase", self.phase),
            ("call site", self.label),
            ("non-finite values", f"{self.count:,}"),
            ("finite just before", self.before if self.before is not None else "-"),
            ("loss", f"{self.loss:.6g}"),
        ]
        rows = "".join(
            f'<tr><th style="text-align:left">{html.escape(k)}</th>'
            f'<td style="text-align:left">{html.escape(str(v))}</td></tr>'
            for k, v in fields
        )
        return (
            f'<div class="hookax"><p>{html.escape(str(self))}</p>'
            f'<table style="border-collapse:collapse">{rows}</table></div>'
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
        return _label(self.key, self.layer or ())


def _label(key: str, layer: tuple[int, ...]) -> str:
    """``key`` with its layers: ``"blocks/lin[2]"``; an input's after them (``"blocks[2]:in"``)."""
    base, is_input = (key[:-3], ":in") if key.endswith(":in") else (key, "")
    return base + "".join(f"[{i}]" for i in layer) + is_input


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
    where: Where = None,
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
    compiled copy). The compiled step is kept: calling again with the same loss function
    (functions compared by code and closure, as ``hx.intercept`` compares them) and arguments of
    the same structure and shapes runs it without tracing again, so a NaN hunt pays one compile.
    On a small model, the first call of a new step runs with NumPy while the step compiles in
    the background (`hx.first_call`; not for Equinox models).

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
      forward: the output of 'layers/1' holds 4 non-finite values
      ('layers/0' just before it ...)
    """
    loss_fn = as_program(loss_fn)  # a program without modules: its own call sites
    if not callable(loss_fn):
        raise HookaxError(
            f"{WHO} expects the step's loss function and its arguments, got {loss_fn!r} of type "
            f"{type(loss_fn).__name__}. Fix: hx.find_nonfinite(loss_fn, model, x, y)."
        )
    if not args:
        raise HookaxError(
            f"{WHO}({getattr(loss_fn, '__name__', 'loss_fn')}) was given no arguments for the "
            "loss function: it runs the step itself, once. Fix: pass them after it, "
            "hx.find_nonfinite(loss_fn, model, x, y)."
        )
    where, _ = _capture.where_and_ops(where, None, WHO)
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    if isinstance(where, list):
        where = tuple(where)
    spec = _Spec(compiled.static_key(loss_fn), compiled.static_key(where), nums, argnums, has_aux)
    equinox = _actgrad.framework_mode(loss_fn, args, {}) == "equinox"
    step = _step(equinox) if compiled.reusable(spec.loss_fn) else _make_step(equinox)
    loss, grads, counts, found = step(spec, args if equinox else nnxsplit.lift(args))
    loss, grads, counts = jax.device_get((loss, grads, counts))
    sites = _sites(found.records, [np.asarray(c) for c in counts])
    return _first(sites, float(loss), grads)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The compiled step's static part: equal specs (and argument shapes) share one program."""

    loss_fn: Any  # compiled.static_key of the loss function (functions by code and closure)
    where: Any
    nums: tuple[int, ...]
    argnums: Any
    has_aux: bool


class _Found:
    """The call sites' records as the trace found them (static facts, not values): a static
    output of the compiled step, so a cached program gives them back without tracing."""

    def __init__(self, records: list[Any]) -> None:
        self.records = records


jax.tree_util.register_static(_Found)


def _run_step(spec: _Spec, packed: Any) -> tuple[Any, Any, Any, _Found]:
    args = nnxsplit.lower(packed)  # NNX modules come in as nnx.split state
    marker = functools.partial(_stats.StatsMarker, names=("nonfinite",))
    fn, where = compiled.value_of(spec.loss_fn), compiled.value_of(spec.where)
    value, grads, records, g = _stats.run(
        fn, args, {}, spec.nums, spec.argnums, where, spec.has_aux, marker, WHO
    )
    return (value[0] if spec.has_aux else value), grads, g, _Found(records)


_STEPS: dict[bool, Any] = {}


def _step(equinox: bool) -> Any:
    """The compiled step (``jax.jit``; ``eqx.filter_jit`` for Equinox, whose modules hold
    non-arrays), made once: JAX's cache then holds one program per spec and argument shapes."""
    if equinox not in _STEPS:
        _STEPS[equinox] = _make_step(equinox)
    return _STEPS[equinox]


def _make_step(equinox: bool) -> Any:
    if equinox:
        import equinox as eqx

        return eqx.filter_jit(_run_step)
    # jax.jit whose first call of a small step runs with NumPy (hx.first_call)
    return firstcall.Program(_run_step, (0,))


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
