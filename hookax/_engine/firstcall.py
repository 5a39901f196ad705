"""hookax's programs (patching grids, attribution, sweeps, circuits): the first call of a small
one runs without waiting for XLA.

A question asked for the first time (a new metric, a new kind of target) traces a program and,
under ``jax.jit``, compiles it: about a second on a CPU for a small model's patching grid, where
running its operations takes milliseconds. :class:`Program` is ``jax.jit`` with static
arguments, and on the first call of each program (each argument structure, shapes and dtypes,
static arguments, active hookax entries) it chooses:

* ``"interpret"``: the traced program (``jax.jit(...).trace``: the same jaxpr the compiled
  program is built from) run with NumPy, operation by operation
  (:mod:`hookax._engine.numpyeval`); the program is then compiled on a background thread once
  hookax has been idle for :data:`IDLE_S` (no question being answered: a compile beside the
  next question's trace would slow both, the two sharing Python). A call of the same program
  starts that compile at once and, until it ends, runs with NumPy again; the calls after it use
  the compiled program (nothing compiles twice);
* ``"compile"``: compiled now and run, as ``jax.jit`` does.

:func:`first_call` sets the choice; ``"auto"`` (the default; ``HOOKAX_FIRST_CALL`` in the
environment sets another) interprets a program called on concrete arrays (not inside a
``jax.jit`` of yours) when every operation has a NumPy form with the dtypes it computes
exactly as XLA does (float32, float64, integers, bool; not bfloat16 or float16), its matmuls
come to at most :data:`FLOP_LIMIT` FLOPs and its intermediate values to at most
:data:`BYTE_LIMIT` bytes, and otherwise compiles. Values agree with the compiled program's to
float rounding (operations add in another order), as JAX's eager operations do.

The same choice applies to hookax's workflows run eagerly (``hx.capture``,
``hx.value_and_grad``; :data:`OPS`): each program JAX would compile before running it (a
primitive's one-operation program, one of JAX's own ``jax.jit`` functions, at new shapes) runs
with NumPy on its first call when it is at most :data:`OP_FLOP_LIMIT` FLOPs and
:data:`OP_BYTE_LIMIT` bytes, and one background thread compiles those programs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax._src import core

from .._util import jaxcompat
from .._util.errors import HookaxError
from . import context as _context
from . import numpyeval

__all__ = ["BYTE_LIMIT", "FLOP_LIMIT", "Program", "first_call", "program"]

#: Interpret a first call only up to this many matmul FLOPs (NumPy runs about 6e9 a second on
#: one core of the 2-core CPU of the benchmarks; XLA compiles a small model's grid in ~1 s).
FLOP_LIMIT = 2e9
#: ... and this many bytes of intermediate values (NumPy keeps each until the program ends).
BYTE_LIMIT = 1 << 30
#: A background compile starts once no hookax question has been answered for this many seconds.
IDLE_S = 0.2
MODES = ("auto", "interpret", "compile")
_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "hookax_first_call", default=None
)


def _env_mode() -> str:
    mode = os.environ.get("HOOKAX_FIRST_CALL", "auto") or "auto"
    if mode not in MODES:
        raise HookaxError(
            f"HOOKAX_FIRST_CALL={mode!r} is not a mode. Fix: set it to one of "
            f"{', '.join(MODES)} (or unset it: auto)."
        )
    return mode


def mode() -> str:
    """The first-call mode now in effect."""
    return _MODE.get() or _env_mode()


@contextlib.contextmanager
def first_call(how: str = "auto") -> Iterator[None]:
    """How hookax's programs run the first time they are called in this block.

    ``"interpret"``: run with NumPy, operation by operation (when every operation has a NumPy
    form; otherwise compiled), and compiled on a background thread for the next call;
    ``"compile"``: compiled first, as ``jax.jit`` does; ``"auto"``: interpret small programs
    (see ``docs/benchmarks.md``), compile the rest. It covers hookax's programs (grids,
    attribution, sweeps, circuits) and the programs of hookax's workflows run eagerly
    (``hx.capture``, ``hx.value_and_grad`` of a model called outside ``jax.jit``).

    Examples:
      >>> import hookax as hx
      >>> with hx.first_call("compile"):
      ...     pass  # hx.patch_grid(...) here compiles before its first run
    """
    if how not in MODES:
        raise HookaxError(
            f"hx.first_call: {how!r} is not a mode. Fix: pass one of {', '.join(MODES)}."
        )
    token = _MODE.set(how)
    try:
        yield
    finally:
        _MODE.reset(token)


def _aval_key(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding)
    a = np.asarray(x)
    return (a.shape, a.dtype, type(x))


class _Idle:
    """Whether hookax is answering a question (a program's call, a workflow's trace): background
    compiles wait for it to have been idle for :data:`IDLE_S`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._since = time.monotonic()
        self.closing = False  # the interpreter is exiting: compiles not yet started are dropped

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        with self._cond:
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._since = time.monotonic()
                self._cond.notify_all()

    def wait(self, now: threading.Event) -> None:
        """Return once hookax has been idle for :data:`IDLE_S`, or ``now`` is set."""
        with self._cond:
            while not now.is_set() and not self.closing:
                left = IDLE_S - (time.monotonic() - self._since)
                if not self._busy and left <= 0:
                    return
                self._cond.wait(left if not self._busy and left > 0 else IDLE_S)

    def touch(self) -> None:
        """hookax did something just now (an eager operation run with NumPy)."""
        with self._cond:
            self._since = time.monotonic()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        self.closing = True
        self.wake()


IDLE = _Idle()
working = IDLE.working
# Run when the interpreter starts to exit, before it joins the compile threads (a compile
# nobody will use is not started; one under way ends first: see _Compiling).
_at_exit = getattr(threading, "_register_atexit", None)
if _at_exit is not None:
    _at_exit(IDLE.close)


@functools.cache
def _configs() -> tuple[Any, ...]:
    """JAX's configuration states (its flags, its context managers' states) and hookax's keys:
    what a trace context is made of, but the trace state itself. A compile thread runs under
    its caller's (:func:`_local_config`): JAX keys its lowering and compile caches by them, so
    a compile under a thread's defaults is not the one the caller's next call looks for."""
    from jax._src import config as jc

    kind = type(jc.abstract_mesh_context_manager)
    found: dict[int, Any] = {}
    for v in (*vars(jc).values(), *jc.config_states.values()):
        v = getattr(v, "_obj", v)
        if isinstance(v, kind):
            found[id(v)] = v
    for ctx in (_context.ACTIVE, _context.REGISTERED):
        found[id(ctx._obj)] = ctx._obj
    return tuple(found.values())


def _local_config() -> list[tuple[Any, Any]]:
    """This thread's own values of :func:`_configs` (``get_local``: a sentinel where unset)."""
    try:
        return [(c, c.get_local()) for c in _configs()]
    except Exception:  # another JAX's configuration objects: the thread's defaults
        return []


@contextlib.contextmanager
def _config_as(config: list[tuple[Any, Any]]) -> Iterator[None]:
    """Another thread's configuration (:func:`_local_config`) on this one, for a block."""
    before = [c.swap_local(v) for c, v in config]
    try:
        yield
    finally:
        for (c, _), b in zip(config, before):
            c.set_local(b)


class _Compiling:
    """The background compile of a program interpreted once."""

    __slots__ = ("error", "jaxpr", "now", "thread")

    def __init__(self, traced: Any) -> None:
        self.error: BaseException | None = None
        self.jaxpr = traced.jaxpr
        self.now = threading.Event()  # set: compile without waiting for hookax to be idle
        config = _local_config()  # the caller's, as the next call's cache lookup sees it

        def run() -> None:
            try:
                IDLE.wait(self.now)
                if IDLE.closing:
                    return
                with _config_as(config):
                    traced.lower().compile()
            except BaseException as e:  # the next call compiles in the foreground and raises
                self.error = e

        # Not a daemon: a process that ends during a compile waits for it (a daemon thread
        # inside XLA's compiler when the interpreter shuts down aborts the process).
        self.thread = threading.Thread(target=run, name="hookax-compile", daemon=False)
        self.thread.start()

    def start(self) -> None:
        """Compile now, without waiting for hookax to be idle."""
        self.now.set()
        IDLE.wake()

    def wait(self) -> None:
        self.start()
        self.thread.join()


class _NewProgram(Exception):
    """Raised where ``jax.jit`` would trace the function: this call's program is new."""


class Program:
    """``jax.jit(fn, static_argnums=...)`` whose first call may run without compiling.

    A warm call is ``jax.jit``'s own (its C++ cache): the function raises :class:`_NewProgram`
    when JAX traces it during a probed call, which is how a new program is told from a known
    one without a key of hookax's own."""

    def __init__(self, fn: Callable[..., Any], static_argnums: tuple[int, ...]) -> None:
        self.fn = fn
        self._local = threading.local()

        @functools.wraps(fn)
        def traced(*args: Any) -> Any:
            probe = getattr(self._local, "probe", None)
            if probe == "raise":
                raise _NewProgram
            if probe == "note":
                self._local.new = True
            return fn(*args)

        self.jitted = jax.jit(traced, static_argnums=static_argnums)
        self.static = frozenset(static_argnums)
        self._pending: list[_Compiling] = []
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)
        self.interpreted = 0  # first calls run with NumPy (the tests read it)
        self.lower = self.jitted.lower
        self.trace = self.jitted.trace

    def __call__(self, *args: Any) -> Any:
        if not core.trace_state_clean():  # inside a transform of yours: part of your program
            return self.jitted(*args)
        with working():
            return self._call(*args)

    def _call(self, *args: Any) -> Any:
        how = mode()
        with self._lock:
            self._pending = [p for p in self._pending if p.thread.is_alive()]
            pending = list(self._pending)
        if pending:  # compiles under way: is this call's program one of them?
            self._local.probe, self._local.new = "note", False
            try:
                traced = self.jitted.trace(*args)  # JAX's trace cache; a new program is traced
            finally:
                self._local.probe = None
            if not self._local.new:
                # Called again: its compile starts now (a program asked for twice is asked
                # for more), and until it ends the call runs with NumPy again.
                mine = [p for p in pending if p.jaxpr is traced.jaxpr]
                for p in mine:
                    p.start()
                if mine and how != "compile":
                    out = self._interpret(traced, self._leaves(args), how)
                    if out is not None:
                        return out
                for p in mine:
                    p.wait()  # its compile, not a second one
                return self.jitted(*args)
            if how == "compile":
                return self.jitted(*args)
        else:
            if how == "compile":
                return self.jitted(*args)
            self._local.probe = "raise"
            try:
                return self.jitted(*args)  # a known program: jax.jit's own call
            except _NewProgram:
                pass
            finally:
                self._local.probe = None
            traced = self.jitted.trace(*args)
        out = self._interpret(traced, self._leaves(args), how)
        if out is None:
            return self.jitted(*args)
        with self._lock:
            self._pending.append(_Compiling(traced))
        return out

    def _leaves(self, args: tuple[Any, ...]) -> list[Any]:
        return jax.tree.leaves(tuple(a for i, a in enumerate(args) if i not in self.static))

    def _interpret(self, traced: Any, leaves: list[Any], how: str) -> Any | None:
        jaxpr, consts = jaxcompat.closed_parts(traced.jaxpr)
        if len(jaxpr.invars) != len(leaves) or numpyeval.unsupported(jaxpr) is not None:
            return None
        if any(isinstance(x, core.Tracer) for x in leaves):  # a value of some trace's: no
            return None
        if how == "auto" and not small(jaxpr):
            return None
        outs = numpyeval.evaluate(jaxpr, consts, leaves)
        arrays = [_array(o, v.aval) for o, v in zip(outs, jaxpr.outvars)]
        self.interpreted += 1
        return jax.tree.unflatten(traced.out_tree, arrays)


def _array(x: Any, aval: Any, device: Any = None) -> Any:
    """A result as the compiled program gives it: a ``jax.Array`` (committed to ``device`` when
    given), weakly typed where the program's result is (later operations on it then hit the
    caches the compiled results fill)."""
    out = jax.device_put(np.asarray(x), device)
    if getattr(aval, "weak_type", False):
        try:
            from jax._src import array as _array_impl

            weak = core.ShapedArray(out.shape, out.dtype, weak_type=True)
            out = _array_impl.ArrayImpl(weak, out.sharding, out._arrays, committed=out._committed)
        except Exception:  # another JAX's internals: the array as it is
            pass
    return out


def small(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` is small enough to interpret under ``"auto"``."""
    return numpyeval.flops(jaxpr) <= FLOP_LIMIT and _bytes(jaxpr) <= BYTE_LIMIT


def _bytes(jaxpr: Any) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            aval = v.aval
            if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                total += math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
        trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in numpyeval._subjaxprs(eqn):
            total += trips * _bytes(sub)
    return total


def program(static_argnums: int | tuple[int, ...] = ()) -> Callable[[Callable[..., Any]], Program]:
    """Decorator: ``@program(static_argnums=0)`` in place of
    ``@functools.partial(jax.jit, static_argnums=0)``."""
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    return lambda fn: Program(fn, static)


# --- Eager operations --------------------------------------------------------------------------
#
# hookax's workflows run eagerly (``hx.value_and_grad``, ``hx.capture`` of a model called
# outside ``jax.jit``: ``eager.eager_workflow``) run each primitive as a
# one-operation program, and each of JAX's own ``jax.jit`` functions as its program, compiled on
# first use with each new set of shapes: a 3-layer GPT's first eager ``hx.value_and_grad``
# compiled 144 of them (4 s), for a computation that takes 0.25 s once they are compiled. Under
# "auto" (and "interpret"), such a program's first call runs with NumPy while it is compiled on
# one background thread (waiting, as programs do, for hookax to be idle); later calls of a
# program still compiling run with NumPy again and hurry the compiles; the call after its
# compile is JAX's own (the compile found in JAX's caches).

#: An eager operation runs with NumPy first only up to these matmul FLOPs and bytes of values
#: (XLA compiles a one-operation program in 10-30 ms on the benchmarks' CPU).
OP_FLOP_LIMIT = 5e7
OP_BYTE_LIMIT = 1 << 25
_CHECKS_VALUES = jaxcompat.config.debug_nans
_CHECKS_INFS = jaxcompat.config.debug_infs


class _OpCompile:
    """An eager operation's compile: JAX's own compile-and-run of it, on the compile thread."""

    __slots__ = ("args", "config", "done", "original", "params")

    def __init__(self, original: Callable[..., Any], args: tuple[Any, ...], params: Any) -> None:
        self.original, self.args, self.params = original, args, params
        self.config = _local_config()  # JAX's caches are keyed by the caller's trace context
        self.done = False

    def run(self) -> None:
        args, params, config = self.args, self.params, self.config
        self.args, self.params, self.config = (), None, []
        try:
            with _config_as(config):
                self.original(*args, **params)  # fills the lowering and compile caches
        except BaseException:  # the next call compiles in the foreground and raises there
            pass
        finally:
            self.done = True


class _Again:
    """Where ``_pjit_call_impl_python`` returns its PGLE profiler: one that asks for the program
    to be built again (``pjit._need_to_rebuild_with_fdo``). Without it, JAX's C++ dispatch
    would remember a call answered without an executable as one for its Python path, forever;
    with it, the call after the compile is JAX's own and fills the C++ cache."""

    @staticmethod
    def is_enabled() -> bool:
        return True

    @staticmethod
    def is_fdo_consumed() -> bool:
        return False


_AGAIN = _Again()


class _Ops:
    """The eager operations run with NumPy, and the thread compiling them, one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[_OpCompile] = []
        self._worker: threading.Thread | None = None
        self.hurry = threading.Event()  # an operation was called again: compile without waiting
        # program -> {call's shapes and parameters: its compile, or False (compile as JAX does)}
        self._seen: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
        self.interpreted = 0  # calls run with NumPy (the tests read it)

    def first(self, original: Callable[..., Any], args: tuple[Any, ...], params: Any) -> Any:
        """``_pjit_call_impl_python``'s result for a call run with NumPy, or None (run it as JAX
        does)."""
        how = mode()
        if how == "compile" or _CHECKS_VALUES.value or _CHECKS_INFS.value:
            return None  # (jax_debug_nans/infs: the compiled program's checks)
        program = params["jaxpr"]
        try:
            with self._lock:
                table = self._seen.setdefault(program, {})
                key = (tuple(_aval_key(a) for a in args), tuple(sorted(_params_key(params))))
                job = table.get(key)
        except TypeError:  # not hashable or not weakly referenceable: as JAX does
            return None
        if job is False or (job is not None and job.done):
            return None
        device = _numpy_device(args, params)
        if job is None and (device is None or not self._interpretable(program, args, how)):
            table[key] = False
            return None
        jaxpr, consts = jaxcompat.closed_parts(program)
        try:
            outs = numpyeval.evaluate(jaxpr, consts, [np.asarray(a) for a in args])
        except Exception:  # NumPy's own failure: compiled, as JAX does
            table[key] = False
            return None
        committed = any(getattr(a, "_committed", False) for a in args)
        at = device if committed else None
        arrays = [_array(o, v.aval, at) for o, v in zip(outs, jaxpr.outvars, strict=True)]
        self.interpreted += 1
        IDLE.touch()
        if job is None:
            job = _OpCompile(original, args, params)
            with self._lock:
                table[key] = job
                self._queue.append(job)
                if self._worker is None:
                    self._worker = threading.Thread(
                        target=self._work, name="hookax-op-compile", daemon=False
                    )
                    self._worker.start()
        else:
            self.hurry.set()
            IDLE.wake()
        return arrays, None, _AGAIN, []

    @staticmethod
    def _interpretable(program: Any, args: tuple[Any, ...], how: str) -> bool:
        jaxpr, _ = jaxcompat.closed_parts(program)
        if jaxpr.effects or len(jaxpr.invars) != len(args) or numpyeval.unsupported(jaxpr):
            return False
        if how != "auto":
            return True
        held = sum(getattr(a, "nbytes", 0) for a in args)  # kept until compiled
        return numpyeval.flops(jaxpr) <= OP_FLOP_LIMIT and held + _bytes(jaxpr) <= OP_BYTE_LIMIT

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue or IDLE.closing:
                    self._queue.clear()  # at exit: compiles nobody will use are dropped
                    self._worker = None
                    self.hurry.clear()
                    return
                job = self._queue.pop(0)
            IDLE.wait(self.hurry)
            if not IDLE.closing:
                job.run()

    def join(self) -> None:
        """Compile every pending operation now and wait for them (tests, benchmarks)."""
        self.hurry.set()
        IDLE.wake()
        while True:
            with self._lock:
                worker = self._worker
            if worker is None:
                return
            worker.join()


OPS = _Ops()


def _params_key(params: Any) -> Iterator[tuple[str, Any]]:
    for k, v in params.items():
        if k != "jaxpr":
            hash(v)
            yield k, v


def _numpy_device(args: tuple[Any, ...], params: Any) -> Any:
    """The CPU device a call's arrays are all on (its results go there), or None where the call
    is not one to run with NumPy (sharded or on an accelerator, donated buffers, layouts or
    compiler options of its own)."""
    if any(params.get("donated_invars", ())) or params.get("compiler_options_kvs"):
        return None
    for s in (*params.get("in_shardings", ()), *params.get("out_shardings", ())):
        if type(s).__name__ != "UnspecifiedValue":
            return None
    if any(x is not None for x in (*params.get("in_layouts", ()), *params.get("out_layouts", ()))):
        return None
    chosen = jaxcompat.config.default_device.value  # a jax.default_device block's, or None
    default = jax.devices()[0] if chosen is None else chosen
    device = None
    for a in args:
        if isinstance(a, core.Tracer):
            return None
        if not isinstance(a, jax.Array):
            continue
        devices = a.devices()
        if len(devices) != 1:
            return None
        (d,) = devices
        if d.platform != "cpu" or (device is not None and d != device):
            return None
        device = d
    if device is None:  # no array: the results go to JAX's default device
        return default if getattr(default, "platform", None) == "cpu" else None
    if device != default and not any(getattr(a, "_committed", False) for a in args):
        return None  # uncommitted arrays off the default device: JAX's own placement
    return device
