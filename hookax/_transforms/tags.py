"""Marks on call-site outputs, and the trace that collects them (reap) or adds probes (plant).

One mechanism serves ``hx.capture`` and ``hx.value_and_grad``:

* **mark** (:func:`mark`): the dispatcher binds the ``hookax_tag`` primitive on each selected call
  site's output. It is the identity; its parameters name the session and the call-site key. Every
  JAX transform carries it by its own rules: ``jit``/``scan``/``cond``/``remat`` stage it into their
  jaxprs, ``vmap`` batches it (batch axis moved to the front), ``jvp`` passes tangents through.
* **collect** (``tagrules.HarvestTrace``): while a session runs, a forwarding trace sits on top of
  the caller's trace. It passes every operation through unchanged, except a mark of its session
  (recorded, or a probe added) and a higher-order primitive whose inner jaxpr holds such marks: that
  jaxpr is re-traced through a child session, so the marked values leave the primitive as extra
  outputs (stacked by ``scan``), or probes enter it as extra inputs. See ``tagrules`` for the
  per-primitive rules and the trace itself.

Values therefore leave every transform as its outputs: nothing is written into Python state while
tracing, so ``jax.jit(f)(model, x)``, ``lax.scan`` over layers and ``jax.vmap(self.linear)`` inside
a model all deliver.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._util.errors import HookaxError
from .._util.jaxcompat import ad, batching, core, mlir, pe, to_context_mesh
from .._util.parts import with_axes

__all__ = [
    "ForwardingTrace",
    "Record",
    "Session",
    "depth",
    "live_session",
    "mark",
    "tag_p",
]


@dataclasses.dataclass(frozen=True)
class Spec:
    """How a marked output is rebuilt: its treedef and its non-array leaves (static)."""

    treedef: Any
    static: tuple[tuple[int, Any], ...]  # (position, value) of leaves that are not arrays
    op: bool = False  # an operation inside a call site (ops=), not a call site's output
    # (position, earlier position) of an array leaf that is the same array object as an
    # earlier one (tied weights in a returned module pair): rebuilt as that one, so the
    # caller's ``a is b`` still holds and the array is marked (and differentiated) once
    same: tuple[tuple[int, int], ...] = ()

    def what(self, key: str) -> str:
        """``"call site 'layers/0'"`` or ``"operation 'layers/0:exp'"``, for messages."""
        return f"{'operation' if self.op else 'call site'} {key!r}"

    @property
    def exclude(self) -> str:
        """How to leave it out, for messages."""
        return "leave it out of ops=" if self.op else "exclude it with where="

    def rebuild(self, arrays: list[Any], axes: tuple[tuple[str, Any], ...] = ()) -> Any:
        """The output from its arrays; ``axes`` (a :class:`Record`'s) put the axes that
        transforms stacked the arrays on in front of a NamedArray's names."""
        it = iter(arrays)
        static = dict(self.static)
        treedef = self.treedef
        lead = leading(axes)
        if lead:
            treedef = with_axes(treedef, lead)
        n = treedef.num_leaves
        if not self.same:
            return treedef.unflatten([static[i] if i in static else next(it) for i in range(n)])
        same = dict(self.same)
        out: list[Any] = []
        for i in range(n):
            out.append(static[i] if i in static else out[same[i]] if i in same else next(it))
        return treedef.unflatten(out)


def leading(axes: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, int], ...]:
    """``(name, size)`` of the leading axes a value gained leaving the transforms ``axes``
    (innermost first): a scan's is ``"layers"``; ``cond`` and an unbounded ``while`` add none."""
    return tuple(
        ("layers" if kind == "scan" else kind, n)
        for kind, n in reversed(axes)
        if not (kind == "cond" or (kind == "while" and n is None))
    )


class _Hashed:
    """A non-hashable static leaf, compared by identity."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


tag_p = core.Primitive("hookax_tag")
tag_p.multiple_results = True


def _tag_impl(*args: Any, sid: int, key: str, spec: Spec) -> Any:
    _lost(sid, key, spec)
    return list(args)


def _lost(sid: int, key: str, spec: Spec) -> None:
    s = live_session(sid)
    if s is not None:
        raise HookaxError(
            f"{s.who}: {spec.what(key)} ran where hookax cannot carry its value out (outside "
            f"the traces that {s.who} follows: inside jax.ensure_compile_time_eval, a callback, "
            f"or a function compiled ahead of time with .lower()). Call the model directly "
            f"inside the function given to {s.who}, or {spec.exclude}."
        )


tag_p.def_impl(_tag_impl)
tag_p.def_abstract_eval(lambda *avals, **_: list(avals))


def _tag_lowering(ctx: Any, *args: Any, sid: int, key: str, spec: Spec) -> Any:
    _lost(sid, key, spec)
    return list(args)


mlir.register_lowering(tag_p, _tag_lowering)


def _tag_jvp(primals: Any, tangents: Any, **params: Any) -> Any:
    return tag_p.bind(*primals, **params), list(tangents)


ad.primitive_jvps[tag_p] = _tag_jvp
ad.primitive_transposes[tag_p] = lambda cts, *args, **params: list(cts)


def _tag_batch(axis_data: Any, args: Any, dims: Any, **params: Any) -> Any:
    # The batch axis goes first (what the caller of a vmapped model sees); a value that does not
    # depend on the mapped input is broadcast, so every entry has the batch axis.
    moved = [
        batching.broadcast(x, axis_data.size, 0, None) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(args, dims)
    ]
    # A NamedArray-like value gains the axis too: its names fit its array (the vmap's axis_name,
    # else "batch"); the mapped function itself still gets the value as it made it.
    name = getattr(axis_data, "name", None)
    lead = ((name if isinstance(name, str) else "batch", axis_data.size),)
    spec = params["spec"]
    params = {**params, "spec": dataclasses.replace(spec, treedef=with_axes(spec.treedef, lead))}
    return tag_p.bind(*moved, **params), [0] * len(moved)


batching.fancy_primitive_batchers[tag_p] = _tag_batch


def _in_linen_broadcast_dce() -> bool:
    """Whether this dead-code removal is the one Linen's ``nn.scan`` runs on its body's
    broadcast pre-pass (``pe.dce_jaxpr`` called by ``scan_fn`` in ``flax/core/axes_scan.py``)."""
    f: Any = sys._getframe(1)
    while f is not None:
        back = f.f_back
        if (
            f.f_code.co_name == "dce_jaxpr"
            and back is not None
            and back.f_code.co_name == "scan_fn"
            and back.f_code.co_filename.endswith("axes_scan.py")
        ):
            return True
        f = back
    return False


def _tag_dce(used_outputs: list[bool], *args: Any) -> tuple[list[bool], Any]:
    # A mark is kept even when its output is unused: the call site ran, so it must be delivered.
    # (JAX 0.12 passes the live inputs before the equation.) Except in Linen's nn.scan pre-pass,
    # which (on newer Flax) traces the body, removes dead code and refuses any input still
    # used: that pass only finds the broadcast outputs, the scan itself runs (and marks) after.
    eqn = args[-1]
    if not any(used_outputs) and _in_linen_broadcast_dce():
        return [False] * len(eqn.invars), None
    return [True] * len(eqn.invars), eqn


pe.dce_rules[tag_p] = _tag_dce


def mark(out: Any, sid: int, key: str, op: bool = False) -> Any:
    """Bind the mark of session ``sid`` on the array leaves of ``out``; the same tree back.
    ``op``: ``key`` is an operation's address."""
    leaves, treedef = jax.tree.flatten(out)
    arrays, static, same = [], [], []
    first: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array | np.ndarray | core.Tracer):
            if id(leaf) in first:  # the same array again (tied weights): kept one array
                same.append((i, first[id(leaf)]))
                continue
            first[id(leaf)] = i
            arrays.append(leaf)
        else:
            try:
                hash(leaf)
                static.append((i, leaf))
            except TypeError:
                static.append((i, _Hashed(leaf)))
    spec = Spec(treedef, tuple(static), op, tuple(same))
    if not arrays:
        live = live_session(sid)
        if live is not None:
            live.on_static(key, spec)
        return out
    tagged = tag_p.bind(*arrays, sid=sid, key=key, spec=spec)
    return spec.rebuild(list(tagged))


@dataclasses.dataclass
class Record:
    """One marked value delivered to a session: the call-site key, its spec, its array leaves.

    ``axes`` lists the transforms it left on the way, innermost first (``("scan", 32)``,
    ``("cond", None)``, ``("while", None)``, ``("while", 64)``, ``("shard_map", n)``); each added a
    leading axis except ``cond`` and an unbounded ``while`` (its last iteration). A ``while`` with
    a bound (a session's ``while_steps``) stacks its iterations into that many rows and appends
    its iteration count to ``values``, after the output's leaves (innermost loop first).
    """

    key: str
    spec: Spec
    values: list[Any]
    axes: tuple[tuple[str, Any], ...] = ()

    @property
    def n_counts(self) -> int:
        """How many iteration counts of bounded ``while`` loops end ``values``."""
        return sum(1 for kind, n in self.axes if kind == "while" and n is not None)

    @property
    def counts(self) -> list[Any]:
        """The iteration counts of the bounded ``while`` loops it left, innermost first."""
        return self.values[len(self.values) - self.n_counts :]

    def output(self) -> Any:
        return unwrap(self.spec.rebuild(self.values[: len(self.values) - self.n_counts], self.axes))


def unwrap(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.value if isinstance(x, _Hashed) else x, tree)


# Record key -> (call-site key, layers, what follows the layer in a key: "" or ":softmax") for
# one-layer selections of a scanned call site ("blocks/attn[3]", "blocks/attn[3]:softmax"),
# recorded stacked over the scan and split by the collector. Filled while a selection traces and
# read by every later session: a function whose jit trace is cached (a user's jax.jit run a
# second time) records the key from its jaxpr without running the code that names it. The
# mapping is a function of the key (no framework's call-site key ends in "[digits]"), so one
# table serves every model.
LAYERED: dict[str, tuple[str, tuple[int, ...], str]] = {}


class Session:
    """What one capture (``reap``) or one differentiated call (``plant``) collects or injects.

    A child session collects inside a re-traced inner jaxpr and hands its records to the rule
    that made it.
    """

    def __init__(
        self,
        sid: int,
        who: str,
        mode: str = "reap",
        probes: list[Any] | None = None,
        while_steps: int | None = None,
    ):
        self.sid = sid
        self.who = who
        self.mode = mode  # "reap": record the values; "plant": add the next probe to each
        # rows of the buffer each ``while`` loop stacks its iterations into; None: last only
        self.while_steps = while_steps
        self.records: list[Record] = []
        self.probes = probes or []
        self.used = 0  # probes consumed so far (plant)
        self.seen: set[tuple[str, str]] = set()  # (key, path) of call sites not selected
        self.matched = False  # whether any call site was selected
        self.owners: dict[str, Any] = {}  # key -> the NNX module first selected under it
        self.starts: dict[str, None] = {}  # selected keys in the order their first call started
        # One-layer selections of a scanned call site, shared by every session: see LAYERED.
        self.layered = LAYERED
        self.op_notes: Any = None  # ``_ops.Notes`` of a session with ops= (set by its runner)

    def on_tag(self, args: list[Any], key: str, spec: Spec) -> list[Any]:
        if self.mode == "reap":
            self.records.append(Record(key, spec, list(args)))
            return list(args)
        return self.add_probe(args, key, spec)

    def on_static(self, key: str, spec: Spec) -> None:
        """A call site whose output holds no array: recorded as is, nothing to probe."""
        if self.mode == "reap":
            self.records.append(Record(key, spec, []))

    def take_probes(self, n: int, key: str, spec: Spec | None = None) -> list[Any]:
        if self.used + n > len(self.probes):
            what = spec.what(key) if spec is not None else repr(key)
            raise HookaxError(
                f"{self.who}: {what} ran more often while differentiating than when "
                f"its outputs were measured. The function must call the same modules the same "
                f"number of times for the same inputs (no data-dependent Python control flow, no "
                f"randomness in which modules run)."
            )
        out = self.probes[self.used : self.used + n]
        self.used += n
        return out

    def add_probe(self, args: list[Any], key: str, spec: Spec) -> list[Any]:
        probes = self.take_probes(1, key, spec)[0]
        out = []
        for x, p in zip(args, probes):
            if p is None:
                out.append(x)
                continue
            if tuple(np.shape(x)) != tuple(p.shape):
                raise HookaxError(
                    f"{self.who}: {spec.what(key)} returned shape {np.shape(x)} while "
                    f"differentiating but {p.shape} when its outputs were measured."
                )
            out.append(x + to_context_mesh(p.astype(x.dtype)))
        return out


class _Local(threading.local):
    def __init__(self) -> None:
        self.live: dict[int, Session] = {}


_LOCAL = _Local()


def depth() -> int:
    """How many top-level sessions run on this thread: the next session's id."""
    return len(_LOCAL.live)


def live_session(sid: int) -> Session | None:
    """The top-level session ``sid`` running on this thread, or None."""
    return _LOCAL.live.get(sid)


class ForwardingTrace(core.Trace):
    """A trace that forwards everything to its parent; subclasses intercept what they need.

    It shares its parent's trace identity (``_weakref``): frameworks that check "am I still in
    the trace this module was created in" (NNX, Linen) see no difference, and JAX's jit keys
    are unchanged. It creates no tracers of its own: values are the parent's.
    """

    __slots__ = ("parent",)

    def __init__(self, parent: Any) -> None:
        super().__init__()
        self.parent = parent
        self._weakref = parent._weakref
        self.requires_low = parent.requires_low

    def forward(self, prim: Any, args: Any, params: Any) -> Any:
        avals = [core.typeof(a) for a in args]
        return prim.bind_with_trace(self.parent, args, avals, params)

    def process_primitive(self, prim: Any, args: Any, params: Any) -> Any:
        return self.forward(prim, args, params)

    def process_call(self, prim: Any, fun: Any, args: Any, params: Any) -> Any:
        with core.set_current_trace(self):
            return fun.call_wrapped(*args)

    def cur_qdd(self, x: Any) -> Any:
        return self.parent.cur_qdd(x)

    def stage_value(self, val: Any) -> Any:
        with core.set_current_trace(self.parent):
            return self.parent.stage_value(val)
