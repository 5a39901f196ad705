"""Reading a ``jax.profiler`` trace back: the device time of each executed XLA operation.

The trace is the profiler's own ``.xplane.pb``, parsed by ``jax.profiler.ProfileData`` (part of
jaxlib; no protobuf code here). Each executed operation is an event carrying the ``hlo_op`` and
``hlo_module`` stats (on CPU in the host plane's executor threads, on GPU/TPU in the device
planes). Which call site an operation belongs to is not in the event: it is in the compiled
program's ``op_name`` metadata (:func:`op_names` reads it from ``compiled.as_text()``).

Time is shared out so that nothing is counted twice: on one thread an event nested in another
(the body of a ``while`` loop inside the loop's event) owns its own time and the outer one only
the rest; operations running at the same moment on several threads or streams share that moment
equally. A run's step time is from the start of its first operation to the end of its last; the
moments when none runs are its idle time. So the operations' shares plus the idle time are the
step time exactly. Runs are told apart by the events' ``run_id`` (the CPU client sets it), else
by the longest gaps between operations.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from typing import Any

__all__ = ["OpEvent", "Run", "op_names", "read_runs"]

_MODULE = re.compile(r"^HloModule\s+([^\s,]+)", re.M)
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s+=\s")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def op_names(hlo_text: str) -> tuple[str, dict[str, str]]:
    """The module's name and each instruction's ``op_name`` (its first, when XLA merged
    several with ``;``). A fusion without one takes its fused computation's root's.

    Examples:
      >>> text = '''HloModule jit_f, is_scheduled=true
      ... %fused (p: f32[2]) -> f32[2] {
      ...   ROOT %exp.1 = f32[2]{0} exponential(%p), metadata={op_name="jit(f)/Net/lin/exp"}
      ... }
      ... ENTRY %main (x: f32[2]) -> f32[2] {
      ...   ROOT %loop_fusion = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused
      ... }'''
      >>> op_names(text)
      ('jit_f', {'exp.1': 'jit(f)/Net/lin/exp', 'loop_fusion': 'jit(f)/Net/lin/exp'})
    """
    m = _MODULE.search(hlo_text)
    module = m.group(1) if m else ""
    names: dict[str, str] = {}
    roots: dict[str, str] = {}  # computation -> its root instruction
    calls: dict[str, str] = {}  # fusion -> the computation it calls
    computation = ""
    for line in hlo_text.splitlines():
        c = _COMPUTATION.match(line)
        if c is not None and "=" not in line.split("(", 1)[0]:
            computation = c.group(1)
            continue
        i = _INSTRUCTION.match(line)
        if i is None:
            continue
        name = i.group(2)
        if i.group(1):
            roots[computation] = name
        op = _OP_NAME.search(line)
        if op is not None:
            names[name] = op.group(1).split(";")[0]
        else:
            called = _CALLS.search(line)
            if called is not None:
                calls[name] = called.group(1)
    for name, computation in calls.items():
        root = roots.get(computation)
        if root is not None and root in names:
            names[name] = names[root]
    return module, names


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One execution of one operation in a run: its share of the run's time."""

    op: str  # the HLO instruction
    occurrence: int  # its n-th execution in this run (0 first), in time order
    count: int  # how many times it ran in this run
    ns: float  # its share of the step's time, in nanoseconds


@dataclasses.dataclass(frozen=True)
class Run:
    """One execution of the program."""

    events: list[OpEvent]
    span_ns: float  # first operation's start to last operation's end
    idle_ns: float  # moments within the span when no operation ran


@dataclasses.dataclass
class _Raw:
    op: str
    start: float
    end: float
    line: int
    share: float = 0.0


def _stat(stats: Any, name: str) -> Any:
    for key, value in stats:
        if key == name:
            return value
    return None


def _stats(event: Any) -> list[Any]:
    """An event's ``(name, value)`` stats. jaxlib 0.12 builds their type on first use with a
    DeprecationWarning; under ``-W error`` (pytest's ``filterwarnings = error``) that warning
    aborts the interpreter, so it is silenced here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return list(event.stats)


def read_runs(data: Any, module: str, runs: int) -> list[Run]:
    """The ``runs`` runs of ``module`` in a ``jax.profiler.ProfileData``, in time order: told
    apart by the events' ``run_id``, or where they carry none, by the longest gaps between
    operations (the host waits for each run before it starts the next)."""
    found: dict[str, list[_Raw]] = {}
    device: dict[str, list[_Raw]] = {}
    line_id = 0
    for plane in data.planes:
        on_device = plane.name.startswith("/device:")
        for line in plane.lines:
            line_id += 1
            for e in line.events:
                stats = _stats(e)
                op = _stat(stats, "hlo_op")
                if op is None or _stat(stats, "hlo_module") != module:
                    continue
                run = str(_stat(stats, "run_id"))
                raw = _Raw(str(op), float(e.start_ns), float(e.start_ns + e.duration_ns), line_id)
                (device if on_device else found).setdefault(run, []).append(raw)
    groups = list((device or found).items())  # on GPU/TPU, the host's launches are not device time
    if any(run == "None" for run, _ in groups):
        everything = sorted((r for _, rs in groups for r in rs), key=lambda r: r.start)
        groups = [("", raws) for raws in _split(everything, runs)]
    out = [_run(raws) for _, raws in groups if raws]
    out.sort(key=lambda r: r[0])
    return [r for _, r in out]


def _split(raws: list[_Raw], runs: int) -> list[list[_Raw]]:
    """Events sorted by start, cut at the ``runs - 1`` longest gaps when no operation runs."""
    gaps = []
    end = raws[0].end if raws else 0.0
    for i in range(1, len(raws)):
        gaps.append((raws[i].start - end, i))
        end = max(end, raws[i].end)
    cuts = sorted(i for gap, i in sorted(gaps, reverse=True)[: runs - 1] if gap > 0)
    return [raws[a:b] for a, b in zip([0, *cuts], [*cuts, len(raws)], strict=True)]


def _run(raws: list[_Raw]) -> tuple[float, Run]:
    raws.sort(key=lambda r: (r.start, -r.end))
    idle = _share(raws)
    counts: dict[str, int] = {}
    events = []
    for r in raws:
        n = counts.get(r.op, 0)
        counts[r.op] = n + 1
        events.append((r, n))
    first = raws[0].start
    span = max(r.end for r in raws) - first
    out = [OpEvent(r.op, n, counts[r.op], r.share) for r, n in events]
    return first, Run(out, span, idle)


def _share(raws: list[_Raw]) -> float:
    """Give each event its share of the time (see the module's docstring); the idle time."""
    bounds = sorted({t for r in raws for t in (r.start, r.end)})
    idle = 0.0
    active: list[_Raw] = []
    j = 0
    for a, b in itertools.pairwise(bounds):
        while j < len(raws) and raws[j].start <= a:
            active.append(raws[j])
            j += 1
        active = [r for r in active if r.end > a]
        if not active:
            idle += b - a
            continue
        owners: dict[int, _Raw] = {}
        for r in active:  # on each thread, the innermost event owns the moment
            cur = owners.get(r.line)
            if cur is None or (r.start, -r.end) > (cur.start, -cur.end):
                owners[r.line] = r
        share = (b - a) / len(owners)
        for r in owners.values():
            r.share += share
    return idle
