"""Eager operations compiled once, whatever hookax has active.

JAX runs code called outside any trace operation by operation: each primitive as a one-operation
``jax.jit`` program, and each ``jax.jit`` function it meets (``jax.numpy``'s own: ``jnp.mean``,
``jnp.take``, ``jnp.einsum``, ``jax.nn.softmax``; the model's) as its traced program. Every cache
on that path (the traces, the one-operation programs, lowering, compilation) is keyed by the
trace context, which holds hookax's keys (:data:`~.context.ACTIVE`, the active entries, and
:data:`~.context.REGISTERED`, the registered hooks). So each new set of entries compiled every
operation a model runs eagerly again: a 3-layer GPT's first eager capture of every
TransformerLens name made 69 compiles (3.9 s) for a forward that runs in 25-40 ms.

What a compile of an already traced program makes does not depend on hookax: the program's
hookax parts (tags, call sites, interventions) were traced into it under the entries then
active. So once hookax is used (:func:`install`, called where an entry or a hook is first made
active), four of JAX's eager steps run with hookax's keys at their defaults:

* a primitive's one-operation program (``dispatch.xla_primitive_callable``);
* compiling and running a traced ``jax.jit`` program (``pjit._pjit_call_impl_python``);
* the trace of one of JAX's own ``jax.jit`` functions (``jax.numpy``'s, ``jax.nn``'s, given no
  function of anyone else's), where it is the program the function traces to with no entry
  active: the trace with the entries runs first, and its program replaces it when the two print
  the same, with the same constants. The user's own
  ``jax.jit`` functions keep their own programs (traced and compiled with the entries, as
  before): their Python may do things while traced, which a second trace would do again;
* ``jax.vmap`` of such a replaced program (``batching.batch_jaxpr2``).

Inside a program being traced (``jax.jit``, ``jax.grad`` under it) nothing changes: a function's
program becomes part of the outer one, compiled with it.

Callbacks run the user's Python while a program runs, so programs with effects (and callback
primitives) keep the entries. Nothing changes while no entry is active and no hook registered.

A program JAX compiles before running it eagerly inside one of hookax's workflows
(:class:`eager_workflow`: ``hx.capture``, ``hx.value_and_grad``, whose backward pass runs
after its entries are gone, ``hx.value_grad_and_stats``) runs with NumPy on its first call under
``hx.first_call("auto")`` and is compiled on a background thread (:data:`~.firstcall.OPS`).
Code the user runs eagerly under ``hx.intercept`` or registered hooks keeps XLA's programs
(a no-op interceptor changes no value).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any

import jax

from .._util import jaxcompat as _jaxcompat
from . import context as _context
from . import firstcall as _firstcall

__all__ = ["eager_workflow", "install", "jax_functions_at_defaults", "program_of"]

_ACTIVE = _context._ACTIVE_VALUE
_REGISTERED = _context.REGISTERED._obj
_LOCK = threading.Lock()
_LOCAL = threading.local()
_INSTALLED: list[Any] = []


def _idle() -> bool:
    """hookax's keys are at their defaults on this thread."""
    return not _ACTIVE.value and _REGISTERED.value is None


# ``ops=`` entries trace ``jax.nn.softmax`` as one operation (``jax_softmax_custom_jvp``, also
# in the trace context): a flag read by tracing only, set back with the keys.
_SOFTMAX = _jaxcompat.config.softmax_custom_jvp


class _at_defaults:
    """A block with hookax's keys (and the softmax flag) as they are when hookax is idle."""

    __slots__ = ("_blocks",)

    def __enter__(self) -> None:
        blocks = [_context.ACTIVE(()), _context.REGISTERED(None)]
        softmax = _SOFTMAX.get_global()
        if _SOFTMAX.value != softmax:
            blocks.append(_SOFTMAX(softmax))
        self._blocks = blocks
        for b in blocks:
            b.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for b in reversed(self._blocks):
            b.__exit__(*exc)


class _Operation:
    """A primitive's one-operation program, run with hookax's keys at their defaults."""

    __slots__ = ("fun",)

    def __init__(self, fun: Any) -> None:
        self.fun = fun

    def __call__(self, *args: Any) -> Any:
        with _at_defaults():
            return self.fun(*args)


def _operations(original: Any) -> Any:
    @functools.wraps(original)
    def xla_primitive_callable(prim: Any, **params: Any) -> Any:
        if _idle() or "callback" in prim.name:
            return original(prim, **params)
        with _at_defaults():
            return _Operation(original(prim, **params))

    return xla_primitive_callable


def _programs(original: Any) -> Any:
    @functools.wraps(original)
    def _pjit_call_impl_python(*args: Any, **params: Any) -> Any:
        region = getattr(_LOCAL, "workflow", False)
        idle = _idle()
        if (idle and not region) or _jaxcompat.closed_parts(params["jaxpr"])[0].effects:
            return original(*args, **params)
        _LOCAL.workflow = False
        try:
            with contextlib.nullcontext() if idle else _at_defaults():
                if region:  # a hookax workflow run eagerly: NumPy first
                    quick = _firstcall.OPS.first(original, args, params)
                    if quick is not None:
                        return quick
                return original(*args, **params)
        finally:
            _LOCAL.workflow = region

    return _pjit_call_impl_python


# A program traced with entries active -> the same function's program traced with none, or
# False where they differ. Weak: it lives while JAX's trace cache holds the program.
_SAME: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
# The programs that replaced one (traced with no entry active), and their vmapped forms.
_PLAIN: weakref.WeakSet[Any] = weakref.WeakSet()


_STAGING = _jaxcompat.pe.DynamicJaxprTrace


def _staged() -> bool:
    """Whether a program is being traced here (a ``jax.jit`` function's trace inside it becomes
    part of that program, compiled with it), rather than run as it goes (eagerly, or under
    ``vmap`` or hookax's own traces over eager code)."""
    t = _context.current_trace()
    while t is not None:
        if isinstance(t, _STAGING):
            return True
        t = _context._parent(t)
    return False


def _from_jax(fn: Any) -> bool:
    """Whether ``fn`` is JAX's own (``jax.numpy``'s, ``jax.nn``'s jitted functions). Only those,
    given no function of anyone else's (:func:`_jax_args`), are traced a second time: they run
    no user code, so no hookax call site, while traced. (A user's function may do things while
    traced, such as an ``hx.hook_grad`` hook, which runs when JAX traces the backward pass: it
    is traced once, with the entries, as before.)"""
    module = getattr(fn, "__module__", None) or ""
    return module == "jax" or module.startswith("jax.")


def _jax_args(args: Any, kwargs: Any) -> bool:
    leaves = jax.tree.leaves((args, kwargs))
    return all(_from_jax(x) for x in leaves if callable(x) and not isinstance(x, jax.Array))


def _same(p: Any, q: Any) -> bool:
    """Whether two traces of one function made the same program."""
    if p.in_tree != q.in_tree or p.out_tree != q.out_tree or len(p.consts) != len(q.consts):
        return False
    if any(a is not b for a, b in zip(p.consts, q.consts, strict=True)):
        return False
    others = {k: v for k, v in p.params.items() if k != "jaxpr"}
    if others != {k: v for k, v in q.params.items() if k != "jaxpr"}:
        return False
    return str(p.params["jaxpr"]) == str(q.params["jaxpr"])


class eager_workflow:
    """A block in which a hookax workflow runs the user's code eagerly (``hx.capture``,
    ``hx.value_and_grad`` called outside ``jax.jit``): its programs, hookax's entries active or
    not (JAX's backward pass runs after the forward's entries are gone), run with NumPy on their
    first call (:data:`~.firstcall.OPS`)."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        install()  # the block acts through the wrapped eager steps
        self._was = getattr(_LOCAL, "workflow", False)
        _LOCAL.workflow = True

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.workflow = self._was


class jax_functions_at_defaults:
    """A block in which JAX's own ``jax.jit`` functions given only JAX's functions are traced
    with hookax's keys at their defaults, staged or not: for hookax's own traces whose only
    entry is a call-site interceptor (finding a model's call sites), entered with nothing else
    active. Such a function runs no module and no function of the user's, so the interceptor
    cannot act in it, and its program is the one the model's plain runs traced (JAX's trace
    cache hit) instead of a new trace under a new key: 47 of a 3-layer GPT's 54 traces."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = getattr(_LOCAL, "plain", False)
        _LOCAL.plain = _idle() and _SOFTMAX.value == _SOFTMAX.get_global()

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.plain = self._was


#: hookax's results that hold one array and are pytrees whose static data is new for each
#: result (``hx.LabelledArray``: labels, the metric's runs). JAX's own ``jax.jit`` functions
#: read them as their array, so they are given the array: a new result is not a new program
#: (``jnp.swapaxes(grid, 0, 1)`` traced and compiled once, not once per grid).
ARRAY_HOLDERS: list[type[Any]] = []


def _arrays_of(args: Any, kwargs: Any) -> tuple[Any, Any]:
    kinds = tuple(ARRAY_HOLDERS)
    if not any(isinstance(a, kinds) for a in (*args, *kwargs.values())):
        return args, kwargs
    args = tuple(a.values if isinstance(a, kinds) else a for a in args)
    kwargs = {k: v.values if isinstance(v, kinds) else v for k, v in kwargs.items()}
    return args, kwargs


def _traces(original: Any) -> Any:
    @functools.wraps(original)
    def _infer_params(fun: Any, ji: Any, args: Any, kwargs: Any) -> Any:
        if ARRAY_HOLDERS and _from_jax(fun):
            args, kwargs = _arrays_of(args, kwargs)
        if getattr(_LOCAL, "plain", False) and _from_jax(fun) and _jax_args(args, kwargs):
            with _at_defaults():
                return original(fun, ji, args, kwargs)
        if _idle() or not _from_jax(fun) or _staged() or not _jax_args(args, kwargs):
            return original(fun, ji, args, kwargs)
        p, flat = original(fun, ji, args, kwargs)
        jaxpr = p.params["jaxpr"]
        plain: Any
        try:
            plain = _SAME.get(jaxpr)
        except TypeError:  # not weakly referenceable: keep it
            return p, flat
        if plain is None:
            plain = False
            try:
                with _at_defaults():
                    q, _ = original(fun, ji, args, kwargs)
                if q.params["jaxpr"] is not jaxpr and _same(p, q):
                    plain = q
            except Exception:  # traced only with the entries: its own program, as before
                plain = False
            _SAME[jaxpr] = plain
            if plain is not False:
                _PLAIN.add(plain.params["jaxpr"])
        if plain is False:
            return p, flat
        return plain, [*plain.consts, *flat[len(p.consts) :]]

    return _infer_params


def _vmapped(original: Any) -> Any:
    @functools.wraps(original)
    def batch_jaxpr2(jaxpr: Any, *args: Any, **kwargs: Any) -> Any:
        if _idle() or jaxpr not in _PLAIN:
            return original(jaxpr, *args, **kwargs)
        with _at_defaults():
            out = original(jaxpr, *args, **kwargs)
        _PLAIN.add(out[0])
        return out

    return batch_jaxpr2


# A custom-derivative function's body run eagerly under an ``ops=`` entry (``jax.nn.softmax``,
# traced by hookax to name its operations) -> its ``jax.jit`` program, by the body's printed
# form: one compile per body and shapes, where running the body op by op compiled each of its
# operations (8 for softmax, 0.3 s) once per process.
_BODIES: dict[str, Any] = {}
_BODY_LIMIT = 256


def _plain_body(jaxpr: Any) -> bool:
    """No effects, none of hookax's primitives, and no inner program but ``jax.jit``'s (which
    print whole)."""
    if jaxpr.effects:
        return False
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("hookax_"):
            return False
        subs = list(_jaxcompat.core.jaxprs_in_params(eqn.params))
        if subs and eqn.primitive is not _jaxcompat.pjit.jit_p:
            return False
        if not all(_plain_body(j) for j in subs):
            return False
    return True


def program_of(closed: Any, name: str) -> Any:
    """A function that runs ``closed`` (the traced body of function ``name``) as one compiled
    program (``jit(<name>_body)``), with hookax's keys at their defaults, or None where its
    printed form may not say all it does."""
    jaxpr, consts = _jaxcompat.closed_parts(closed)
    if not _plain_body(jaxpr):
        return None
    key = f"{name}\n{jaxpr}"
    run = _BODIES.get(key)
    if run is None:
        if len(_BODIES) >= _BODY_LIMIT:
            _BODIES.pop(next(iter(_BODIES)))
        eval_jaxpr = _jaxcompat.core.eval_jaxpr

        def body(c: Any, *a: Any) -> Any:
            return eval_jaxpr(jaxpr, c, *a)

        body.__name__ = body.__qualname__ = f"{name}_body"
        from . import firstcall

        run = _BODIES[key] = firstcall.Program(body, ())

    def call(*args: Any) -> Any:
        with _at_defaults():
            return run(consts, *args)

    return call


def install() -> None:
    """Run eager operations with hookax's keys at their defaults (see the module docstring)."""
    if _INSTALLED:
        return
    with _LOCK:
        if _INSTALLED:
            return
        dispatch, pjit = _jaxcompat.dispatch, _jaxcompat.pjit
        patches = [
            (dispatch, "xla_primitive_callable", _operations),
            (pjit, "_infer_params", _traces),
            (pjit, "_pjit_call_impl_python", _programs),
            (_jaxcompat.batching, "batch_jaxpr2", _vmapped),
        ]
        for owner, name, wrap in patches:
            original = getattr(owner, name, None)
            if original is not None:
                setattr(owner, name, wrap(original))
                _INSTALLED.append((owner, name, original))
