"""Helpers over captured values: every layer's value on one axis, a readout of each layer (the
logit lens), and an attention output split by head. Plain functions of ``hx.capture``'s dict,
generic over architectures: unrolled layers (``"layers/*"``) and scanned stacks (``"blocks"``)
give the same layout.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine.select import check_glob, glob_to_regex
from .._util.errors import HookaxError, SelectorError
from .._util.jaxcompat import Tracer
from .labelled import LabelledArray
from .patch import PatchError

__all__ = ["logit_lens", "split_heads", "stack_layers"]


def stack_layers(acts: Mapping[str, tuple[Any, ...]], where: str = "layers/*") -> jax.Array:
    """Every layer's value of a call site, stacked on a new leading (layer) axis.

    ``where`` is a path glob over ``acts``' keys (``"layers/*"``, ``"blocks/*/attn"``): each
    match's value, in call order; or one key: its calls in order when it ran several times (a
    module applied once per layer), or its value as captured when it ran once (a call site in a
    scan over layers is already stacked on the scan axis).

    Args:
      acts: what ``hx.capture`` returns (``{key: (value per call, ...)}``).
      where: a glob or a key; ``"path:method"`` for a method other than ``__call__``.

    Raises:
      SelectorError: ``where`` matched no key of ``acts`` (the message lists them).
      PatchError: a matched key ran more than once under a glob, or values differ in shape.

    Examples:
      >>> import jax.numpy as jnp
      >>> acts = {"layers/0": (jnp.zeros((2, 3)),), "layers/1": (jnp.ones((2, 3)),)}
      >>> stack_layers(acts, "layers/*").shape
      (2, 2, 3)
      >>> stack_layers({"blocks": (jnp.zeros((4, 2, 3)),)}, "blocks").shape  # scanned: as is
      (4, 2, 3)
    """
    path, _, method = where.partition(":")
    if path:
        check_glob(path)
    if "*" not in path:
        if where not in acts:
            _missing(where, acts)
        values = acts[where]
        return values[0] if len(values) == 1 else _stack(where, values)
    rx = glob_to_regex(path)
    keys = [
        k
        for k in acts
        if rx.fullmatch(k.partition(":")[0]) and k.partition(":")[2] == (method or "")
    ]
    if not keys:
        _missing(where, acts)
    for k in keys:
        if len(acts[k]) != 1:
            raise PatchError(
                f"hx.stack_layers: {k!r} ran {len(acts[k])} times; with a glob each key gives "
                f"one layer. Fix: stack that key alone, hx.stack_layers(acts, {k!r})."
            )
    return _stack(where, [acts[k][0] for k in keys])


def _stack(where: str, values: Any) -> jax.Array:
    shapes = {tuple(jnp.shape(v)) for v in values}
    if len(shapes) != 1:
        raise PatchError(
            f"hx.stack_layers({where!r}): the values have different shapes {sorted(shapes)}; "
            "only values of one shape stack. Fix: a where= that picks one kind of call site."
        )
    values = list(values)
    if _on_cpu(values):  # copied on the host: no program compiled for a new shape
        return jax.device_put(np.stack([np.asarray(v) for v in values]), values[0].sharding)
    return jnp.stack(values)


def _on_cpu(values: list[Any]) -> bool:
    """Whether ``values`` are concrete arrays of one CPU device with a NumPy dtype (not weakly
    typed: NumPy would not keep it)."""
    if not all(isinstance(v, jax.Array) and not isinstance(v, Tracer) for v in values):
        return False
    sharding = values[0].sharding
    return (
        isinstance(sharding, jax.sharding.SingleDeviceSharding)
        and getattr(next(iter(sharding.device_set)), "platform", None) == "cpu"
        and all(
            v.sharding == sharding
            and not getattr(v, "weak_type", False)
            and not jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended)
            for v in values
        )
    )


def _missing(where: str, acts: Mapping[str, Any], call: str = "hx.stack_layers(acts, ") -> None:
    keys = list(acts)
    near = difflib.get_close_matches(where, keys, n=6, cutoff=0.0) or keys[:6]
    found = f"where={where!r} matched no captured key; the keys include " + ", ".join(
        repr(k) for k in near
    )
    layers = _layer_globs(keys)
    if layers:
        glob, n = layers[0]
        fix = f"pass where= naming the layers these keys hold: {call}where={glob!r}) ({n} layers)"
    else:
        fix = f"capture the layers with hx.capture(fn, where={where!r}) and pass its dict"
    raise SelectorError(f"{call.split('(')[0]}: {found}. Fix: {fix}.")


def _layer_globs(keys: list[str]) -> list[tuple[str, int]]:
    """Globs of ``keys`` with one numbered segment, the most layers first:
    ``[("blocks/*", 4)]`` for ``blocks/0`` ... ``blocks/3``."""
    counts: dict[str, int] = {}
    for k in keys:
        path, colon, method = k.partition(":")
        segs = path.split("/")
        for i, seg in enumerate(segs):
            if seg.isdigit():
                glob = "/".join([*segs[:i], "*", *segs[i + 1 :]]) + colon + method
                counts[glob] = counts.get(glob, 0) + 1
    return sorted(((g, n) for g, n in counts.items() if n > 1), key=lambda gn: -gn[1])


def logit_lens(
    readout: Callable[[Any], Any], acts: Mapping[str, tuple[Any, ...]], where: str = "layers/*"
) -> LabelledArray:
    """``readout`` applied to every layer's value: ``[layer, *readout's output]``.

    With ``readout`` the model's final norm and unembedding, this is the logit lens (what each
    layer's residual stream would predict if the model stopped there). The layers are those of
    [`hx.stack_layers`][hookax.stack_layers] (unrolled or scanned); ``readout`` runs under
    ``jax.vmap`` over them.

    Returns:
      A [`hx.LabelledArray`][hookax.LabelledArray] whose ``rows`` name the layers: the keys
      ``where`` matched, or ``key[i]`` for the layers of one key's value (``key#i`` for its
      calls); the readout's axes are not labelled.

    Examples:
      >>> import jax.numpy as jnp
      >>> acts = {"layers/0": (jnp.ones((1, 2)),), "layers/1": (2 * jnp.ones((1, 2)),)}
      >>> lens = logit_lens(lambda h: h.sum(-1), acts)
      >>> lens
      LabelledArray(f32[2,1], layer=['layers/0', 'layers/1'])
      >>> lens.values
      Array([[2.],
             [4.]], dtype=float32)
    """
    if isinstance(readout, Mapping) and callable(acts):
        raise _ArgumentOrder(
            "hx.logit_lens(readout, acts, where): the first argument is a dict of captured "
            f"values and the second a {type(acts).__name__}; the readout comes first. Fix: "
            "hx.logit_lens(readout, acts)."
        )
    if not isinstance(acts, Mapping):
        raise _ArgumentOrder(
            f"hx.logit_lens(readout, acts, where): acts is a {type(acts).__name__}, not the dict "
            "hx.capture returns. Fix: y, acts = hx.capture(fn, where=...)(x); "
            "hx.logit_lens(readout, acts)."
        )
    try:
        stacked = stack_layers(acts, where)
    except SelectorError as e:
        if not str(e).startswith("hx.stack_layers: where="):
            raise
        stacked = None
    if stacked is None:
        _missing(where, acts, "hx.logit_lens(readout, acts, ")
    values = jax.vmap(readout)(stacked)
    return LabelledArray(values, ("layer",), (_layer_names(acts, where),), title="readout")


class _ArgumentOrder(HookaxError, TypeError):
    """Arguments of the wrong kinds, in the wrong order."""


def _layer_names(acts: Mapping[str, tuple[Any, ...]], where: str) -> list[str]:
    """The names of :func:`stack_layers`' layers: the matched keys, a key's calls (``#i``),
    or the layers stacked in one value (``[i]``)."""
    path, _, method = where.partition(":")
    if "*" not in path:
        values = acts[where]
        if len(values) > 1:
            return [f"{where}#{i}" for i in range(len(values))]
        return [f"{where}[{i}]" for i in range(jnp.shape(values[0])[0])]
    rx = glob_to_regex(path)
    return [
        k
        for k in acts
        if rx.fullmatch(k.partition(":")[0]) and k.partition(":")[2] == (method or "")
    ]


def split_heads(x: Any, n_heads: int, axis: int = -1) -> jax.Array:
    """An attention output with heads concatenated on ``axis`` (``d = n_heads * d_head``), with
    that axis split into ``(n_heads, d_head)``.

    Examples:
      >>> split_heads(jnp.arange(8.0).reshape(1, 8), 2)[0]
      Array([[0., 1., 2., 3.],
             [4., 5., 6., 7.]], dtype=float32)
    """
    x = jnp.asarray(x)
    ax = axis % x.ndim
    d = x.shape[ax]
    if not isinstance(n_heads, int) or n_heads < 1 or d % n_heads:
        raise PatchError(
            f"hx.split_heads: axis {axis} has size {d}, which {n_heads!r} heads do not divide. "
            f"Fix: pass the number of heads of the layer whose output this is."
        )
    return x.reshape(*x.shape[:ax], n_heads, d // n_heads, *x.shape[ax + 1 :])
