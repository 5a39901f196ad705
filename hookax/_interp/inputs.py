"""Patching grids over call-site *inputs* (``"blocks/0:in"``: the residual stream entering a
block; ``"blocks/0/attn/out:in"``: the heads' outputs before the output projection).

One row per key: the clean run's input captured once, then one compiled program per row, a
``jax.vmap`` over patches of the corrupted forward with a forward pre-hook (``hx.hooks``) that
replaces the call's first positional argument under the patch's mask (positions along ``axis``,
one head along ``heads``). Inside a ``jax.vmap`` around the model (Equinox's idiom) each example
gets its own clean input, and ``axis``/``heads`` index one example's. Layout as
``hx.patch_grid``: ``[key, (head,) column, ...]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._capture.capture import capture
from .._engine import context as _context
from .._engine import firstcall
from .._engine.select import Select
from .._hooks.hooks import hooks
from .._patching import compiled
from .._patching.heads import patch_mask
from .._patching.patch import per_example

__all__ = ["input_grid"]


@firstcall.program(static_argnums=(0, 1))
def _clean_input(rest: compiled.Static, site: str, dyn: list[Any]) -> Any:
    """The first positional argument of ``site``'s call in the run ``rest`` + ``dyn`` stand
    for (the model's arrays are arguments: an NNX module closed over breaks ``nnx.scan``)."""
    fn, args = compiled.join(dyn, rest)
    _, acts = capture(fn, where=Select(paths=site), inputs=True)(*args)
    (value,) = [v for k, v in acts.items() if k.endswith(":in")]
    value = value[0]
    return value[0] if isinstance(value, tuple) else value


@firstcall.program(static_argnums=(0, 1, 2, 3, 4))
def _row(
    rest: compiled.Static,
    site: str,
    metric: Any,
    axis: int,
    heads: int | None,
    dyn: list[Any],
    clean: Any,
    cols: Any,
    hs: Any,
) -> Any:
    def one(col: Any, head: Any) -> Any:
        fn, args = compiled.join(dyn, rest)
        block_trace = _context.current_trace()

        def pre(module: Any, a: tuple[Any, ...]) -> tuple[Any, ...]:
            x = a[0]
            mask = patch_mask(col, head, x.shape, axis, heads, site)
            # inside a vmap entered here (Equinox's jax.vmap(model)): each example its own
            new = per_example(clean, x.shape, _context.call_stack()[-1], block_trace)
            new = new.astype(x.dtype)
            return (new if mask is None else jnp.where(mask, new, x), *a[1:])

        with hooks(where=site, forward_pre=pre):
            return compiled.value_of(metric)(fn(*args))

    if cols is None and hs is None:
        return one(None, None)
    return jax.vmap(one)(cols, hs)


def input_grid(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    metric: Callable[[Any], Any],
    sites: list[str],
    *,
    axis: int,
    n_positions: int | None,
    heads: int | None = None,
    n_heads: int | None = None,
) -> Any:
    """``[site, (head,) position]``: the metric of the corrupted run with each site's input
    patched from the clean run (``n_positions=None``: the whole input, no position axis)."""
    dyn, rest = compiled.split((fn, corrupt_args))
    key = compiled.static_key(metric)
    clean_dyn, clean_rest = compiled.split((fn, clean_args))
    rows = []
    for site in sites:
        clean = _clean_input(clean_rest, site, clean_dyn)
        cols = None if n_positions is None else jnp.arange(n_positions, dtype=jnp.int32)
        hs = None
        if heads is not None and n_heads is not None:
            hs = jnp.repeat(jnp.arange(n_heads, dtype=jnp.int32), 1 if cols is None else len(cols))
            cols = None if cols is None else jnp.tile(cols, n_heads)
        out = _row(rest, site, key, axis, heads, dyn, clean, cols, hs)
        if hs is not None and n_positions is not None:
            out = out.reshape(n_heads, n_positions, *out.shape[1:])
        rows.append(out)
    return jnp.stack(rows)
