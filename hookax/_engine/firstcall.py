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
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import threading
import time
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
    (see ``docs/benchmarks.md``), compile the rest.

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


class _Compiling:
    """The background compile of a program interpreted once."""

    __slots__ = ("error", "jaxpr", "now", "thread")

    def __init__(self, traced: Any) -> None:
        self.error: BaseException | None = None
        self.jaxpr = traced.jaxpr
        self.now = threading.Event()  # set: compile without waiting for hookax to be idle
        active = _context._ACTIVE_VALUE.value

        def run() -> None:
            try:
                IDLE.wait(self.now)
                if IDLE.closing:
                    return
                with _context.ACTIVE(active):
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


def _array(x: Any, aval: Any) -> Any:
    """A result as the compiled program gives it: a ``jax.Array``, weakly typed where the
    program's result is (later operations on it then hit the caches the compiled results
    fill)."""
    out = jax.device_put(np.asarray(x))
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
