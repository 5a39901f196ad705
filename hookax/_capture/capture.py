"""``hx.capture``: the outputs of selected call sites, delivered as values of the computation.

A capture call is a *session* (``_tags``): an interceptor active for the call (part of the jit
cache key) marks each selected call site's output with the ``hookax_tag`` primitive, and a
forwarding trace collects the marks, re-tracing every inner jaxpr that holds one so its values
leave the transform as outputs (``_tagrules``). See ``docs/design.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._engine import adapters as _adapters
from .._engine import eager as _eager
from .._engine.select import (
    ALL_METHODS,
    CALL_ONLY,
    Select,
    Where,
    as_selector,
    check_matched,
    input_entries,
    resolve_instances,
)
from .._hooks import intercept as _intercept
from .._hooks import layergate as _layergate
from .._transforms import tagrules as _tagrules
from .._transforms import tags as _tags
from .._util.errors import HookaxError, SelectorError
from .._util.fnkey import FnKey, reachable
from .._util.parts import leaf_at, parts, replace_at, split_part, with_axes
from .._util.words import counted
from ..frameworks._functions import as_program
from . import jitted as _jitted
from . import ops as _ops

__all__ = ["capture", "session"]


@dataclasses.dataclass(frozen=True)
class _Marker:
    """The interceptor of session ``sid``: marks the selected call sites' outputs.

    It sees every call site (its entry selects all of them) so that a ``where=`` matching none
    can be reported with the paths that did run. Compared by value: it is part of the cache key.
    """

    sid: int
    selector: Any
    # Also mark calls' inputs (what forward pre-hooks see) as "key:in": True for the selected
    # call sites, or a Selector of the call sites whose inputs (only) are recorded too.
    inputs: Any = False
    # where= entries naming parts of outputs or inputs ("layers/*.1", "blocks/0.0:in"): a
    # _Parts, or None when none does (every selected value marked whole).
    parts: Any = None
    # The dispatcher runs recorders outside every interceptor: a capture records what the
    # caller received, whether the intercept block is inside or around the captured function.
    records_output = True

    def __call__(self, next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        live = _tags.live_session(self.sid)
        if live is not None:
            live.seen.add((ctx.key, ctx.path_str))
        out_hit = self.selector.matches(ctx)
        ins = self.selector if self.inputs is True else self.inputs or None
        in_hit = out_hit if ins is self.selector else ins is not None and ins.matches(ctx)
        if not out_hit and not in_hit:
            return next_fun(*args, **kwargs)
        if live is not None:
            live.matched = True
            _check_collision(live, ctx)
        split = self.parts
        if in_hit:  # the input's keys start first
            whole = ins if split is None else split.inputs
            in_keys = self._named(whole, split and split.input_parts, ctx, live, ":in")
            value = args[0] if len(args) == 1 else tuple(args)
            value = self._tag_all(value, in_keys, ctx)
            args = (value,) if len(args) == 1 else value
        keys = []
        if out_hit:
            whole = self.selector if split is None else split.outputs
            keys = self._named(whole, split and split.output_parts, ctx, live, "")
        out = next_fun(*args, **kwargs)
        return self._tag_all(out, keys, ctx)

    def _named(
        self, whole: Any, part_sels: Any, ctx: Any, live: Any, tail: str
    ) -> list[tuple[str, str]]:
        """``(key, part)`` of each value this call records: the call site's key (or one layer
        of it per suffix) with ``tail`` (``":in"`` for its input), whole (part ``""``) where
        ``whole`` selects it, and each part a part entry's selector selects it for."""
        picked = []
        # without parts (``part_sels`` None), ``whole`` is the selector the caller just matched
        if whole is not None and (part_sels is None or whole.matches(ctx)):
            picked += [(k, "") for k in self._keys(whole, ctx, live)]
        for sel, part in part_sels or ():
            if sel.matches(ctx):
                picked += [(k, part) for k in self._keys(sel, ctx, live)]
        out = []
        for key, part in picked:
            name = f"{key}{part}{tail}"
            if live is not None:
                live.starts.setdefault(name)
                if key in live.layered and (part or tail):
                    site, layers, _ = live.layered[key]
                    live.layered[name] = (site, layers, part + tail)
            out.append((name, part))
        return out

    def _tag_all(self, value: Any, keys: list[tuple[str, str]], ctx: Any) -> Any:
        """``value`` with each ``(key, part)`` marked: a part's leaf, or the whole value (what
        is marked is what a subclass's :meth:`tag` makes of it: the statistics taps' dummy)."""
        for key, part in keys:
            if not part:
                value = self.tag(value, key)
                continue
            try:
                leaf = leaf_at(value, part)
            except KeyError:
                found = ", ".join(repr(p) for p, _ in parts(value)) or "none"
                raise SelectorError(
                    f"where= names part {part!r} of {key.removesuffix(':in')[: -len(part)]!r} "
                    f"({type(ctx.module).__name__}.{ctx.method}), whose "
                    f"{'input' if key.endswith(':in') else 'output'} has the parts {found}. "
                    f"Fix: name one of them (a tuple's position '.0', a field '.name', a dict "
                    f"key '.key')."
                ) from None
            value = replace_at(value, part, self.tag(leaf, key))
        return value

    def _keys(self, selector: Any, ctx: Any, live: Any) -> list[str]:
        """The keys ``selector`` records the call at: its key, or one layer of it per suffix."""
        keys = [ctx.key]
        if selector.has_layers():
            layers = selector.layers(ctx)
            if layers is None:  # the whole call site, and maybe layers of it named too
                layers = selector.named_layers(ctx) or None
            else:
                keys = []
            if layers is not None:
                _layergate.check_in_scan(ctx._frame, layers)
                keys.append(f"{ctx.key}[{','.join(map(str, sorted(layers)))}]")
                if live is not None:
                    live.layered[keys[-1]] = (ctx.key, tuple(sorted(layers)), "")
        return keys

    def tag(self, out: Any, key: str) -> Any:
        """Mark what this capture session carries for a selected call site (``key``: its key,
        with the layers of a one-layer selection); return what its caller gets.

        Here the output itself; a subclass may mark something derived from it (the
        statistics taps of :mod:`hookax._diagnostics.stats` mark a small dummy instead).
        """
        return _tags.mark(out, self.sid, key)


_EVERY_CALL_SITE = as_selector(None, ALL_METHODS)


def _check_collision(live: _tags.Session, ctx: Any) -> None:
    """Refuse two different NNX modules under one key (two separate roots in one function)."""
    adapter = ctx._frame.adapter
    if getattr(adapter, "name", None) != "nnx" or ctx._frame.bridged():
        # Linen/Equinox (and Flax's ToLinen bridge, for the NNX modules it builds) rebuild
        # module objects per call: identity means nothing there
        return
    *_, module = adapter.aliases(ctx.module)  # the outermost copy (inside NNX transforms)
    ref = live.owners.get(ctx.key)
    first = ref() if ref is not None else None
    if first is None:  # weak: a module rebuilt inside jit holds that trace's tracers
        live.owners[ctx.key] = weakref.ref(module)
        return
    if first is module:
        return
    raise HookaxError(
        f"{live.who}: call site key {ctx.key!r} ({type(ctx.module).__name__}.{ctx.method}) "
        f"was recorded for two different modules ({type(first).__name__} at {id(first):#x} "
        f"and {type(module).__name__} at {id(module):#x}): the captured function calls separate "
        f"models, each the root of its own paths, so their keys collide. Fix: capture each "
        f"model separately ({live.who}(model_a), {live.who}(model_b)), or make them submodules "
        f"of one parent module and call that."
    )


class _Session:
    """Context for one session: make it live, its marker active and its trace current."""

    def __init__(
        self,
        session: _tags.Session,
        selector: Any,
        where: Any,
        ops: tuple[Any, ...] = (),
        inputs: Any = False,
        marker: Callable[..., _Marker] = _Marker,
        checked: Any = None,
        parts: Any = None,
    ) -> None:
        self.parts = parts
        self.session = session
        self.selector = selector
        self.where = where
        self.ops = ops
        self.inputs = inputs
        self.marker = marker
        self.checked = selector if checked is None else checked  # what where= must match

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        s = self.session
        s.seen = set()
        s.matched = False
        if self.parts is not None:
            marker = self.marker(s.sid, self.selector, self.inputs, parts=self.parts)
        elif self.inputs:
            marker = self.marker(s.sid, self.selector, self.inputs)
        else:
            marker = self.marker(s.sid, self.selector)
        entry = _intercept.Entry("intercept", marker, _EVERY_CALL_SITE)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_intercept.scoped(entry))
            if self.ops:
                s.op_notes = _ops.Notes()
                handler = _ops.OpHandler("mark", s.sid, self.ops)
                stack.enter_context(
                    _intercept.scoped(_intercept.Entry("ops", handler, _ops.Sites(self.ops)))
                )
                stack.enter_context(_ops.named_softmax())
            try:
                out = _tagrules.run(s, fn, *args, **kwargs)
            except ValueError as e:
                _adapters.note_haiku_outside_transform(e, s.who)
                raise
        if s.mode == "reap":  # a differentiated run follows a measuring run that checked it
            if self.where is not _NO_SITES:
                check_matched(s.who, self.where, self.checked, s, lambda: FnKey(fn))
            if self.ops:
                _ops.check_ops(s.who, self.ops, s.op_notes, lambda: FnKey(fn))
        return out


def check_steps(who: str, bound: int, steps: dict[str, tuple[Any, ...]]) -> None:
    """Raise when a ``while`` loop ran more iterations than ``while_steps`` keeps, where the
    counts are known (eagerly, or around a jitted function); under jit they are not, and the
    rows past the bound are dropped."""
    for key, counts in steps.items():
        for count in counts:
            if isinstance(count, jax.core.Tracer) or not np.size(count):
                continue
            ran = int(np.max(count))
            if ran > bound:
                raise HookaxError(
                    f"{who}(while_steps={bound}): the jax.lax.while_loop holding {key!r} ran "
                    f"{ran} iterations; only the first {bound} were kept. Fix: "
                    f"{who}(..., while_steps={ran}) or more (the loop's largest number of "
                    f"iterations)."
                )


def validate_while_steps(while_steps: Any, who: str) -> int | None:
    """``while_steps=`` checked: None, or a positive int."""
    if while_steps is None:
        return None
    if isinstance(while_steps, bool) or not isinstance(while_steps, int | np.integer):
        raise HookaxError(
            f"{who}: while_steps must be a positive int (the most iterations of a "
            f"jax.lax.while_loop to keep), got {while_steps!r}. Fix: while_steps=64."
        )
    if while_steps < 1:
        raise HookaxError(
            f"{who}: while_steps must be at least 1, got {while_steps}. Fix: leave it out to "
            f"keep the last iteration only, or while_steps=64 to keep up to 64."
        )
    return int(while_steps)


class _NoSites:
    """``where=`` left out next to ``ops=``: no call site's output, only the operations."""

    def __repr__(self) -> str:
        return "<no call sites>"


_NO_SITES: Any = _NoSites()
_NONE_SELECTED = Select(types=())


def next_sid() -> int:
    return _tags.depth()


def session(
    who: str,
    where: Any,
    fn: Any,
    args: tuple,
    kwargs: dict,
    mode: str = "reap",
    probes: Any = None,
    ops: tuple[Any, ...] = (),
    while_steps: int | None = None,
    inputs: bool = False,
    marker: Callable[..., _Marker] = _Marker,
) -> _Session:
    """A session for ``who`` (``"hx.capture"``, ``"hx.value_and_grad"``) over ``fn(*args)``;
    ``ops`` are parsed ``ops=`` patterns, and ``where`` may be :data:`_NO_SITES`;
    ``while_steps``: the rows each ``while`` loop stacks its iterations into (None: last only);
    ``marker`` makes the interceptor from ``(sid, selector)``: a value-comparable
    :class:`_Marker`."""
    outputs, named_inputs = split_inputs(where)

    def select(entries: Any) -> Any:
        return as_selector(resolve_instances(entries, (fn, args, kwargs)), CALL_ONLY)

    out_whole, out_parts = _part_entries(outputs, select)
    in_whole, in_parts = _part_entries(named_inputs, select)
    if outputs is _NO_SITES:
        selector: Any = _NONE_SELECTED
    else:
        selector = _union(out_whole, *(sel for sel, _ in out_parts))
    checked = selector
    ins: Any = inputs
    if named_inputs is not None:
        ins = _union(in_whole, *(sel for sel, _ in in_parts))
        checked = ins if outputs is _NO_SITES else selector | ins
        if inputs:
            ins = selector | ins
    split = None
    if out_parts or in_parts:
        whole_ins = in_whole if not inputs else _union(in_whole, selector)
        split = _Parts(out_whole, tuple(out_parts), whole_ins, tuple(in_parts))
    inner = _tags.Session(next_sid(), who, mode, probes, while_steps)
    return _Session(inner, selector, where, ops, ins, marker, checked, split)


@dataclasses.dataclass(frozen=True)
class _Parts:
    """A ``where=`` whose entries name parts of values (``"layers/*.1"``, ``"blocks/0.0:in"``):
    the selectors of the call sites whose outputs (inputs) are recorded whole, None for none,
    and ``(selector, part)`` per entry naming a part. Compared by value (the cache key)."""

    outputs: Any
    output_parts: tuple[tuple[Any, str], ...]
    inputs: Any
    input_parts: tuple[tuple[Any, str], ...]


def _part_entries(where: Any, select: Callable[[Any], Any]) -> tuple[Any, list[tuple[Any, str]]]:
    """``where=``'s entries as ``(selector of those naming whole values or None, [(selector,
    part)] of those naming a part)``; a part is a string entry's suffix (``split_part``)."""
    if where is None or where is _NO_SITES:
        return (select(where) if where is None else None), []
    entries = list(where) if isinstance(where, list | tuple) else [where]
    found = [(e, split_part(e)) if isinstance(e, str) else (e, (e, "")) for e in entries]
    if not any(part for _, (_, part) in found):
        return select(where), []
    whole = [e for e, (_, part) in found if not part]
    parted = [(select(base), part) for _, (base, part) in found if part]
    return (select(whole if len(whole) > 1 else whole[0]) if whole else None), parted


def _union(first: Any, *rest: Any) -> Any:
    """The union of selectors (None entries left out; None when every one is)."""
    out = first
    for sel in rest:
        out = sel if out is None else out | sel
    return out


def split_inputs(where: Any) -> tuple[Any, Any]:
    """``where=`` as ``(call sites whose outputs are selected, those whose inputs are)``: a
    ``"key:in"`` entry names a call site's input; the first part is :data:`_NO_SITES` when
    every entry is one, the second None when none is."""
    found = input_entries(where)
    if found is None:
        return where, None
    outs, ins = found
    return (outs if outs else _NO_SITES), ins


# Linen's methods that take the variables: called on an unbound module, as they must be.
_LINEN_ENTRY_POINTS = frozenset({"apply", "init", "init_with_output", "lazy_init"})


def check_variables(who: str, fn: Any) -> None:
    """Refuse an unbound Linen module as ``fn`` (or a method of one, but ``model.apply``),
    saying how to give it its variables (Flax's own error names neither the call nor the fix).
    Only ``fn`` itself: a function may bind a module it closes over or takes."""
    haiku = _adapters.haiku_transform_given(who, fn)
    if haiku is not None:
        raise haiku
    objs = [fn]
    if getattr(fn, "__name__", None) not in _LINEN_ENTRY_POINTS:
        objs.append(getattr(fn, "__self__", None))
    unbound = _adapters.unbound_linen(objs)
    if unbound is not None:
        raise _adapters.linen_needs_variables(who, unbound)


def where_and_ops(where: Any, ops: Any, who: str) -> tuple[Any, tuple[Any, ...]]:
    """``where=`` (its default: every call site, or none when ``ops=`` is given) and the
    parsed ``ops=`` patterns; malformed ones raise here, before the first call."""
    patterns = _ops.parse_ops(ops, who)
    if where is _DEFAULT:
        where = _NO_SITES if patterns else None
    if where is not _NO_SITES:
        as_selector(_bases(where), CALL_ONLY)
    return where, patterns


def _bases(where: Any) -> Any:
    """``where=`` with each string entry's input suffix and part left out (what selects)."""

    def base(entry: Any) -> Any:
        if not isinstance(entry, str):
            return entry
        return split_part(entry.removesuffix(":in"))[0]

    if isinstance(where, list | tuple):
        return type(where)(base(e) for e in where)
    return base(where)


class _Default:
    def __repr__(self) -> str:
        return "<default>"


_DEFAULT: Any = _Default()


def collect(session: _tags.Session) -> dict[str, tuple[Any, ...]]:
    """``{key: (output, ...)}`` in call order, keys in the order their first call started."""
    acts: dict[str, list[Any]] = {}
    for k in session.starts:
        for kk in layer_keys(k, session.layered):
            acts[kk] = []
    for r in session.records:
        for k, out in layer_split(r.key, r.output(), r.axes, session.layered):
            acts.setdefault(k, []).append(out)
    return {k: tuple(v) for k, v in acts.items() if v}


def layer_keys(key: str, layered: dict[str, tuple[str, tuple[int, ...], str]]) -> list[str]:
    """The keys a record key stands for: ``"blocks/mlp[1,3]"`` -> ``blocks/mlp[1]``, ``[3]``."""
    if key not in layered:
        return [key]
    site, layers, tail = layered[key]
    return [f"{site}[{i}]{tail}" for i in layers]


def layer_split(
    key: str, tree: Any, axes: Any, layered: dict[str, tuple[str, tuple[int, ...], str]]
) -> list[tuple[str, Any]]:
    """A record of a one-layer selection, stacked over its scan, as one value per layer.

    The layer axis is that of the innermost scan the value left (``axes`` lists the transforms
    innermost first; each but ``cond`` and an unbounded ``while`` added a leading axis).
    """
    if key not in layered:
        return [(key, tree)]
    site, layers, tail = layered[key]
    kinds = [kind for kind, _ in axes]
    if "scan" not in kinds:
        raise HookaxError(
            f"call site {site!r} was selected by layer ({key!r}) but its value did not leave a "
            f"scan (it left {kinds or 'no transform'}); only a lax.scan over layers has layers. "
            f"Fix: select {site!r} without the layer suffix."
        )
    inner = kinds.index("scan")
    length = axes[inner][1]
    if any(i >= length for i in layers):
        raise HookaxError(
            f"{key!r} selects layer {max(layers)}, but the scan that runs call site {site!r} has "
            f"{counted(length, 'layer')} (0 to {length - 1}). Fix: pick an index below {length}."
        )
    axis = sum(
        1
        for kind, n in axes[inner + 1 :]
        if not (kind == "cond" or (kind == "while" and n is None))
    )

    leaves, treedef = jax.tree.flatten(tree)
    one = with_axes(treedef, drop=axis)  # a NamedArray's names lose the layer axis

    def layer(i: int) -> Any:
        return one.unflatten([jax.lax.index_in_dim(x, i, axis, False) for x in leaves])

    return [(f"{site}[{i}]{tail}", layer(i)) for i in layers]


def collect_steps(session: _tags.Session) -> dict[str, tuple[Any, ...]]:
    """``{key: (count, ...)}``: for each call of a call site inside a bounded ``while`` loop, the
    iteration count of the innermost one, in the order of :func:`collect` (a one-layer
    selection's count split by layer where a scan over layers stacked it)."""
    steps: dict[str, list[Any]] = {}
    for r in session.records:
        if not r.n_counts:
            continue
        count = r.counts[0]
        j = next(i for i, (kind, n) in enumerate(r.axes) if kind == "while" and n is not None)
        outer = r.axes[j + 1 :]  # the transforms the count left after its loop
        if r.key in session.layered and any(kind == "scan" for kind, _ in outer):
            pairs = layer_split(r.key, count, outer, session.layered)
        else:
            pairs = [(k, count) for k in layer_keys(r.key, session.layered)]
        for k, c in pairs:
            steps.setdefault(k, []).append(c)
    return {k: tuple(v) for k, v in steps.items()}


def capture(
    fn: Callable[..., Any],
    *,
    where: Where = _DEFAULT,
    ops: Any = None,
    while_steps: int | None = None,
    inputs: bool = False,
) -> Callable[..., tuple[Any, ...]]:
    """Wrap ``fn`` to also return the outputs of the selected call sites it runs.

    ``forward = hx.capture(fn, where=...)``; ``y, acts = forward(*args, **kwargs)``. ``acts`` maps
    each selected call site's key (``"layers/0"``, ``"encoder:encode"``) to a tuple of its
    outputs, one per call, in call order; keys appear in the order of their first call. The
    outputs are what the caller received (after forward hooks ran).

    The values travel as values of the computation, so every transform carries them: eager,
    ``jax.jit``/``nnx.jit`` (also a jitted function taking the model as an argument, inside or
    around the capture), ``jax.vmap``/``nnx.vmap`` (values gain the batch axis in front),
    ``lax.scan``/``nnx.scan``/``nn.scan``/``lax.map`` over layers (one entry for the scanned call
    site, stacked on the scan axis), ``jax.checkpoint``/``nnx.remat``, ``lax.cond``/``switch``
    (the taken branch's value; NaN where the call site is in a branch not taken),
    ``lax.while_loop`` (the last iteration's value; every iteration with ``while_steps=``, below),
    ``jax.grad``, ``shard_map``. The active capture is part of the jit cache key.

    Every step of a ``lax.while_loop`` (a decode loop, ``fori_loop`` with traced bounds):
    ``y, acts, steps = hx.capture(fn, where=..., while_steps=N)(*args)``. A call site inside the
    loop is stacked like a scan's: ``acts[key][i]`` has a leading axis of ``N`` rows, row ``t``
    holding iteration ``t``, and ``steps[key][i]`` is the number of iterations the loop ran (an
    int32 array; for nested loops, the innermost loop's count, stacked by the outer loop). The
    shape is the same eagerly and under jit; rows from the count on hold NaN (integers: the
    dtype's minimum, booleans: False), so ``acts[key][0][: int(steps[key][0])]`` are the steps
    that ran. The rows are buffers carried through the loop, written in place: memory is ``N``
    times one iteration's values, time one row write per iteration. A loop that runs more than
    ``N`` iterations raises [`hx.HookaxError`][hookax.HookaxError] where the count is known when
    the call returns (eagerly, or around a jitted function); inside a jitted function it is not,
    and the iterations from ``N`` on are dropped.

    Around a function already jitted (``jax.jit``, ``nnx.jit``, ``eqx.filter_jit``: a decode
    loop calling ``hx.capture(step)(...)`` per token) the capture is compiled once as a whole,
    jitted the way ``step`` is (its static and donated arguments kept), and kept per ``(step,
    where=, ops=, while_steps=)``: a capture made anew on every call retraces nothing and costs
    what ``jax.jit(hx.capture(step))`` costs. JAX's own cache decides when to retrace (argument
    structure, shapes, dtypes, shardings, static arguments, the active hookax entries).

    ``ops=`` adds the values of operations inside call sites ([`hx.ops`][hookax.ops] lists their
    addresses): ``acts["layers/0/attn:softmax"]`` is a tuple, one value per call of its call
    site, carried through the same transforms (an operation inside a ``vmap`` written in the
    call site is seen batched, as the call site computes it).

    Args:
      fn: a module, or any function that calls modules.
      where: which call sites; default every module's ``__call__``, or none when ``ops=`` is
        given. A module instance selects that module.
      ops: operation addresses (``"layers/0/attn:softmax"``, ``"**:dot_general#*"``), or a list.
      while_steps: keep every iteration of each ``lax.while_loop``, up to this many (rows of
        the stacked values); default None: the last iteration only.
      inputs: also record each selected call's inputs as its caller passed them (what its
        forward pre-hooks see): ``acts["layers/0:in"]``, one per call, listed before the
        output's key: the call's one positional argument, or the tuple of them (keyword
        arguments are not recorded). The residual stream before a block is ``"blocks/0:in"``.

    Returns:
      A function taking ``fn``'s arguments and returning ``(fn's output, acts)``, or ``(fn's
      output, acts, steps)`` with ``while_steps=``.

    Raises:
      SelectorError: ``where=`` matched no call site that ran (the message lists those that did).
      HookaxError: a selected call site ran where its value cannot be carried out (the message
        names it, the transform, and the fix); a while loop ran more than ``while_steps``
        iterations (where the count is known).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu)
      >>> y, acts = hx.capture(model)(jnp.ones((4, 2)))
      >>> {k: [v.shape for v in vs] for k, vs in acts.items()}
      {'': [(4, 3)], 'layers/0': [(4, 3)]}

      Every step of a decode loop written with ``lax.while_loop``:

      >>> import jax
      >>> cell = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
      >>> def decode(cell, h, n):
      ...     body = lambda c: (c[0] + 1, jnp.tanh(cell(c[1])))
      ...     return jax.lax.while_loop(lambda c: c[0] < n, body, (0, h))[1]
      >>> y, acts, steps = hx.capture(decode, while_steps=8)(cell, jnp.ones((1, 3)), 5)
      >>> acts[""][0].shape, int(steps[""][0])  # 8 rows, 5 of them ran
      ((8, 1, 3), 5)
      >>> bool(jnp.isnan(acts[""][0][5:]).all())
      True
    """
    haiku = _adapters.haiku_transform_given("hx.capture", fn)
    if haiku is not None:
        raise haiku
    fn = as_program(fn)  # a program without modules: its own call sites
    if not callable(fn):
        raise HookaxError(
            f"hx.capture expects a module or a function that calls modules, got {fn!r} of "
            f"type {type(fn).__name__}. Fix: hx.capture(model)(x), or "
            "hx.capture(lambda x: model(x))(x)."
        )
    kind = _jitted.jit_kind(fn)
    # A list where= as a tuple (the same selection), so a capture made anew per step finds it.
    listed = tuple(where) if isinstance(where, list) else where
    raw = ("raw", listed, ops, while_steps, type(while_steps), bool(inputs))
    if kind is not None:  # a capture made anew per step: found without parsing its arguments
        hit = _jitted.lookup(fn, raw)
        if hit is not None:
            return _forward(fn, hit, while_steps)
    check_variables("hx.capture", fn)
    where, patterns = where_and_ops(where, ops, "hx.capture")  # malformed ones raise here
    bound = validate_while_steps(while_steps, "hx.capture")

    def run(f: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
        s = session(
            "hx.capture", where, f, args, kwargs, ops=patterns, while_steps=bound, inputs=inputs
        )
        y = s.run(f, *args, **kwargs)
        return y, collect(s.session), None if bound is None else collect_steps(s.session)

    if kind is not None and _by_value(where):  # compiled once as a whole, kept per fn
        sites = where if where is _NO_SITES else as_selector(where, CALL_ONLY)
        key = (sites, patterns, bound, bool(inputs))
        return _forward(fn, _jitted.jitted_capture(fn, kind, key, run, raw), bound)
    forward = _forward(fn, functools.partial(_call, run, fn), bound)
    # Only a function lends its name: a module's attributes (or a __wrapped__ pointing at it)
    # on the returned function would make Equinox's filtered transforms treat it as a pytree.
    if isinstance(fn, types.FunctionType | types.MethodType):
        functools.update_wrapper(forward, fn)
    return forward


def _forward(fn: Any, run: Callable[..., Any], bound: int | None) -> Callable[..., Any]:
    """The function ``hx.capture`` returns: ``run(*args) -> (y, acts, steps)``, checked."""

    def forward(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        with _eager.eager_workflow():  # run eagerly: its new programs with NumPy first
            y, acts, steps = run(*args, **kwargs)
        if bound is None:
            return y, acts
        check_steps("hx.capture", bound, steps)
        return y, acts, steps

    forward._hookax_fn = fn  # type: ignore[attr-defined]  # the cache of jitted captures holds fn weakly
    return forward


def _call(run: Callable[..., Any], fn: Any, *args: Any, **kwargs: Any) -> Any:
    return run(fn, args, kwargs)


def _by_value(where: Any) -> bool:
    """Whether ``where=`` selects the same call sites whatever the arguments (a module
    instance is found among them on each call)."""
    if where is None or where is _NO_SITES or isinstance(where, str | type | Select):
        return True
    return isinstance(where, tuple | list) and all(_by_value(w) for w in where)


roots = reachable  # objects a function reaches besides its arguments
