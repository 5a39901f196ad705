"""The device side of ``hx.harvest``: one jitted step per batch, and the arrays it produces.

The step runs ``hx.capture`` (its public form) under jit, casts floating outputs to the store's
dtype on the device (so ``bfloat16`` also halves the bytes moved to the host), flattens every
captured output into named leaves (one stored array each) and computes the batch's row mask. An
NNX module is passed to ``nnx.jit`` as an argument (its parameters are not baked into the
program); any other function is jitted with ``jax.jit``, closing over the modules it calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._capture import capture
from ._errors import HookaxError

__all__ = ["Leaf", "Step", "as_args", "leaf_specs", "replication"]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One stored array: which call site, which call, which part of the output."""

    name: str  # what users index the store with: "layers/0", "attn#1", "pair[0]"
    key: str  # the call site's key
    call: int  # which call of that call site
    part: str  # jax.tree_util.keystr of the leaf inside the output ("" for an array output)
    shape: tuple[int, ...]  # per-row shape (the value's shape after the row axes)
    dtype: str  # stored dtype

    def describe(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "call": self.call,
            "part": self.part,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }


def as_args(batch: Any) -> tuple[Any, ...]:
    """A batch as the positional arguments of ``fn``: a tuple as it is, anything else alone."""
    return batch if isinstance(batch, tuple) else (batch,)


def _leaves(acts: dict[str, tuple[Any, ...]]) -> list[tuple[str, str, int, str, Any]]:
    """``(name, key, call, part, value)`` for every array leaf of every captured output."""
    out = []
    for key, calls in acts.items():
        for call, value in enumerate(calls):
            for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
                part = jax.tree_util.keystr(path)
                name = key + (f"#{call}" if len(calls) > 1 else "") + part
                out.append((name, key, call, part, leaf))
    return out


def _cast(x: Any, dtype: Any) -> Any:
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype)


def replication(args: tuple[Any, ...]) -> Any:
    """With several processes, a sharding that puts a value whole on every device of the
    batch's mesh (every process then holds the whole row mask); None with one process."""
    if jax.process_count() == 1:
        return None
    from jax.sharding import NamedSharding, PartitionSpec

    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
    raise HookaxError(
        f"hx.harvest: with {jax.process_count()} JAX processes every batch must hold global "
        "jax.Arrays with a NamedSharding (the mesh the step runs on), got "
        f"{[type(x).__name__ for x in jax.tree.leaves(args)]}. Fix: build each batch with "
        "jax.make_array_from_process_local_data(NamedSharding(mesh, P('data')), local_rows)."
    )


class Step:
    """The jitted step: ``step(*args) -> ({name: value}, row mask)``.

    ``origin`` maps each name to ``(key, call, part)``; it is filled while the step traces.
    """

    def __init__(
        self,
        fn: Any,
        where: Any,
        dtype: Any,
        mask: Callable[..., Any] | None,
        row_axes: int,
        first: tuple[Any, ...],
    ) -> None:
        self.origin: dict[str, tuple[str, int, str]] = {}
        whole = replication(first)

        def body(f: Any, *args: Any) -> tuple[dict[str, Any], Any]:
            _, acts = capture(f, where=where)(*args)
            values = {}
            for name, key, call, part, v in _leaves(acts):
                self.origin[name] = (key, call, part)
                values[name] = _cast(v, dtype)
            first = next(iter(values.values()), None)
            rows = () if first is None else tuple(first.shape[:row_axes])
            m = jnp.ones(rows, bool) if mask is None else jnp.asarray(mask(*args), bool)
            return values, m if whole is None else jax.lax.with_sharding_constraint(m, whole)

        if _is_nnx_module(fn):
            from flax import nnx

            jitted = nnx.jit(body)
            self._run: Callable[..., Any] = lambda *args: jitted(fn, *args)
            self._shapes: Callable[..., Any] = lambda *args: nnx.eval_shape(body, fn, *args)
        else:
            self._run = jax.jit(lambda *args: body(fn, *args))
            self._shapes = lambda *args: jax.eval_shape(self._run, *args)

    @classmethod
    def cached(
        cls,
        fn: Any,
        where: Any,
        dtype: Any,
        mask: Callable[..., Any] | None,
        row_axes: int,
        first: tuple[Any, ...],
    ) -> Step:
        """The step of an earlier run with the same arguments (its compilations kept), or a
        new one. Objects are compared by identity, and kept alive by the cache."""
        from ._select import CALL_ONLY, as_selector

        selector = as_selector(where, CALL_ONLY)  # compares by value
        key = (id(fn), selector, str(dtype), id(mask), row_axes, replication(first))
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is fn and hit[1] is mask:
            return hit[2]
        step = cls(fn, where, dtype, mask, row_axes, first)
        _CACHE[key] = (fn, mask, step)
        while len(_CACHE) > 4:
            del _CACHE[next(iter(_CACHE))]
        return step

    def __call__(self, *args: Any) -> tuple[dict[str, Any], Any]:
        return self._run(*args)

    def shapes(self, *args: Any) -> tuple[dict[str, Any], Any]:
        """Abstract outputs (shapes and dtypes) for these arguments; computes nothing."""
        return self._shapes(*args)


_CACHE: dict[Any, tuple[Any, Any, Step]] = {}


def _is_nnx_module(fn: Any) -> bool:
    import sys

    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(fn, nnx.Module)


def leaf_specs(
    step: Step, args: tuple[Any, ...], row_axes: int, masked: bool
) -> tuple[list[Leaf], tuple[int, ...]]:
    """The stored arrays of ``step`` on ``args`` and the batch's row shape (computed
    abstractly); checks that every value leads with the row axes."""
    values, m = step.shapes(*args)
    leaves: list[Leaf] = []
    rows = tuple(m.shape)
    if masked and len(rows) != row_axes:
        raise HookaxError(
            f"hx.harvest: mask= returned a {len(rows)}-d mask of shape {rows}, but "
            f"row_axes={row_axes}. The mask has one entry per stored row: its shape is the "
            f"leading row_axes axes of every captured value. Fix: row_axes={len(rows)}."
        )
    for name, v in values.items():
        if tuple(v.shape[:row_axes]) != rows or v.ndim < row_axes:
            raise HookaxError(
                f"hx.harvest: call site output {name!r} has shape {tuple(v.shape)}, whose leading "
                f"{row_axes} axes are not the batch's rows {rows} (row_axes={row_axes}"
                f"{', from the mask' if masked else ', from the first output'}). Every stored "
                f"value must lead with the same row axes. Fix: select only call sites whose "
                f"outputs lead with the batch axes (where=...), or set row_axes= to match."
            )
        key, call, part = step.origin[name]
        leaves.append(Leaf(name, key, call, part, tuple(v.shape[row_axes:]), str(v.dtype)))
    return leaves, rows
