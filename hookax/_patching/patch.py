"""``hx.patching``: chosen call-site outputs replaced by given values for the duration of a block.

The block is one ``hx.intercept`` whose interceptor closes over the values, positions and axis
only, so its cache key follows :mod:`hookax._util.fnkey`: arrays by identity. Inside a jitted
function that takes the values and positions as arguments they are tracers, and one trace serves
every value and position. Everything else a block needs while it runs (which keys ran, per-call
counts, the run counter of scanned call sites) lives in a per-thread stack of block states, out
of the key.

A value with one more leading axis than its call site's output holds one value per run of the
call site, as ``hx.capture`` stacks a call site inside a scan over layers: the i-th run gets
entry ``i mod n``. Runs are counted by a JAX reference created when the block is entered; a scan
body closes over it, so layer ``l`` of a scanned stack gets entry ``l`` without the engine knowing
the layer index.
"""

from __future__ import annotations

import contextlib
import difflib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import context as _context
from .._engine.select import split_layers
from .._hooks.intercept import intercept
from .._hooks.layergate import layer_pred
from .._util.errors import HookaxError, SelectorError
from .._util.jaxcompat import batching as _batching
from .._util.parts import leaf_at, parts, replace_at, sole_array, split_part, unwrap_sole
from .._util.specs import describe_tree

__all__ = ["PatchError", "patching", "position_mask"]

WHO = "hx.patching"
_BY_VALUE = (int, float, complex, str, bytes, bool, type(None))


class PatchError(HookaxError, ValueError):
    """A patch value or position of the wrong shape, dtype or kind for its call site."""


def scalar_metric(m: Any, who: str, error: type[Exception] = PatchError) -> Any:
    """``m``, a metric's value to differentiate; ``error`` naming ``who`` if not a scalar."""
    if jnp.shape(m) != ():
        raise error(
            f"{who}: the metric must return a scalar to be differentiated, got shape "
            f"{jnp.shape(m)}. Fix: reduce it, e.g. lambda y: y[0, -1, a] - y[0, -1, b]."
        )
    return m


class _State:
    """One active block: its spec, and what happened while it ran."""

    __slots__ = ("applied", "calls", "counts", "seen", "spec", "trace")

    def __init__(self, spec: tuple[Any, ...], counts: Any) -> None:
        self.spec = spec
        self.trace = _context.current_trace()  # where the block was entered (see per_example)
        self.counts = counts  # a jax reference of int32[n_keys]: runs of each stacked key
        self.calls: dict[str, int] = {}  # calls of each key in the current forward (trace time)
        self.seen: set[str] = set()
        self.applied: set[str] = set()


class _Local(threading.local):
    def __init__(self) -> None:
        self.blocks: list[_State] = []


_LOCAL = _Local()


def _same(a: Any, b: Any) -> bool:
    """Equal as :class:`~hookax._util.fnkey.FnKey` compares closures: simple values by value,
    tuples element by element, anything else by identity."""
    if a is b:
        return True
    if type(a) is tuple and type(b) is tuple:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return isinstance(a, _BY_VALUE) and type(a) is type(b) and a == b


def _state(spec: tuple[Any, ...]) -> _State:
    # hx.intercept interns equal entries: the interceptor running may be an earlier block's
    # closure over an equal spec, so the state is found by equality, innermost first.
    for state in reversed(_LOCAL.blocks):
        if _same(state.spec, spec):
            return state
    raise HookaxError(f"{WHO}: a patch ran outside its block")  # pragma: no cover


def _interceptor(spec: tuple[Any, ...]) -> Callable[..., Any]:
    def patch_call(next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: Any) -> Any:
        return _run(spec, next_fun, args, kwargs, context)

    return patch_call


def _run(
    spec: tuple[Any, ...], next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: Any
) -> Any:
    items = spec[0]
    state = _state(spec)
    if context.path == ():  # a new forward pass: per-call counts start again
        state.calls.clear()
    key = context.key
    state.seen.add(key)
    # Every target of this call applies, one after the other: several layers of a scanned
    # stack ("blocks[0]", "blocks[1]": each under its layer's mask), or several arrays of one
    # output ("layers/1.0", "layers/1.1").
    for k, (target, entries) in enumerate(items):
        site, is_input = split_input(target)
        if is_input and split_layers(site)[0] == key:  # "blocks/1:in": the call's input
            value = _one_input(args, target)
            layers = split_layers(site)[1]
            args = (_patch(spec, k, target, entries, value, args, kwargs, context, "", layers),)
    out = next_fun(*args, **kwargs)
    for k, (target, entries) in enumerate(items):
        site, is_input = split_input(target)
        if is_input:
            continue
        base, layers = split_layers(site)
        part = ""
        if base != key:  # "layers/1.0": an array inside the output of "layers/1"
            whole, part = split_part(site)
            base, layers = split_layers(whole)
        if base == key:
            out = _patch(spec, k, target, entries, out, args, kwargs, context, part, layers)
    return out


def split_input(target: str) -> tuple[str, bool]:
    """A target key as ``(call-site key, whether it names the call's input)``: ``"blocks/1:in"``
    (as ``hx.capture(..., inputs=True)`` names it) is the input of ``"blocks/1"``.

    Examples:
      >>> split_input("blocks/1:in"), split_input("blocks/1")
      (('blocks/1', True), ('blocks/1', False))
    """
    if target.endswith(":in"):
        return target[: -len(":in")], True
    return target, False


def _one_input(args: tuple, target: str) -> Any:
    if len(args) != 1:
        raise PatchError(
            f"{WHO}: {target!r} names the input of a call that takes {len(args)} positional "
            f"arguments; an input target is a call's one positional argument (as hx.capture "
            f"records it). Fix: patch the output of the call site that computes it."
        )
    return args[0]


def _patch(
    spec: tuple[Any, ...],
    k: int,
    target: str,
    entries: tuple,
    out: Any,
    args: tuple,
    kwargs: dict,
    context: Any,
    part: str = "",
    layers: Any = None,
) -> Any:
    """``out`` (a call's output, or its input) with the patch of ``target`` applied; ``part``
    names the array inside it (``".0"``), ``layers`` the layers of a scanned stack."""
    _, positions, axis, shift = spec
    state = _state(spec)
    key = context.key
    n = state.calls.get(target, 0)
    state.calls[target] = n + 1
    state.applied.add(target)
    leaf = _part_of(out, part, key) if part else out
    sole = sole_array(leaf)  # a NamedArray: its array patched, its names kept
    if sole is not None:
        leaf = sole[0]
    value = _value_for(key + part, k, leaf, entries[n % len(entries)], state, context)
    if shift:
        value = leaf + value
    mask = position_mask(positions, leaf.shape, axis, key + part)
    if layers is not None:  # one layer of a scanned stack: "blocks/mlp[3]"
        pred = layer_pred(context._frame, layers, (args, kwargs))
        mask = pred if mask is None else mask & pred
    new = value if mask is None else jnp.where(mask, value, leaf)
    if sole is not None:
        new = sole[1].unflatten([new])
    return replace_at(out, part, new) if part else new


def _part_of(out: Any, part: str, key: str) -> Any:
    try:
        return leaf_at(out, part)
    except KeyError:
        raise PatchError(
            f"{WHO}: {key + part!r} names no array in the output of call site {key!r}, "
            f"{describe_tree(out)}. Fix: name one of its arrays: {_arrays(out, key)}."
        ) from None


def _arrays(out: Any, key: str) -> str:
    """The targets naming the arrays of ``out``: ``'layers/1.0'``."""
    names = [repr(key + p) for p, leaf in parts(out) if hasattr(leaf, "shape")]
    return ", ".join(names) or "none (it holds no array)"


def _value_for(key: str, k: int, out: Any, entry: Any, state: _State, context: Any) -> Any:
    """The value replacing ``out``: ``entry`` itself, or its entry for this run of ``key``."""
    if not isinstance(out, jax.Array | np.ndarray):
        arrays = [repr(key + p) for p, leaf in parts(out) if isinstance(leaf, jax.Array)]
        inside = f"name an array inside it ({', '.join(arrays)}), or " if arrays else ""
        raise PatchError(
            f"{WHO}: call site {key!r} returned a {type(out).__name__}; only array outputs can "
            f"be patched. Fix: {inside}patch a call site inside it that returns an array."
        )
    value = per_example(jnp.asarray(entry), out.shape, context._frame, state.trace)
    if value.shape == out.shape:
        return value.astype(out.dtype)
    if value.ndim == out.ndim + 1 and value.shape[1:] == out.shape:
        layer = context.layer  # inside a scan over layers: the traced layer index
        if layer is not None:
            return jax.lax.dynamic_index_in_dim(value, layer, 0, keepdims=False).astype(out.dtype)
        counts = state.counts
        run = counts[...][k]
        counts[...] = counts[...].at[k].add(1)
        at = jax.lax.rem(run, jnp.int32(value.shape[0]))
        return jax.lax.dynamic_index_in_dim(value, at, 0, keepdims=False).astype(out.dtype)
    raise PatchError(
        f"{WHO}: the value for call site {key!r} has shape {tuple(value.shape)}, but its output "
        f"has shape {tuple(out.shape)}. Expected {tuple(out.shape)}, or (n, "
        f"{', '.join(map(str, out.shape))}) for one value per run of the call site (the layers "
        f"of a scanned stack, as hx.capture stacks them). Fix: pass the call site's own "
        f"captured value, hx.capture(fn, where={key!r})(*args)[1][{key!r}]."
    )


def per_example(value: Any, shape: tuple[int, ...], frame: Any, block_trace: Any) -> Any:
    """``value`` as each example of the vmaps around the call sees it.

    A call site inside a vmap entered within the block (Equinox's ``jax.vmap(model)(tokens)``)
    has per-example outputs of ``shape``, while its captured value holds every example, the
    vmaps' axes first (as ``hx.capture`` stacks them). Each such leading axis becomes that
    vmap's batch axis, so example ``i`` gets ``value[i]``; other values are returned as they are.
    """
    for vmap in _context.vmaps_between(frame.trace, block_trace):
        if value.ndim <= len(shape) or value.shape[0] != vmap.axis_data.size:
            break
        value = _batching.BatchTracer(vmap, value, 0)
    return value


def position_mask(positions: Any, shape: tuple[int, ...], axis: int, key: str) -> Any:
    """A boolean mask that broadcasts against an output of ``shape``, or None for everything.

    ``positions`` is an index along ``axis`` (a scalar or a 1-d integer array of several), or a
    boolean mask over axes ``axis - k + 1 .. axis`` (a 1-d mask over ``axis`` alone, a 2-d mask
    over the axis before it too, ...).

    Examples:
      >>> position_mask(2, (1, 4, 3), 1, "x").ravel().tolist()
      [False, False, True, False]
      >>> position_mask(jnp.array([True, False]), (2, 5), 0, "x").shape
      (2, 1)
    """
    if positions is None:
        return None
    nd = len(shape)
    if not -nd <= axis < nd:
        raise PatchError(
            f"{WHO}: axis={axis} is out of range for call site {key!r}, whose output has shape "
            f"{tuple(shape)}. Fix: axis= names the position axis of the output (1 for "
            f"(batch, position, features))."
        )
    ax = axis % nd
    p = jnp.asarray(positions)
    if p.dtype == jnp.bool_:
        want = tuple(shape[ax - p.ndim + 1 : ax + 1])
        if p.ndim == 0 or p.ndim > ax + 1 or tuple(p.shape) != want:
            raise PatchError(
                f"{WHO}: the position mask has shape {tuple(p.shape)}, but call site {key!r} "
                f"has {shape[ax]} positions along axis {axis} of its output {tuple(shape)}. "
                f"Expected a mask ending at axis {axis}, e.g. of shape {(shape[ax],)}."
            )
        m = p
    elif jnp.issubdtype(p.dtype, jnp.integer) and p.ndim <= 1:
        index = jnp.arange(shape[ax], dtype=p.dtype)
        m = index == p if p.ndim == 0 else (index[:, None] == p[None, :]).any(-1)
    else:
        raise PatchError(
            f"{WHO}: positions= takes an index, a 1-d array of indices or a boolean mask, got "
            f"{p.dtype}{list(p.shape)} for call site {key!r}. Fix: positions=3, "
            f"positions=jnp.array([2, 5]) or positions=jnp.arange({shape[ax]}) == 3."
        )
    return m.reshape(m.shape + (1,) * (nd - ax - 1))


def _entries(key: Any, value: Any) -> tuple[Any, ...]:
    if not isinstance(key, str):
        raise PatchError(
            f"{WHO}: keys are call-site keys as hx.capture names them ('layers/0', "
            f"'encoder:encode'), got {key!r}."
        )
    entries = tuple(value) if isinstance(value, list | tuple) else (value,)
    entries = tuple(unwrap_sole(e) for e in entries)  # NamedArrays as their arrays
    for entry in entries:
        if not hasattr(entry, "shape") or not hasattr(entry, "dtype"):
            raise PatchError(
                f"{WHO}: the value for call site {key!r} must be an array, or a tuple of "
                f"arrays with one per call (as hx.capture gives them), got {entry!r}."
            )
    if not entries:
        raise PatchError(f"{WHO}: the value for call site {key!r} is an empty sequence.")
    return entries


def patching(
    values: Mapping[str, Any], *, positions: Any = None, axis: int = 1
) -> contextlib.AbstractContextManager[None]:
    """Replace the outputs of call sites with given values for the duration of a ``with`` block.

    ``values`` maps call-site keys (as [`hx.capture`][hookax.capture] names them: ``"layers/3"``,
    ``"encoder:encode"``; ``"layers/3:in"`` for the call's one positional argument) to the value
    their output (or input) takes: an array of the output's shape, or a
    tuple with one per call (what ``hx.capture`` returns for the key: the i-th call gets the
    i-th). An array with one more leading axis than the output holds one value per run of a call
    site inside a loop: in a scan over stacked layers, layer ``l`` gets ``value[l]`` (the
    unsuffixed key of a scanned stack patches every layer).

    ``positions`` restricts the patch: ``None`` replaces the whole output; an index or a 1-d
    array of indices along ``axis``; or a boolean mask ending at ``axis`` (shape ``(T,)`` over
    the positions, ``(B, T)`` over batch and positions for ``axis=1``). Elsewhere the output is
    the call's own.

    Inside a ``jax.vmap`` entered within the block (Equinox's ``jax.vmap(model)(tokens)``), a
    value with the vmap's axis in front (as ``hx.capture`` gives it) gives each example its own
    entry, and ``positions``/``axis`` index the per-example output.

    Pass the values and positions as arguments of the jitted function that holds the block:
    one trace then serves them all (arrays closed over are keyed by identity, so a new array
    retraces, correctly). Works eagerly, under ``jax.jit``/``nnx.jit`` with the model as an
    argument, inside ``jax.vmap`` (over positions or values) and scans over layers; stacked
    values are counted with a JAX reference, which ``jax.grad`` through a scan does not support.

    Args:
      values: ``{key: value}``.
      positions: which positions of each output to replace; default all.
      axis: the position axis of the outputs.

    Raises:
      SelectorError: at the end of the block, when a key matched no call site that ran.
      PatchError: a value or mask of the wrong shape for its call site (names the key, the
        expected and the given shapes).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.tanh)
      >>> @jax.jit
      ... def run(model, x, value, pos):
      ...     with hx.patching({"layers/0": value}, positions=pos):
      ...         return model(x)
      >>> x = jnp.ones((1, 3, 2))
      >>> run(model, x, jnp.zeros((1, 3, 2)), 1)[0, :, 0] == 0
      Array([False,  True, False], dtype=bool)
    """
    if not isinstance(values, Mapping) or not values:
        raise PatchError(
            f"{WHO}: values= takes a non-empty dict {{call-site key: value}}, got {values!r}. "
            "Fix: hx.patching({'layers/3': clean_value})."
        )
    if not isinstance(axis, int | np.integer):
        raise PatchError(f"{WHO}: axis= takes an int, got {axis!r}.")
    items = tuple((k, _entries(k, v)) for k, v in values.items())
    if positions is not None:
        p = jnp.asarray(positions)
        if p.dtype != jnp.bool_ and not jnp.issubdtype(p.dtype, jnp.integer):
            raise PatchError(
                f"{WHO}: positions= takes an index, indices or a boolean mask, got dtype "
                f"{p.dtype}. Fix: positions=3 or positions=jnp.arange(T) == 3."
            )
    return _block((items, positions, int(axis), False))


def shifting(values: Mapping[str, Any]) -> contextlib.AbstractContextManager[None]:
    """Like :func:`patching` (whole values), but each value is added to the target's own:
    with zeros, differentiating with respect to them gives the targets' gradients, every
    target's at once (a replaced value would cut the targets before it off the metric)."""
    return _block((tuple((k, _entries(k, v)) for k, v in values.items()), None, 0, True))


@contextlib.contextmanager
def _block(spec: tuple[Any, ...]) -> Iterator[None]:
    items = spec[0]
    state = _State(spec, jax.new_ref(jnp.zeros(len(items), jnp.int32)))
    _LOCAL.blocks.append(state)
    try:
        with intercept(_interceptor(spec)):
            yield
    finally:
        _LOCAL.blocks.remove(state)
    _check(state, [k for k, _ in items])


def _check(state: _State, keys: list[str]) -> None:
    if not state.seen:  # nothing ran in Python (a cached trace): the first run checked it
        return
    for key in keys:
        if key not in state.applied:
            seen = sorted(state.seen)
            near = difflib.get_close_matches(key, seen, n=6, cutoff=0.0) or seen[:6]
            raise SelectorError(
                f"{WHO}: the key {key!r} matched no call site; those that ran include "
                f"{', '.join(repr(s) for s in near)}. Fix: use a key as hx.capture names it."
            )
