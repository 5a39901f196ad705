"""``hx.summary``: one row per call site, with shapes, parameters and XLA's FLOP count."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable
from typing import Any

from ._errors import HookaxError

__all__ = ["Summary", "SummaryRow", "SummaryTotals", "summary"]


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One call site of the summarised call, in call order.

    Attributes:
      key: the call site's key (``"layers/0/attn"``, ``"embed:attend"``; ``""`` for the model).
      path: the module's path from the model, a tuple of keys.
      type: the module's class name.
      method: the method called (``"__call__"``, ...).
      inputs: each array leaf of the arguments as ``"f32[8,64]"`` (other leaves by ``repr``).
      outputs: each leaf of the returned value, the same way.
      params: parameters (``nnx.Param``) of the module and its submodules, each counted once.
      param_bytes: their size in bytes.
      flops: XLA's FLOP count of this call alone (submodule calls included), or None where it
        could not be lowered alone.
      shared_with: keys of the other modules holding some of this module's own parameters
        (tied weights); empty when none.
      depth: how many other rows' modules contain this one (the model is 0, its direct
        submodules 1, the blocks of an ``nnx.List`` of blocks 1, their layers 2, ...).
      folded: how many deeper call sites ``depth=`` folded into this row.
    """

    key: str
    path: tuple[Any, ...]
    type: str
    method: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: int
    param_bytes: int
    flops: int | None
    shared_with: tuple[str, ...] = ()
    depth: int = 0
    folded: int = 0

    @property
    def shared(self) -> bool:
        """Whether this module holds parameters another module holds too."""
        return bool(self.shared_with)


@dataclasses.dataclass(frozen=True)
class SummaryTotals:
    """Totals of a summary.

    Attributes:
      params: parameters of the model, tied/shared ones counted once.
      param_bytes: their size in bytes.
      flops: XLA's FLOP count of the whole call (None if unavailable).
      shared_params: how many of ``params`` are held by more than one module.
    """

    params: int
    param_bytes: int
    flops: int | None
    shared_params: int = 0


@dataclasses.dataclass(frozen=True)
class Summary:
    """The result of :func:`summary`: ``rows`` in call order and ``totals``.

    ``print(summary)`` renders a table; :meth:`to_json` and :meth:`from_json` round-trip it.
    """

    rows: list[SummaryRow]
    totals: SummaryTotals

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "totals": dataclasses.asdict(self.totals),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The summary as JSON (read it back with :meth:`Summary.from_json`)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Summary:
        """Read back what :meth:`to_json` wrote."""
        data = json.loads(text)
        rows = []
        for r in data["rows"]:
            for name in ("path", "inputs", "outputs", "shared_with"):
                r[name] = tuple(r[name])
            rows.append(SummaryRow(**r))
        return cls(rows, SummaryTotals(**data["totals"]))

    def __rich__(self) -> Any:
        from ._summary_render import table

        return table(self)

    def __str__(self) -> str:
        from ._summary_render import render

        return render(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython
        p.text(str(self))


def summary(model: Any, *example_args: Any, depth: int | None = None, **example_kwargs: Any):
    """Summarise ``model(*example_args, **example_kwargs)``: one row per call site, in call order.

    Every call of every method of every module (``__call__`` and public methods, like
    :func:`~hookax.intercept`'s default) is one row. Nothing runs and nothing weights-sized is
    allocated: the model is traced on abstract values (``jax.jit(...).lower``), so the model may
    come from ``nnx.eval_shape`` and the arguments may be ``jax.ShapeDtypeStruct``\\ s. A row's
    FLOPs are XLA's cost analysis of that call site's method lowered alone (identical call sites
    share one lowering); the total is XLA's count for the whole call. Parameters are counted per
    module including its submodules; parameters held by several modules (tied embeddings) are
    counted once in the totals and the rows holding them say with whom they share.

    Args:
      model: a Flax NNX module; a Flax Linen module (unbound: its parameters are initialised
        abstractly, or bound: its variables are used); or an Equinox module.
      *example_args: its positional arguments: arrays or ``jax.ShapeDtypeStruct``\\ s.
      depth: keep rows at most this deep (see :attr:`SummaryRow.depth`: the model is 0, the
        modules it calls 1, ...); deeper call sites fold into the row above them, whose
        parameters and FLOPs already include theirs.
      **example_kwargs: its keyword arguments.

    Returns:
      A :class:`Summary`.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import hookax as hx
    >>> layer = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    >>> s = hx.summary(layer, jax.ShapeDtypeStruct((8, 64), jnp.float32))
    >>> s.rows[0].outputs, s.totals.params, s.totals.flops
    (('f32[8,32]',), 2080, 33024)
    """
    trace = _check(model, depth)
    records, lowered = trace.trace_calls(model, example_args, example_kwargs)
    params = trace.param_table(model)
    cache: dict[Hashable, int | None] = {}
    total_flops = trace.flops_of(lowered)
    rows = []
    seen = {rec.path for rec in records}
    for i, rec in enumerate(records):
        flops = total_flops if i == 0 else trace.lower_flops(rec.site, cache)
        rows.append(
            SummaryRow(
                key=rec.key,
                path=rec.path,
                type=rec.type,
                method=rec.method,
                inputs=rec.inputs,
                outputs=rec.outputs,
                params=params.count.get(rec.path, 0),
                param_bytes=params.nbytes.get(rec.path, 0),
                flops=flops,
                shared_with=params.shared_with.get(rec.path, ()),
                depth=sum(1 for j in range(len(rec.path)) if rec.path[:j] in seen),
            )
        )
    totals = SummaryTotals(params.total, params.total_bytes, total_flops, params.shared_total)
    return Summary(fold(rows, depth), totals)


def _check(model: Any, depth: Any) -> Any:
    """The module that traces ``model``'s framework (``trace_calls``, ``param_table``, ...)."""
    from .frameworks import adapter_for

    adapter = adapter_for(model)
    if depth is not None and (not isinstance(depth, int) or depth < 0):
        raise HookaxError(f"hx.summary(depth=...) takes an int >= 0 or None, got {depth!r}.")
    if adapter is not None and adapter.name in ("linen", "equinox"):
        from . import _summary_frameworks

        return _summary_frameworks.backend(adapter.name)
    nnx_module = _nnx_module_type()
    if nnx_module is None or not isinstance(model, nnx_module):
        raise HookaxError(
            f"hx.summary supports Flax NNX, Flax Linen and Equinox modules; got "
            f"{type(model).__name__}. Fix: pass the model (an nnx.Module, an unbound or bound "
            "nn.Module, or an eqx.Module; build it abstractly to keep it small)."
        )
    from . import _summary_trace

    return _summary_trace


def _nnx_module_type() -> type | None:
    import sys

    if "flax.nnx" not in sys.modules:
        return None
    return sys.modules["flax.nnx"].Module


def fold(rows: list[SummaryRow], depth: int | None) -> list[SummaryRow]:
    """Drop rows deeper than ``depth``, counting them in the nearest kept row above them.

    A row's parameters and FLOPs already include its submodules' calls, so folding only counts.
    """
    if depth is None:
        return list(rows)
    kept: list[SummaryRow] = []
    for row in rows:
        if row.depth <= depth or not kept:
            kept.append(row)
        else:
            kept[-1] = dataclasses.replace(kept[-1], folded=kept[-1].folded + 1)
    return kept
