"""A jaxpr evaluated with NumPy, operation by operation: the first call of a small program
without waiting for XLA.

XLA:CPU compiles a small model's patching grid in about a second; NumPy runs the same
operations on its arrays in milliseconds. :func:`supported` says whether every operation of a
jaxpr has a NumPy form here (with the dtypes this module computes exactly as XLA does: float32
and float64, the integers, bool); :func:`evaluate` runs it. Values agree with the compiled
program's to float rounding (a matmul or a sum adds in another order, ``exp`` and ``tanh``
come from another library), not bit for bit: the compiled program and JAX's own eager
operations differ from each other by as much.

Higher-order operations are run from their bodies: ``jit``, ``custom_jvp_call``,
``custom_vjp_call``, ``checkpoint``, ``closed_call``, ``scan``, ``while``, ``cond``;
references (``jax.new_ref``: ``get``, ``swap``, ``addupdate``) are NumPy arrays in a box.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from jax import tree_util

from .._util import jaxcompat
from .._util.jaxcompat import core

__all__ = ["evaluate", "flops", "supported"]

Impl = Callable[..., Any]
_IMPLS: dict[str, Impl] = {}
_MULTI: set[str] = set()  # primitives with several results
_CHECKS: dict[str, Callable[[Any], bool]] = {}  # param-dependent support
_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.float32,
        np.float64,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.bool_,
    )
)


def _impl(*names: str, multi: bool = False, check: Callable[[Any], bool] | None = None) -> Any:
    def register(fn: Impl) -> Impl:
        for name in names:
            _IMPLS[name] = fn
            if multi:
                _MULTI.add(name)
            if check is not None:
                _CHECKS[name] = check
        return fn

    return register


def _unary(name: str, fn: Callable[..., Any]) -> None:
    _IMPLS[name] = lambda x, **_: fn(x)


def _binary(name: str, fn: Callable[..., Any]) -> None:
    _IMPLS[name] = lambda x, y, **_: fn(x, y)


def _rsqrt(x: np.ndarray) -> Any:
    return np.reciprocal(np.sqrt(x))


def _logistic(x: np.ndarray) -> Any:
    one = np.ones((), x.dtype)
    return one / (one + np.exp(-x))


_UNARY: dict[str, Callable[..., Any]] = {
    "neg": np.negative,
    "exp": np.exp,
    "exp2": np.exp2,
    "log": np.log,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "tanh": np.tanh,
    "sin": np.sin,
    "cos": np.cos,
    "abs": np.abs,
    "sign": np.sign,
    "floor": np.floor,
    "ceil": np.ceil,
    "sqrt": np.sqrt,
    "rsqrt": _rsqrt,
    "logistic": _logistic,
    "square": np.square,
    "one_minus_square": lambda x: np.ones((), x.dtype) - np.square(x),
    "is_finite": np.isfinite,
    "not": np.invert,
    "copy": np.array,
    "copy_p": np.array,
    "stop_gradient": lambda x: x,
    "real": np.real,
}
for _name, _fn in _UNARY.items():
    _unary(_name, _fn)

_BINARY: dict[str, Callable[..., Any]] = {
    "add": np.add,
    "add_any": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "pow": np.power,
    "atan2": np.arctan2,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "shift_left": np.left_shift,
    "shift_right_arithmetic": np.right_shift,
}
for _name, _fn in _BINARY.items():
    _binary(_name, _fn)


@_impl("div")
def _div(x: np.ndarray, y: np.ndarray) -> Any:
    if np.issubdtype(x.dtype, np.integer):  # XLA rounds toward zero; x / 0 is -1 (all ones)
        x, y = np.broadcast_arrays(x, y)
        zero = y == 0
        safe = np.where(zero, 1, y).astype(y.dtype)
        q = np.floor_divide(x, safe)
        q = np.where((np.remainder(x, safe) != 0) & ((x < 0) != (safe < 0)), q + 1, q)
        return np.where(zero, np.array(-1).astype(x.dtype), q)
    return np.divide(x, y)


@_impl("rem")
def _rem(x: np.ndarray, y: np.ndarray) -> Any:
    if np.issubdtype(x.dtype, np.integer):  # x % 0 is x
        x, y = np.broadcast_arrays(x, y)
        zero = y == 0
        return np.where(zero, x, np.fmod(x, np.where(zero, 1, y).astype(y.dtype)))
    return np.fmod(x, y)


@_impl("shift_right_logical")
def _shift_right_logical(x: np.ndarray, y: np.ndarray) -> Any:
    unsigned = x.dtype.str.replace("i", "u")
    return np.right_shift(x.view(unsigned), y.astype(unsigned)).view(x.dtype)


@_impl("integer_pow")
def _integer_pow(x: np.ndarray, *, y: int) -> Any:
    # Square and multiply, as JAX lowers it.
    n, acc, base = abs(y), None, x
    while n:
        if n & 1:
            acc = base if acc is None else acc * base
        n >>= 1
        if n:
            base = base * base
    out = np.ones_like(x) if acc is None else acc
    return np.reciprocal(out) if y < 0 else out


@_impl("erf")
def _erf(x: np.ndarray, **_: Any) -> Any:
    import scipy.special

    return scipy.special.erf(x).astype(x.dtype)


@_impl("erfc")
def _erfc(x: np.ndarray, **_: Any) -> Any:
    import scipy.special

    return scipy.special.erfc(x).astype(x.dtype)


@_impl("erf_inv")
def _erf_inv(x: np.ndarray, **_: Any) -> Any:
    import scipy.special

    return scipy.special.erfinv(x).astype(x.dtype)


@_impl("round")
def _round(x: np.ndarray, *, rounding_method: Any) -> Any:
    if int(rounding_method) == 0:  # away from zero
        return np.sign(x) * np.floor(np.abs(x) + np.asarray(0.5, x.dtype))
    return np.round(x)


@_impl("select_n")
def _select_n(which: np.ndarray, *cases: np.ndarray) -> Any:
    if which.dtype == np.bool_:
        return np.where(which, cases[1], cases[0]) if len(cases) > 1 else cases[0]
    return np.choose(which.astype(np.int64), np.broadcast_arrays(*cases))


@_impl("clamp")
def _clamp(lo: np.ndarray, x: np.ndarray, hi: np.ndarray) -> Any:
    return np.minimum(np.maximum(x, lo), hi)


@_impl("convert_element_type")
def _convert(x: np.ndarray, *, new_dtype: Any, **_: Any) -> Any:
    dtype = np.dtype(new_dtype)
    if dtype == np.bool_:
        return x != 0
    return x.astype(dtype)


@_impl(
    "reduce_precision",
    check=lambda p: (p["exponent_bits"], p["mantissa_bits"]) in {(8, 23), (11, 52)},
)
def _reduce_precision(x: np.ndarray, **_: Any) -> Any:
    return x


@_impl("broadcast_in_dim")
def _broadcast_in_dim(
    x: np.ndarray, *dyn: Any, shape: Sequence[int], broadcast_dimensions: Sequence[int], **_: Any
) -> Any:
    kept = [1] * len(shape)
    for src, dst in enumerate(broadcast_dimensions):
        kept[dst] = x.shape[src]
    return np.broadcast_to(np.reshape(x, kept), tuple(shape))


@_impl("reshape", check=lambda p: p.get("dimensions") is None)
def _reshape(x: np.ndarray, *dyn: Any, new_sizes: Sequence[int], **_: Any) -> Any:
    return np.reshape(x, tuple(new_sizes))


@_impl("transpose")
def _transpose(x: np.ndarray, *, permutation: Sequence[int]) -> Any:
    return np.transpose(x, permutation)


@_impl("squeeze")
def _squeeze(x: np.ndarray, *, dimensions: Sequence[int]) -> Any:
    return np.squeeze(x, tuple(dimensions))


@_impl("expand_dims")
def _expand_dims(x: np.ndarray, *, dimensions: Sequence[int]) -> Any:
    return np.expand_dims(x, tuple(dimensions))


@_impl("rev")
def _rev(x: np.ndarray, *, dimensions: Sequence[int]) -> Any:
    return np.flip(x, tuple(dimensions))


@_impl("concatenate")
def _concatenate(*xs: np.ndarray, dimension: int) -> Any:
    return np.concatenate(xs, axis=dimension)


@_impl("stack")
def _stack(*xs: np.ndarray, axis: int) -> Any:
    return np.stack(xs, axis=axis)


@_impl("unstack", multi=True)
def _unstack(x: np.ndarray, *, axis: int) -> Any:
    return [np.take(x, i, axis=axis) for i in range(x.shape[axis])]


@_impl("split", multi=True)
def _split(x: np.ndarray, *, sizes: Sequence[int], axis: int) -> Any:
    return np.split(x, np.cumsum(sizes)[:-1], axis=axis)


@_impl(
    "pad", check=lambda p: all(lo >= 0 and hi >= 0 and i == 0 for lo, hi, i in p["padding_config"])
)
def _pad(
    x: np.ndarray, value: np.ndarray, *, padding_config: Sequence[tuple[int, int, int]]
) -> Any:
    return np.pad(x, [(lo, hi) for lo, hi, _ in padding_config], constant_values=value)


@_impl("slice")
def _slice(
    x: np.ndarray,
    *,
    start_indices: Sequence[int],
    limit_indices: Sequence[int],
    strides: Sequence[int] | None,
) -> Any:
    steps = strides or (1,) * x.ndim
    return x[tuple(slice(a, b, s) for a, b, s in zip(start_indices, limit_indices, steps))]


def _starts(x: np.ndarray, idx: Sequence[Any], sizes: Sequence[int]) -> tuple[int, ...]:
    # XLA clamps a dynamic slice's start so that the slice lies inside the operand.
    return tuple(min(max(int(i), 0), d - s) for i, d, s in zip(idx, x.shape, sizes))


@_impl("dynamic_slice")
def _dynamic_slice(x: np.ndarray, *idx: Any, slice_sizes: Sequence[int]) -> Any:
    starts = _starts(x, idx, slice_sizes)
    return x[tuple(slice(a, a + s) for a, s in zip(starts, slice_sizes))]


@_impl("dynamic_update_slice")
def _dynamic_update_slice(x: np.ndarray, update: np.ndarray, *idx: Any) -> Any:
    starts = _starts(x, idx, update.shape)
    out = np.array(x)
    out[tuple(slice(a, a + s) for a, s in zip(starts, update.shape))] = update
    return out


@_impl("iota")
def _iota(*, dtype: Any, shape: Sequence[int], dimension: int, **_: Any) -> Any:
    ramp = np.arange(shape[dimension], dtype=dtype)
    kept = [1] * len(shape)
    kept[dimension] = shape[dimension]
    return np.broadcast_to(ramp.reshape(kept), tuple(shape))


def _reducer(fn: Callable[..., Any]) -> Impl:
    return lambda x, *, axes, **_: fn(x, axis=tuple(axes))


_IMPLS["reduce_sum"] = _reducer(np.sum)
_IMPLS["reduce_max"] = _reducer(np.max)
_IMPLS["reduce_min"] = _reducer(np.min)
_IMPLS["reduce_prod"] = _reducer(np.prod)
_IMPLS["reduce_and"] = _reducer(np.all)
_IMPLS["reduce_or"] = _reducer(np.any)


def _arg(fn: Callable[..., Any]) -> Impl:
    return lambda x, *, axes, index_dtype: fn(x, axis=axes[0]).astype(index_dtype)


_IMPLS["argmax"] = _arg(np.argmax)
_IMPLS["argmin"] = _arg(np.argmin)


def _cumulative(fn: Callable[..., Any]) -> Impl:
    def run(x: np.ndarray, *, axis: int, reverse: bool) -> Any:
        if reverse:
            return np.flip(fn(np.flip(x, axis), axis=axis), axis)
        return fn(x, axis=axis)

    return run


_IMPLS["cumsum"] = _cumulative(np.cumsum)
_IMPLS["cumprod"] = _cumulative(np.cumprod)
_IMPLS["cummax"] = _cumulative(np.maximum.accumulate)
_IMPLS["cummin"] = _cumulative(np.minimum.accumulate)


@_impl("dot_general")
def _dot_general(
    x: np.ndarray,
    y: np.ndarray,
    *,
    dimension_numbers: Any,
    preferred_element_type: Any = None,
    **_: Any,
) -> Any:
    (xc, yc), (xb, yb) = dimension_numbers
    xf = [d for d in range(x.ndim) if d not in xc and d not in xb]
    yf = [d for d in range(y.ndim) if d not in yc and d not in yb]
    bshape = [x.shape[d] for d in xb]
    b, k = math.prod(bshape), math.prod(x.shape[d] for d in xc)
    m, n = math.prod(x.shape[d] for d in xf), math.prod(y.shape[d] for d in yf)
    # Contiguous operands: a broadcast (zero-stride) operand takes NumPy's slow non-BLAS loop.
    a = np.ascontiguousarray(np.transpose(x, [*xb, *xf, *xc]).reshape(b, m, k))
    c = np.ascontiguousarray(np.transpose(y, [*yb, *yc, *yf]).reshape(b, k, n))
    dtype = np.dtype(preferred_element_type) if preferred_element_type is not None else None
    if dtype is not None and dtype != a.dtype:
        a, c = a.astype(dtype), c.astype(dtype)
    out = np.matmul(a, c)
    return out.reshape([*bshape, *(x.shape[d] for d in xf), *(y.shape[d] for d in yf)])


def _gather_ok(p: Any) -> bool:
    mode = str(p["mode"])
    return "CLIP" in mode or "FILL" in mode or "PROMISE" in mode


@_impl("gather", check=_gather_ok)
def _gather(
    x: np.ndarray,
    idx: np.ndarray,
    *,
    dimension_numbers: Any,
    slice_sizes: Sequence[int],
    mode: Any,
    fill_value: Any = None,
    **_: Any,
) -> Any:
    dn = dimension_numbers
    batch_shape = idx.shape[:-1]
    out_rank = len(batch_shape) + len(dn.offset_dims)
    batch_pos = [i for i in range(out_rank) if i not in dn.offset_dims]
    dropped = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()))
    offset_of = dict(zip([d for d in range(x.ndim) if d not in dropped], dn.offset_dims))
    in_batch = dict(
        zip(
            getattr(dn, "operand_batching_dims", ()), getattr(dn, "start_indices_batching_dims", ())
        )
    )

    def spread(a: np.ndarray) -> np.ndarray:  # batch-shaped -> out rank
        shape = [1] * out_rank
        for i, pos in enumerate(batch_pos):
            shape[pos] = a.shape[i]
        return a.reshape(shape)

    fill = "FILL" in str(mode)
    bad = np.zeros((1,) * out_rank, bool)
    index: list[np.ndarray] = []
    for d in range(x.ndim):
        if d in dn.start_index_map:
            start = idx[..., dn.start_index_map.index(d)].astype(np.int64)
            hi = x.shape[d] - slice_sizes[d]
            if fill:
                bad = bad | spread((start < 0) | (start > hi))
            start = spread(np.clip(start, 0, hi))
        elif d in in_batch:
            b = in_batch[d]
            start = _ramp(batch_shape[b], batch_pos[b], out_rank)
        else:
            start = np.zeros((1,) * out_rank, np.int64)
        if d in offset_of:
            start = start + _ramp(slice_sizes[d], offset_of[d], out_rank)
        index.append(start)
    out = x[tuple(index)]
    if fill and bad.any():
        value = np.asarray(0 if fill_value is None else fill_value, x.dtype)
        if fill_value is None and np.issubdtype(x.dtype, np.floating):
            value = np.asarray(np.nan, x.dtype)
        out = np.where(bad, value, out)
    return out


def _ramp(n: int, axis: int, rank: int) -> np.ndarray:
    """``arange(n)`` laid along ``axis`` of a rank-``rank`` array (size 1 elsewhere)."""
    shape = [1] * rank
    shape[axis] = n
    return np.arange(n).reshape(shape)


def _scatter_index(
    x: np.ndarray, idx: np.ndarray, updates: np.ndarray, dn: Any
) -> tuple[np.ndarray, ...]:
    """The operand index of every update element."""
    batch_shape = idx.shape[:-1]
    rank = updates.ndim
    batch_pos = [i for i in range(rank) if i not in dn.update_window_dims]
    dropped = set(dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()))
    window_of = dict(zip([d for d in range(x.ndim) if d not in dropped], dn.update_window_dims))
    in_batch = dict(
        zip(
            getattr(dn, "operand_batching_dims", ()),
            getattr(dn, "scatter_indices_batching_dims", ()),
        )
    )

    def spread(a: np.ndarray) -> np.ndarray:
        shape = [1] * rank
        for i, pos in enumerate(batch_pos):
            shape[pos] = a.shape[i]
        return a.reshape(shape)

    index = []
    for d in range(x.ndim):
        if d in dn.scatter_dims_to_operand_dims:
            start = spread(idx[..., dn.scatter_dims_to_operand_dims.index(d)].astype(np.int64))
        elif d in in_batch:
            b = in_batch[d]
            start = _ramp(batch_shape[b], batch_pos[b], rank)
        else:
            start = np.zeros((1,) * rank, np.int64)
        if d in window_of:
            start = start + _ramp(updates.shape[window_of[d]], window_of[d], rank)
        index.append(np.broadcast_to(start, updates.shape))
    return tuple(index)


def _scatter_ok(p: Any) -> bool:
    return "FILL" in str(p["mode"]) or "PROMISE" in str(p["mode"])


def _scatter(x: np.ndarray, idx: np.ndarray, updates: np.ndarray, add: bool, dn: Any) -> Any:
    index = _scatter_index(x, idx, updates, dn)
    inside = np.ones(updates.shape, bool)  # out-of-bounds updates are dropped
    for i, d in zip(index, x.shape):
        inside &= (i >= 0) & (i < d)
    picked = tuple(i[inside] for i in index)
    out = np.array(x)
    if add:
        np.add.at(out, picked, updates[inside])
    else:
        out[picked] = updates[inside]
    return out


@_impl("scatter", check=_scatter_ok)
def _scatter_set(
    x: np.ndarray, idx: np.ndarray, updates: np.ndarray, *, dimension_numbers: Any, **_: Any
) -> Any:
    return _scatter(x, idx, updates, False, dimension_numbers)


@_impl("scatter-add", "scatter_add", check=_scatter_ok)
def _scatter_add(
    x: np.ndarray, idx: np.ndarray, updates: np.ndarray, *, dimension_numbers: Any, **_: Any
) -> Any:
    return _scatter(x, idx, updates, True, dimension_numbers)


@_impl("optimization_barrier", multi=True)
def _barrier(*xs: np.ndarray) -> Any:
    return list(xs)


# hookax's own markers: identities once traced.
_IMPLS["hookax_cut"] = lambda x, **_: x
_IMPLS["hookax_site"] = lambda *xs, **_: list(xs)
_MULTI.add("hookax_site")


# References (jax.new_ref): a box holding a NumPy array.
class _Ref:
    __slots__ = ("value",)

    def __init__(self, value: np.ndarray) -> None:
        self.value = np.array(value)


def _ref_index(ref: _Ref, flat: Sequence[Any], tree: Any) -> Any:
    transforms = tree_util.tree_unflatten(tree, list(flat))
    if not transforms:
        return Ellipsis
    if len(transforms) != 1 or not hasattr(transforms[0], "indices"):
        raise NotImplementedError("reference transforms")
    index: list[Any] = []
    for i in transforms[0].indices:
        if hasattr(i, "start") and hasattr(i, "size"):
            start, size, stride = int(i.start), int(i.size), int(i.stride)
            index.append(slice(start, start + size * stride, stride))
        else:
            a = np.asarray(i)
            index.append(int(a) if a.ndim == 0 else a)
    return tuple(index)


def _ref_ok(p: Any) -> bool:
    try:
        leaves = tree_util.tree_unflatten(p["tree"], [0] * p["tree"].num_leaves)
    except Exception:
        return False
    return len(leaves) <= 1 and all(hasattr(t, "indices") for t in leaves)


@_impl("new_ref")
def _new_ref(x: np.ndarray, **_: Any) -> Any:
    return _Ref(x)


@_impl("get", check=_ref_ok)
def _get(ref: _Ref, *flat: Any, tree: Any) -> Any:
    return np.array(ref.value[_ref_index(ref, flat, tree)])


@_impl("swap", check=_ref_ok)
def _swap(ref: _Ref, value: np.ndarray, *flat: Any, tree: Any) -> Any:
    where = _ref_index(ref, flat, tree)
    old = np.array(ref.value[where])
    ref.value[where] = value
    return old


@_impl("addupdate", check=_ref_ok)
def _addupdate(ref: _Ref, value: np.ndarray, *flat: Any, tree: Any) -> Any:
    where = _ref_index(ref, flat, tree)
    ref.value[where] = ref.value[where] + value
    return []


_MULTI.add("addupdate")

_CALLS = {  # primitive -> the parameter holding its body
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "custom_lin": None,
}
_LOOPS = frozenset({"scan", "while", "cond"})


def _subjaxprs(eqn: Any) -> list[Any]:
    out = []
    for v in eqn.params.values():
        for item in v if isinstance(v, tuple | list) else (v,):
            if isinstance(item, jaxcompat.ClosedJaxpr | jaxcompat.Jaxpr):
                out.append(jaxcompat.closed_parts(item)[0])
    return out


def _aval_ok(aval: Any) -> bool:
    if isinstance(aval, core.ShapedArray):
        try:
            return np.dtype(aval.dtype) in _DTYPES
        except TypeError:  # an extended dtype: PRNG keys
            return False
    return type(aval).__name__ == "AbstractRef" and _aval_ok(aval.inner_aval)


def unsupported(jaxpr: Any) -> str | None:
    """The first operation of ``jaxpr`` (a ``Jaxpr``) without a NumPy form here, or None."""
    for v in (*jaxpr.invars, *jaxpr.constvars):
        if not _aval_ok(v.aval):
            return f"an input of type {v.aval}"
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CALLS or name in _LOOPS:
            if _CALLS.get(name, "") is None:
                return name
            for sub in _subjaxprs(eqn):
                why = unsupported(sub)
                if why:
                    return why
        elif name not in _IMPLS or not _CHECKS.get(name, lambda p: True)(eqn.params):
            return name
        for v in eqn.outvars:
            if not _aval_ok(v.aval):
                return f"{name}'s result of type {v.aval}"
    return None


def supported(jaxpr: Any) -> bool:
    return unsupported(jaxpr) is None


def flops(jaxpr: Any) -> float:
    """The multiply-adds of ``jaxpr``'s matmuls, times two; a scan's body counts once per trip."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (xc, _), _ = eqn.params["dimension_numbers"]
            x = eqn.invars[0].aval.shape
            k = math.prod(x[d] for d in xc)
            total += 2.0 * k * math.prod(eqn.outvars[0].aval.shape)
        trips = eqn.params.get("length", 1) if name == "scan" else 1
        for sub in _subjaxprs(eqn):
            total += trips * flops(sub)
    return total


def _read(env: dict[Any, Any], v: Any) -> Any:
    if isinstance(v, jaxcompat.Literal):
        return np.asarray(v.val, dtype=getattr(v.aval, "dtype", None))
    return env[v]


def _as_dtype(x: Any, aval: Any) -> Any:
    if isinstance(x, _Ref) or not isinstance(aval, core.ShapedArray):
        return x
    x = np.asarray(x)
    if x.dtype != aval.dtype:
        x = x.astype(aval.dtype)
    return x


@functools.cache
def _openblas() -> tuple[Any, Any] | None:
    """NumPy's OpenBLAS thread-count functions (its wheels' ``numpy.libs``), or None."""
    import numpy

    for path in glob.glob(os.path.join(os.path.dirname(numpy.__file__) + ".libs", "*openblas*")):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same library
            for suffix in ("64_", ""):
                get = getattr(lib, f"scipy_openblas_get_num_threads{suffix}", None)
                put = getattr(lib, f"scipy_openblas_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    return get, put
        except OSError:
            continue
    return None


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """NumPy's matmuls on one thread: a program's matmuls are small, and OpenBLAS's threads
    wait on each other when other processes hold the cores (a 256x64x64 matmul measured 20 us
    on one thread and up to 2.5 ms on two with the other core busy)."""
    fns = _openblas()
    if fns is None:
        yield
        return
    get, put = fns
    before = get()
    put(1)
    try:
        yield
    finally:
        put(before)


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Run ``jaxpr`` (a ``Jaxpr``) on NumPy arrays; :func:`supported` must hold."""
    with one_blas_thread():
        return _evaluate(jaxpr, consts, args)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x if isinstance(x, _Ref) else np.asarray(x)
    for v, x in zip(jaxpr.invars, args):
        env[v] = x if isinstance(x, _Ref) else np.asarray(x)
    with np.errstate(all="ignore"):
        for eqn in jaxpr.eqns:
            ins = [_read(env, v) for v in eqn.invars]
            outs = _run(eqn, ins)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, core.DropVar):
                    env[v] = _as_dtype(x, v.aval)
    return [_read(env, v) for v in jaxpr.outvars]


def _closed(j: Any) -> tuple[Any, Sequence[Any]]:
    return jaxcompat.closed_parts(j)


def _run(eqn: Any, ins: list[Any]) -> Sequence[Any]:
    name, p = eqn.primitive.name, eqn.params
    if name in _CALLS:
        body, consts = _closed(p[_CALLS[name]])
        if name == "custom_vjp_call" and "num_consts" in p and len(ins) != len(body.invars):
            ins = ins[p["num_consts"] :]
        return _evaluate(body, consts, ins)
    if name == "scan":
        return _scan(p, ins)
    if name == "while":
        return _while(p, ins)
    if name == "cond":
        index, *ops = ins
        branches = p["branches"]
        i = min(max(int(index), 0), len(branches) - 1)
        body, consts = _closed(branches[i])
        return _evaluate(body, consts, ops)
    out = _IMPLS[name](*ins, **p)
    return out if name in _MULTI else [out]


def _scan(p: Any, ins: list[Any]) -> list[Any]:
    body, consts = _closed(p["jaxpr"])
    n_consts, n_carry, _ = jaxcompat.scan_counts(p)
    length = p["length"]
    fixed, carry, xs = ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]
    ys: list[list[Any]] = []
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for i in order:
        outs = _evaluate(body, consts, [*fixed, *carry, *(x[i] for x in xs)])
        carry, y = outs[:n_carry], outs[n_carry:]
        ys.append(y)
    if p["reverse"]:
        ys.reverse()
    y_avals = [v.aval for v in body.outvars[n_carry:]]
    stacked = [
        np.stack([y[j] for y in ys]) if ys else np.zeros((0, *a.shape), a.dtype)
        for j, a in enumerate(y_avals)
    ]
    return [*carry, *stacked]


def _while(p: Any, ins: list[Any]) -> list[Any]:
    cond, cond_consts = _closed(p["cond_jaxpr"])
    body, body_consts = _closed(p["body_jaxpr"])
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cfix, bfix, carry = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
    while bool(_evaluate(cond, cond_consts, [*cfix, *carry])[0]):
        carry = _evaluate(body, body_consts, [*bfix, *carry])
    return carry
