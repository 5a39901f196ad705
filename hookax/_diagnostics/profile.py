"""``hx.profile``: device time per call site, forward and backward, from ``jax.profiler``.

The step is compiled once with every call site's label on JAX's name stack (as
``hx.named_scopes()`` writes them), run a few times to warm up, then run under
``jax.profiler.trace``. The profiler's events name each executed XLA operation; the compiled
program's ``op_name`` metadata names the call site it came from (:mod:`.scopes`), and
:mod:`.xplane` shares the step's time out among the operations. The table is
:class:`~hookax._diagnostics.profview.Profile`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

from .._util.errors import HookaxError
from ..frameworks._functions import as_program
from . import xplane
from .profview import Profile, ProfileRow
from .scopes import SiteLog, place

__all__ = ["profile"]

WHO = "hx.profile"


def profile(
    step: Callable[..., Any], *args: Any, runs: int = 5, warmup: int = 2, **kwargs: Any
) -> Profile:
    """Device time of each call site in ``step(*args, **kwargs)``, forward and backward.

    ``step`` is a train step, a loss and its gradient, or any function that calls modules;
    jitted (``jax.jit``, ``nnx.jit``, ``eqx.filter_jit``) or not: it is compiled as one program
    (its arrays as arguments, anything else fixed), run ``warmup`` times, then ``runs`` times
    under ``jax.profiler``. Nothing is changed: updates the step makes to a model or an
    optimizer state stay inside the profiled program. The table's values are means over the
    runs (a run slower than 1.5 times the median is left out, and the table says so).

    What is counted: the device time of the XLA operations the compiled program runs. Each
    operation belongs to the innermost call site whose module path its name-scope path holds
    (``hx.named_scopes()`` writes them); backward operations are those JAX's differentiation
    transposed (their ``op_name`` holds ``transpose(``; a rematerialised forward inside the
    backward pass counts as backward). A row's ``forward_ms``/``backward_ms`` are its own
    operations (its child call sites excluded); ``total_ms`` includes them. Operations outside
    every call site (the loss, the optimizer update) are the "other" row; moments of the step
    when no operation runs are "idle". Rows, other and idle add up to the step time: from the
    start of the step's first operation to the end of its last. Where XLA fused operations of
    several call sites into one kernel, the kernel counts for the call site of the fusion's
    root operation. A collective (the all-reduce of a sharded step's gradients) counts for the
    call site whose scope it carries, waiting included; operations that several devices run at
    the same moment share that moment, so the rows add up to the step there too.

    A scanned stack of layers (``nnx.scan``/``lax.scan`` over stacked parameters) gives a row
    per layer (``"blocks[0]"``, ``"blocks/lin[0]"``, ...) where the profiler reports each
    iteration's operations (as on CPU): the forward pass runs the layers in order, the backward
    pass in reverse (a scan with ``reverse=True`` is numbered from its last layer). Where it
    cannot tell the iterations apart (a loop nested inside the layers, a scan with ``unroll``
    above 1), the scanned call site and those inside it are one row each, all layers together,
    and the table says so.

    Args:
      step: the function to profile.
      *args: its arguments (a model, a batch, an optimizer state, ...).
      runs: how many runs are measured (at least 1).
      warmup: how many runs before the measured ones (compilation is never measured).
      **kwargs: its keyword arguments.

    Returns:
      A [`hx.Profile`][hookax.Profile]: ``rows``, the step time, and a printable table.

    Raises:
      HookaxError: ``step`` is not callable, calls no module, or another ``jax.profiler``
        trace is running.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,
      ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
      >>> def loss(m, x):
      ...     return (m(x) ** 2).mean()
      >>> step = jax.jit(lambda m, x: nnx.grad(loss)(m, x))
      >>> p = hx.profile(step, model, jnp.ones((16, 4)), runs=2)
      >>> [row.key for row in p.rows]
      ['', 'layers/0', 'layers/2']
      >>> abs(sum(r.forward_ms + r.backward_ms for r in p.rows) + p.other_ms + p.idle_ms
      ...     - p.step_ms) < 1e-9
      True
    """
    step = as_program(step)  # a program without modules: its own call sites
    _check(step, runs, warmup)
    import jax

    log = SiteLog()
    compiled, dynamic = _compile(step, args, kwargs, log)
    if not log.sites:
        raise HookaxError(
            f"{WHO}: no call site of {_name(step)} ran while it was traced (it calls no module "
            "of Flax NNX, Flax Linen, Equinox or Haiku, and is no program of JAX functions "
            "hookax could trace), so there is nothing to time. Fix: profile the function "
            "that calls the model, with its arguments: hx.profile(step, model, x)."
        )
    for _ in range(warmup):
        jax.block_until_ready(compiled(*dynamic))
    data = _trace(compiled, dynamic, runs)
    module, names = xplane.op_names(compiled.as_text())
    measured = xplane.read_runs(data, module, runs)
    if not measured:
        raise HookaxError(
            f"{WHO}: the profiler recorded no operation of {_name(step)} (module {module!r}) "
            f"on {jax.devices()[0].platform}. Fix: check that jax.profiler works here "
            "(jax.profiler.trace('/tmp/trace') around a jitted call writes an .xplane.pb)."
        )
    return _table(log, names, measured, _device())


def _check(step: Any, runs: Any, warmup: Any) -> None:
    if not callable(step):
        raise HookaxError(
            f"{WHO} expects a function to run (a train step, or a loss and its gradient), got "
            f"an object of type {type(step).__name__}: pass the function itself, not what it "
            "returns. Fix: hx.profile(step, model, x) with "
            "step = jax.jit(lambda m, x: nnx.grad(loss)(m, x))."
        )
    for name, value, low in (("runs", runs, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise HookaxError(
                f"{WHO}: {name}= takes an integer of at least {low}, got {value!r}. Fix: "
                f"{name}={max(low, 2)}."
            )


def _name(step: Any) -> str:
    return f"step {getattr(step, '__qualname__', None) or type(step).__name__!r}"


def _compile(step: Callable[..., Any], args: tuple, kwargs: dict, log: SiteLog) -> tuple[Any, list]:
    """``step`` as one compiled program of its array arguments, traced with the call sites'
    scopes on the name stack (``log`` learns their labels)."""
    import jax
    import numpy as np

    from .._capture.ops import OpHandler, Sites
    from .._hooks.intercept import Entry, scoped

    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(x, jax.Array | np.ndarray) for x in leaves]
    dynamic = [x for x, a in zip(leaves, is_array) if a]

    def profiled(*arrays: Any) -> list[Any]:
        it = iter(arrays)
        a, k = jax.tree.unflatten(treedef, [next(it) if d else x for x, d in zip(leaves, is_array)])
        out = step(*a, **k)
        # the arguments too: a step that updates a model or an optimizer state in place (nnx)
        # returns little, and XLA would drop the work whose results are only those updates;
        # an argument returned as it came would be a copy that the step does not make
        given = {id(x) for x in arrays}
        results = jax.tree.leaves((out, a, k))
        return [y for y in results if isinstance(y, jax.Array) and id(y) not in given]

    profiled.__name__ = profiled.__qualname__ = "hookax_profile"
    with scoped(Entry("ops", OpHandler("sites", log, ()), Sites(()))):
        traced = jax.jit(profiled).trace(*dynamic)
        compiled = traced.lower().compile()
    log.unrolled = _unrolled_scan(traced.jaxpr.jaxpr)
    return compiled, dynamic


def _unrolled_scan(jaxpr: Any) -> bool:
    """Whether a scan of ``jaxpr`` (at any depth) is unrolled: XLA then runs several copies of
    its body, each for several iterations, and an operation's occurrences are no layer index."""
    from .._util.jaxcompat import jaxprs_in_params

    return any(
        (eqn.primitive.name == "scan" and eqn.params.get("unroll", 1) not in (1, False))
        or any(_unrolled_scan(j) for j in jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


def _trace(compiled: Any, dynamic: list, runs: int) -> Any:
    """The runs under ``jax.profiler.trace``, read back with ``jax.profiler.ProfileData``."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's own calls: not device time, and slow to record
    with tempfile.TemporaryDirectory(prefix="hookax-profile-") as d:
        tracing = contextlib.ExitStack()
        try:
            tracing.enter_context(jax.profiler.trace(d, profiler_options=options))
        except RuntimeError as e:
            raise HookaxError(
                f"{WHO}: cannot start jax.profiler: {e} Another profiler trace is running "
                "(jax.profiler.start_trace, or a jax.profiler.trace block). Fix: call "
                "hx.profile outside it, or end it first (jax.profiler.stop_trace())."
            ) from None
        with tracing:
            for _ in range(runs):
                jax.block_until_ready(compiled(*dynamic))
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise HookaxError(
                f"{WHO}: jax.profiler wrote no .xplane.pb file. Fix: check that jax.profiler "
                "works here (jax.profiler.trace('/tmp/trace') around a jitted call)."
            )
        return jax.profiler.ProfileData.from_file(max(files, key=os.path.getsize))


def _device() -> str:
    import jax

    d = jax.devices()[0]
    kind = getattr(d, "device_kind", d.platform)
    return d.platform if kind == d.platform else f"{d.platform} ({kind})"


RowKey = tuple[tuple[str, ...], int | None]  # a call site's chain, and its layer (None: not one)


def _table(
    log: SiteLog,
    names: dict[str, str],
    measured: list[xplane.Run],
    device: str,
) -> Profile:
    """Mean nanoseconds per row, forward and backward, over the runs (a run slower than 1.5
    times the median is left out: something else held the device or the CPU)."""
    notes: list[str] = []
    median = statistics.median(r.span_ns for r in measured)
    kept = [r for r in measured if r.span_ns <= 1.5 * median]
    if len(kept) < len(measured):
        notes.append(
            f"{len(measured) - len(kept)} of {len(measured)} runs left out: slower than "
            "1.5x the median run (something else ran on the device or the CPU)"
        )
    measured, n = kept, len(kept)
    places = {e.op: place(names.get(e.op, ""), log) for run in measured for e in run.events}
    # a stack with a loop inside its layers is one row per call site, not one per layer
    merged = {
        p.chain[: p.scanned + 1] for p in places.values() if p.nested and p.scanned is not None
    }
    for stack in sorted(merged):
        key = log.sites[stack].key
        notes.append(
            f"{key!r}: a scanned stack with a loop inside its layers: its layers are not told "
            "apart (the rows inside it are all its layers together)"
        )
    if log.unrolled:  # copies of the body, each run for several layers: no layer index
        unrolled = {
            p.chain[: p.scanned + 1] for p in places.values() if p.scanned is not None
        } - merged
        for stack in sorted(unrolled):
            notes.append(
                f"{log.sites[stack].key!r}: a scanned stack in a scan with unroll > 1: its "
                "layers are not told apart (the rows inside it are all its layers together)"
            )
        merged |= unrolled
    own: dict[RowKey, list[float]] = {}
    depth: dict[tuple[str, ...], int | None] = {}  # chain -> depth where its scan starts
    other = [0.0, 0.0]
    for run in measured:
        for e in run.events:
            p = places[e.op]
            if not p.chain:
                other[p.backward] += e.ns
                continue
            layer = None
            if p.scanned is not None and p.chain[: p.scanned + 1] not in merged:
                layer = e.count - 1 - e.occurrence if p.backward else e.occurrence
                depth[p.chain] = p.scanned
            own.setdefault((p.chain, layer), [0.0, 0.0])[p.backward] += e.ns
    keys = _with_ancestors(own, depth, log)
    ms = 1e-6 / n
    totals = {k: [0.0, 0.0] for k in keys}
    for k, (f, b) in own.items():
        node: RowKey | None = k
        while node is not None:
            totals[node][0] += f
            totals[node][1] += b
            node = _parent(node, depth)
    rows = []
    for k in _ordered(keys, depth, log):
        chain, layer = k
        info = log.sites[chain]
        f, b = own.get(k, [0.0, 0.0])
        rows.append(
            ProfileRow(
                key=info.key + ("" if layer is None else f"[{layer}]"),
                site=info.key,
                layer=layer,
                type=info.type,
                method=info.method,
                depth=len(chain) - 1,
                forward_ms=f * ms,
                backward_ms=b * ms,
                forward_total_ms=totals[k][0] * ms,
                backward_total_ms=totals[k][1] * ms,
            )
        )
    step = sum(r.span_ns for r in measured) * ms
    idle = sum(r.idle_ns for r in measured) * ms
    return Profile(
        rows, other[0] * ms, other[1] * ms, idle, step, n, device, tuple(dict.fromkeys(notes))
    )


def _parent(k: RowKey, depth: dict[tuple[str, ...], int | None]) -> RowKey | None:
    chain, layer = k
    if len(chain) <= 1:
        return None
    up = chain[:-1]
    d = depth.get(chain)
    return (up, layer if d is not None and len(up) - 1 >= d else None)


def _with_ancestors(
    own: dict[RowKey, list[float]], depth: dict[tuple[str, ...], int | None], log: SiteLog
) -> set[RowKey]:
    """Every row: those with time, their ancestors, and each call site the trace met (inside
    a scanned stack, once per layer). ``depth`` learns the ancestors' scans."""
    keys: set[RowKey] = set()
    for k in own:
        node: RowKey | None = k
        while node is not None and node not in keys:
            keys.add(node)
            up = _parent(node, depth)
            if up is not None and up[1] is not None:
                depth.setdefault(up[0], depth[node[0]])
            node = up
    for chain in log.sites:  # in call order: a call site's parent before it
        if any(c == chain for c, _ in keys):
            continue
        layers = sorted({n for c, n in keys if c == chain[:-1] and n is not None})
        if layers:
            depth[chain] = depth[chain[:-1]]
            keys |= {(chain, n) for n in layers}
        else:
            keys.add((chain, None))
    return keys


def _ordered(
    keys: set[RowKey], depth: dict[tuple[str, ...], int | None], log: SiteLog
) -> list[RowKey]:
    """Tree order: each row, then its children (call order; the layers of a stack in order)."""
    order = {chain: i for i, chain in enumerate(log.sites)}
    children: dict[RowKey | None, list[RowKey]] = {}
    for k in keys:
        children.setdefault(_parent(k, depth), []).append(k)
    out: list[RowKey] = []

    def visit(node: RowKey | None) -> None:
        for k in sorted(children.get(node, []), key=lambda k: (order[k[0]], k[1] or 0)):
            out.append(k)
            visit(k)

    visit(None)
    return out
