"""TransformerLens' patching sweeps as ``hx.patch_grid`` calls: every block's residual stream,
attention and MLP output (``get_act_patch_block_every``), and every head's output, queries,
keys, values and pattern (``get_act_patch_attn_head_by_pos_every`` /
``..._all_pos_every``), in TransformerLens' layout.

Each kind of target is one grid, its rows the layers (an unrolled stack's keys, or a scanned
stack's layers by suffix, ``"blocks[3]"``). ``resid_pre`` of block ``l > 0`` is patched as
block ``l - 1``'s output, which is the same value; block 0's input (the embeddings' sum) and the
heads' outputs entering the output projection (``z``) are inputs of call sites, patched through
a forward pre-hook (:mod:`.inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._capture.capture import capture
from .._engine.select import Select
from .._patching import compiled
from .._patching.grid import patch_grid
from .._patching.heads import head_size_error
from .._patching.labelled import LabelledArray, Unpatched
from .._util.errors import HookaxError
from .inputs import input_grid
from .names import Name, Names
from .resid import Components

__all__ = ["patch_block_every", "patch_head_every"]

HEAD_KINDS = ("z", "q", "k", "v", "pattern")
TITLE = "patched metric"


def count_layers(fn: Any, args: tuple[Any, ...], where: str) -> int:
    """How many layers ``where`` names: its keys (unrolled) or the scan's length (stacked)."""
    dyn, rest = compiled.split((fn, args))

    def run(dyn: list[Any]) -> Any:
        f, a = compiled.join(dyn, rest)
        return capture(f, where=Select(paths=where))(*a)[1]

    acts = jax.eval_shape(run, dyn)
    if len(acts) > 1:
        return len(acts)
    ((_, values),) = acts.items()
    if "*" in where:  # a glob matching one key: one layer
        return len(values)
    return int(values[0].shape[0])  # a scanned stack's one key, stacked by layer


def _positions(positions: Any, who: str) -> Any:
    if positions not in ("each", None):
        raise HookaxError(f"{who}: positions= takes 'each' or None, got {positions!r}.")
    return positions


def patch_block_every(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    metric: Callable[[Any], Any],
    components: Components,
    *,
    positions: Any = "each",
    axis: int = 1,
    chunk_size: int | None = None,
) -> LabelledArray:
    """Every block's ``resid_pre``, attention output and MLP output patched from the clean run,
    one at a time, at each position: ``[3, n_layers, n_positions]`` (``positions=None``:
    whole values, ``[3, n_layers]``), as TransformerLens' ``get_act_patch_block_every``.

    ``components`` needs ``blocks``, ``attn`` and ``mlp``. Row 0 is ``resid_pre``: block
    ``l``'s input, patched as block ``l - 1``'s output for ``l > 0`` (the same value) and as
    block 0's input for ``l = 0``.

    Returns a [`hx.LabelledArray`][hookax.LabelledArray]: its axes ``component``
    (``resid_pre``, ``attn_out``, ``mlp_out``), ``layer`` (``L0``...) and ``position``, with
    the metric of the clean and corrupted runs.
    """
    who = "hx.patch_block_every"
    c = components
    if c.blocks is None or c.mlp is None:
        raise HookaxError(f"{who}: Components(blocks=..., attn=..., mlp=...) are all needed.")
    _positions(positions, who)
    n = count_layers(fn, corrupt_args, c.attn)
    blocks, attn, mlp = Name(c.blocks), Name(c.attn), Name(c.mlp)
    where = [attn.layer(i) for i in range(n)] + [mlp.layer(i) for i in range(n)]
    where += [blocks.layer(i) for i in range(n - 1)]
    grid = patch_grid(
        fn,
        clean_args,
        corrupt_args,
        metric,
        where=[str(w) for w in where],
        positions=positions,
        axis=axis,
        chunk_size=chunk_size,
    )
    n_pos = None if positions is None else grid.shape[1]
    first = input_grid(
        fn, clean_args, corrupt_args, metric, [str(blocks.layer(0))], axis=axis, n_positions=n_pos
    )
    resid = jnp.concatenate([first, grid[2 * n :]])
    out = jnp.stack([resid, grid[:n], grid[n : 2 * n]])
    axes = ("component", "layer", "position")[: out.ndim]
    labels = [("resid_pre", "attn_out", "mlp_out"), [f"L{i}" for i in range(n)], grid.columns]
    return LabelledArray(out, axes, labels[: len(axes)], unpatched=grid.unpatched, title=TITLE)


def patch_head_every(
    fn: Callable[..., Any],
    clean_args: tuple[Any, ...],
    corrupt_args: tuple[Any, ...],
    metric: Callable[[Any], Any],
    names: Names,
    *,
    which: tuple[str, ...] = HEAD_KINDS,
    positions: Any = "each",
    chunk_size: int | None = None,
) -> LabelledArray:
    """Every head's ``z`` (its output before the output projection), queries, keys, values and
    pattern patched from the clean run, one head and position at a time, in TransformerLens'
    layout: ``[len(which), n_layers, n_positions, n_heads]`` as
    ``get_act_patch_attn_head_by_pos_every``; ``positions=None``: each head at every position,
    ``[len(which), n_layers, n_heads]`` as ``get_act_patch_attn_head_all_pos_every``.

    ``names`` holds each name of ``which`` with its axes named, ``head`` and the position
    (``pos``; ``query`` for the pattern, as TransformerLens patches a pattern by destination
    position): [`hx.transformer_names`][hookax.transformer_names] gives them for Flax's and
    Equinox's attention modules. ``hx.patch_grid``'s own layout is ``[target, head, position]``:
    this is its transpose.

    Returns a [`hx.LabelledArray`][hookax.LabelledArray]: its axes ``kind`` (``which``),
    ``layer`` (``L0``...), ``position`` and ``head`` (``H0``...), with the metric of the
    clean and corrupted runs when a kind other than ``z`` ran (``z`` alone: None).
    """
    who = "hx.patch_head_every"
    _positions(positions, who)
    n = count_layers(fn, corrupt_args, str(names[which[0]]).partition(":")[0])
    out: list[Any] = []
    unpatched: Unpatched | None = None  # the first grid's (none for z alone)
    for kind in which:
        name = names[kind]
        heads = names.axis(kind, "head")
        axis = names.axis(kind, "query" if "query" in (name.axes or ()) else "pos")
        rows = [name.layer(i) for i in range(n)]
        if name.kind == "input":
            sites = [str(r).rpartition(":")[0] for r in rows]
            n_heads = _n_heads(fn, corrupt_args, sites[0], heads)
            if names.n_heads is not None and n_heads != names.n_heads:
                shape = tuple(_input_spec(fn, corrupt_args, sites[0]).shape)
                raise head_size_error(who, str(rows[0]), shape, heads, names.n_heads)
            n_pos = None if positions is None else _size(fn, corrupt_args, sites[0], axis)
            grid = input_grid(
                fn,
                clean_args,
                corrupt_args,
                metric,
                sites,
                axis=axis,
                n_positions=n_pos,
                heads=heads,
                n_heads=n_heads,
            )
        else:
            target = {"ops" if name.kind == "op" else "where": [str(r) for r in rows]}
            grid = patch_grid(
                fn,
                clean_args,
                corrupt_args,
                metric,
                **target,
                heads=heads,
                positions=positions,
                axis=axis,
                chunk_size=chunk_size,
                n_heads=names.n_heads,
            )
            unpatched = grid.unpatched if unpatched is None else unpatched
        out.append(grid if positions is None else jnp.swapaxes(grid, 1, 2))
    values = jnp.stack(out)
    axes = ("kind", "layer", "head") if positions is None else ("kind", "layer", "position", "head")
    hs = [f"H{h}" for h in range(values.shape[-1])]
    labels: list[Sequence[str]] = [which, [f"L{i}" for i in range(n)]]
    labels += [hs] if positions is None else [[str(p) for p in range(values.shape[2])], hs]
    return LabelledArray(values, axes, labels, unpatched=unpatched, title=TITLE)


def _input_spec(fn: Any, args: tuple[Any, ...], site: str) -> Any:
    dyn, rest = compiled.split((fn, args))

    def run(dyn: list[Any]) -> Any:
        f, a = compiled.join(dyn, rest)
        acts = capture(f, where=Select(paths=site), inputs=True)(*a)[1]
        (value,) = [v for k, v in acts.items() if k.endswith(":in")]
        return value[0][0] if isinstance(value[0], tuple) else value[0]

    return jax.eval_shape(run, dyn)


def _n_heads(fn: Any, args: tuple[Any, ...], site: str, heads: int) -> int:
    return int(_input_spec(fn, args, site).shape[heads])


def _size(fn: Any, args: tuple[Any, ...], site: str, axis: int) -> int:
    return int(_input_spec(fn, args, site).shape[axis])
