"""Operation targets (``ops=`` of a grid) and head axes (``heads=``).

``discover_ops`` runs the function abstractly under ``hx.capture(ops=...)`` and gives every
operation an ``ops=`` pattern matched, its value's shape, in the order of the patterns (each in
program order). ``patch_mask`` is the mask one patch replaces: the positions of a column along
``axis`` and one head along ``heads``. ``op_edit`` is the ``hx.intercept_op`` edit that patches
an operation's value with its clean value under that mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._capture.capture import capture
from .._capture.ops import intercept_op, parse_ops
from .._engine import context as _context
from .._engine.select import glob_to_regex, split_layers, split_method
from .._util.errors import SelectorError
from .._util.words import counted
from . import compiled
from .patch import PatchError, per_example, position_mask

__all__ = ["check_heads", "discover_ops", "op_edit", "patch_mask"]

_SHAPES: dict[Any, dict[str, Any]] = {}


def _matches(text: str, key: str) -> bool:
    """Whether the ``ops=`` pattern ``text`` names the operation address ``key``."""
    (pattern,), (address,) = parse_ops(text, ""), parse_ops(key, "")
    site, _, _ = text.rpartition(":")
    path, method = split_method(site)
    key_path, key_method = split_method(key.rpartition(":")[0])
    glob, layers = split_layers(path)
    key_layers = split_layers(key_path)[1]
    if layers is not None and key_layers is not None and not key_layers <= layers:
        return False
    if method and method != (key_method or "__call__"):  # no method: every method
        return False
    if not (glob_to_regex(glob).fullmatch(split_layers(key_path)[0]) if glob else not key_path):
        return False
    return pattern.matches(address.name, address.index or 0)


def discover_ops(fn: Any, args: tuple[Any, ...], ops: Any, who: str) -> dict[str, Any]:
    """``{address: ShapeDtypeStruct}`` of every operation ``ops=`` names in ``fn(*args)``, in
    the order of the patterns (each pattern's matches in program order); found abstractly and
    cached by structure and shapes. A pattern that matches nothing raises, naming it."""
    texts = [p.text for p in parse_ops(ops, who)]
    dyn, rest = compiled.split((fn, args))
    cache_key = (rest, tuple(texts), compiled.avals(dyn))
    hit = _SHAPES.get(cache_key)
    if hit is not None:
        return hit

    per_call: dict[str, Any] = {}  # an operation's value at one call (one layer of a scan)
    batched: dict[str, tuple[int, ...]] = {}  # the sizes of the vmaps around it, in the run
    top: list[Any] = []

    def record(value: Any, op: Any) -> None:
        per_call.setdefault(op.address, getattr(value, "shape", None))
        vmaps = _context.vmaps_between(_context.call_stack()[-1].trace, top[0])
        batched.setdefault(op.address, tuple(v.axis_data.size for v in vmaps))

    def run(dyn: list[Any]) -> Any:
        top.append(_context.current_trace())
        f, a = compiled.join(dyn, rest)
        with intercept_op(record, ops=texts):
            return capture(f, ops=texts)(*a)[1]

    try:
        found = jax.eval_shape(run, dyn)
    except SelectorError as e:  # name the caller, not the capture it runs
        text = str(e)
        if text.startswith("hx.capture"):
            text = text[len("hx.capture") :]
        else:
            text = f": {text}"
        raise SelectorError(who + text) from None
    out: dict[str, Any] = {}
    for text in texts:
        for key, values in found.items():
            if key not in out and _matches(text, key):
                out[key] = _unbatched(_one_shape(key, values, who), key, batched)
                _check_unstacked(key, out[key], per_call, who)
    while len(_SHAPES) >= 4:  # it holds the function's static part (a model): a few only
        del _SHAPES[next(iter(_SHAPES))]
    _SHAPES[cache_key] = out
    return out


def _one_shape(key: str, values: tuple[Any, ...], who: str) -> Any:
    first = values[0]
    if not all(hasattr(v, "shape") and v.shape == first.shape for v in values) or not hasattr(
        first, "shape"
    ):
        raise PatchError(
            f"{who}: operation {key!r} has values {list(values)}; a patching target must be an "
            f"array of one shape at every call. Fix: target an operation that is."
        )
    return jax.ShapeDtypeStruct(first.shape, first.dtype)


def _unbatched(spec: Any, key: str, batched: dict[str, tuple[int, ...]]) -> Any:
    """An operation's value inside ``jax.vmap(model)`` as one example has it (capture adds
    the vmaps' axes in front; patches index the per-example value)."""
    site, _, op = key.rpartition(":")
    path, method = split_method(site)
    sizes = batched.get(f"{split_layers(path)[0]}{':' + method if method else ''}:{op}", ())
    if sizes and tuple(spec.shape[: len(sizes)]) == sizes:
        return jax.ShapeDtypeStruct(spec.shape[len(sizes) :], spec.dtype)
    return spec


def _check_unstacked(key: str, spec: Any, per_call: dict[str, Any], who: str) -> None:
    """An operation inside a scan over layers, named without a layer suffix, is captured
    stacked by layer; a grid patches one layer of it per row."""
    site, _, op = key.rpartition(":")
    path, method = split_method(site)
    plain, layers = split_layers(path)
    one = per_call.get(f"{plain}{':' + method if method else ''}:{op}")
    if layers is None and one is not None and tuple(one) != tuple(spec.shape):
        n = spec.shape[0]
        rows = f"{plain}[0:{n}]{':' + method if method else ''}:{op}"
        raise PatchError(
            f"{who}: operation {key!r} runs inside a scan over layers "
            f"({counted(n, 'layer')} of shape "
            f"{tuple(one)}); a grid patches one layer per row. Fix: ops={rows!r} (one row per "
            f"layer), or a layer suffix naming some of them."
        )


def check_heads(
    heads: Any,
    shapes: dict[str, Any],
    axis: int,
    positions: Any,
    who: str,
    n_heads: int | None = None,
) -> int:
    """The number of heads along axis ``heads`` of every target; a bad axis raises, and so
    does a head axis of another size than ``n_heads`` (where the caller knows it)."""
    if isinstance(heads, bool) or not isinstance(heads, int | np.integer):
        raise PatchError(
            f"{who}: heads= takes the head axis of the targets' values (an int), got "
            f"{heads!r}. Fix: heads=1 for a value laid out (batch, heads, ...)."
        )
    sizes = {}
    for key, spec in shapes.items():
        nd = len(spec.shape)
        if not -nd <= heads < nd:
            raise PatchError(
                f"{who}: heads={heads} is out of range for target {key!r}, whose value has "
                f"shape {tuple(spec.shape)}. Fix: heads= names the axis of that value that "
                f"holds the heads (hx.ops(model, x) lists each operation's shape)."
            )
        if positions is not None and heads % nd == axis % nd:
            raise PatchError(
                f"{who}: heads={heads} and axis={axis} are the same axis of target {key!r} "
                f"(shape {tuple(spec.shape)}). Fix: axis= names the position axis, heads= the "
                f"head axis; positions=None patches whole heads."
            )
        sizes[key] = spec.shape[heads % nd]
        if n_heads is not None and sizes[key] != n_heads:
            raise head_size_error(who, key, tuple(spec.shape), int(heads), n_heads)
    if len(set(sizes.values())) != 1:
        raise PatchError(
            f"{who}: heads={heads} needs the same number of heads in every target, got "
            f"{sizes}. Fix: one grid per kind of target."
        )
    return int(next(iter(sizes.values())))


def head_size_error(
    who: str, key: str, shape: tuple[int, ...], heads: int, n_heads: int
) -> PatchError:
    """A head axis whose size is not the model's number of heads: the heads are on another
    axis of that value, or lumped with another axis (grouped-query attention's groups)."""
    size = shape[heads % len(shape)]
    other = [i for i, d in enumerate(shape) if d == n_heads and i != heads % len(shape)]
    where = f" (axis {other[0]} has size {n_heads})" if other else ""
    return PatchError(
        f"{who}: target {key!r} has shape {shape}: its axis heads={heads} has size {size}, "
        f"but the model has {n_heads} heads{where}, so this grid would patch something else "
        f"than one head. Fix: target the value that holds the heads on that axis "
        f"(hx.ops(model, x) lists each operation's shape), or pass heads= the axis of size "
        f"{n_heads}."
    )


def patch_mask(
    col: Any, head: Any, shape: tuple[int, ...], axis: int, heads: int | None, key: str
) -> Any:
    """The mask one patch replaces in a value of ``shape``: column ``col``'s positions along
    ``axis`` and head ``head`` along ``heads`` (None: all), broadcasting against the value;
    None for the whole value."""
    mask = position_mask(col, shape, axis, key)
    if head is None or heads is None:
        return mask
    nd = len(shape)
    ax = heads % nd
    one = (jnp.arange(shape[ax]) == head).reshape((-1,) + (1,) * (nd - ax - 1))
    return one if mask is None else mask & one


def full_mask(
    col: Any, head: Any, shape: tuple[int, ...], axis: int, heads: int | None, key: str
) -> Any:
    """:func:`patch_mask` over the whole value: ``hx.patching``'s ``positions=`` with
    ``axis=-1``."""
    mask = patch_mask(col, head, shape, axis, heads, key)
    return None if mask is None else jnp.broadcast_to(mask, shape)


def op_edit(
    key: str, entries: tuple[Any, ...], col: Any, head: Any, axis: int, heads: int | None
) -> Callable[[Any, Any], Any]:
    """The ``hx.intercept_op`` edit that puts ``entries`` (one clean value per call, in call
    order) into the operation ``key`` under the patch's mask."""
    calls = [0]  # the calls of the operation in this trace of the forward
    block_trace = _context.current_trace()

    def patch_op(value: Any, op: Any) -> Any:
        clean = entries[calls[0] % len(entries)]
        calls[0] += 1
        clean = per_example(clean, value.shape, _context.call_stack()[-1], block_trace)
        if clean.shape != value.shape:
            raise PatchError(
                f"hx.patch_grid: operation {key!r} has a value of shape {tuple(value.shape)} "
                f"here, but its clean value has shape {tuple(clean.shape)} (an operation "
                f"inside a loop over layers is stacked by layer). Fix: target one layer, "
                f"ops='blocks/attn[3]:dot_general#1', or an operation outside the loop."
            )
        mask = patch_mask(col, head, value.shape, axis, heads, key)
        clean = clean.astype(value.dtype)
        return clean if mask is None else jnp.where(mask, clean, value)

    return patch_op
