"""Per-module hooks (``register_*``), their handles, and the scoped form ``hx.hooks``.

Where per-module hooks live: a :class:`HookSet` stored as a plain (static, non-Variable) attribute
of the NNX module. NNX puts static attributes into the graphdef, so the hooks travel with the
module through ``nnx.split``/``nnx.merge``, ``nnx.jit``, ``jax.jit`` over modules, ``nnx.vmap``,
``nnx.scan`` and ``nnx.remat``; replacing the set (adding or removing a hook) changes the graphdef,
so jitted functions retrace; and the hooks are not in ``nnx.state(module)``, so checkpoints do not
change. Hook records compare by value (the hook function and its options), so registering the
same hook again gives an equal graphdef and hits every cache. A jitted closure over the model
(``jax.jit(lambda x: model(x))``) does not see the graphdef: every registration and removal also
publishes the registered hooks as a jit cache key (:func:`hookax._engine.context.publish`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .._engine import adapters as _frameworks
from .._engine import context as _context
from .._engine import eager as _eager
from .._engine.select import CALL_ONLY, Where, as_selector, input_entries
from .._util.errors import HookaxError, HookError, SelectorError
from .._util.fnkey import FnKey, note_fresh
from .hookcheck import check_arity
from .intercept import Entry, tracked

__all__ = [
    "ATTR",
    "HookHandle",
    "HookRecord",
    "HookSet",
    "hooks",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "remove_hooks",
]

ATTR = "_hookax_hooks"
KINDS = ("forward_pre", "forward", "backward_pre", "backward")
_TOKENS = itertools.count(1)
_MARK = "__hookax_wrapped__"  # set on the method wrappers by the framework adapters


def _publish() -> None:
    """Publish the registered hooks as a cache key (eager operations then compile once
    whatever is registered: :mod:`hookax._engine.eager`)."""
    _eager.install()
    _context.publish()


@dataclasses.dataclass(frozen=True)
class HookRecord:
    """One hook on one module: compared by value (the function, its kind and options)."""

    kind: str
    fn: Callable[..., Any] = dataclasses.field(compare=False)
    methods: tuple[str, ...] = CALL_ONLY
    with_kwargs: bool = False
    always_call: bool = False
    prepend: bool = False
    # The scan iterations it applies to (a where= like "blocks/mlp[3]"); None: every call.
    layers: frozenset[int] | None = None
    # The registration's id (HookHandle.id); 0 for a scoped hook (hx.hooks).
    token: int = dataclasses.field(default=0, compare=False, repr=False)
    # The function's value-stable key (see _fnkey): a hook re-created with the same code over
    # the same objects gives an equal record, so an equal graphdef and jit cache key.
    key: FnKey = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", FnKey(self.fn))

    def __reduce__(self) -> tuple[Any, ...]:
        # The key (code objects) does not pickle: rebuild it. A copy gets a new token, so a
        # handle removes its hooks from the modules it was registered on only, as in PyTorch.
        options = (self.methods, self.with_kwargs, self.always_call, self.prepend, self.layers)
        return (_restore, (self.kind, self.fn, *options))


def _restore(
    kind: str,
    fn: Any,
    methods: tuple[str, ...],
    with_kwargs: bool,
    always_call: bool,
    prepend: bool,
    layers: frozenset[int] | None = None,
) -> HookRecord:
    """A :class:`HookRecord` from a pickle or a deepcopy, with a token of its own."""
    return HookRecord(kind, fn, methods, with_kwargs, always_call, prepend, layers, next(_TOKENS))


class HookSet:
    """The immutable, hashable hooks of one module, kept in run order.

    Stored as the module attribute ``_hookax_hooks``: static graph data, so it travels in the
    graphdef through every NNX transform, and the method wrappers' idle check looks for it.
    """

    __slots__ = ("__weakref__", "records")

    records: tuple[HookRecord, ...]

    def __init__(self, records: tuple[HookRecord, ...]) -> None:
        self.records = records

    def __reduce__(self) -> tuple[Any, ...]:
        return (HookSet, (self.records,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HookSet) and self.records == other.records

    def __hash__(self) -> int:
        return hash(self.records)

    def __repr__(self) -> str:
        return f"HookSet({self.records!r})"

    def add(self, record: HookRecord) -> HookSet:
        if not record.prepend:
            return HookSet((*self.records, record))
        # Like PyTorch: a prepended hook goes before every hook of its kind, earlier prepends too.
        return HookSet((record, *self.records))

    def without(self, token: int) -> HookSet | None:
        kept = tuple(r for r in self.records if r.token != token)
        return HookSet(kept) if kept else None


def hook_set(module: Any) -> HookSet | None:
    """The hooks of ``module``, or None."""
    return vars(module).get(ATTR)


def _store(module: Any, hs: HookSet | None, registered: bool = True) -> None:
    """Set ``module``'s hooks; ``registered``: a module of the user's (not a copy a transform
    rebuilt), whose hooks enter the jit cache key (:func:`hookax._engine.context.publish`)."""
    if hs is None:
        if ATTR in vars(module):
            delattr(module, ATTR)
    elif ATTR in vars(module):
        # Replacing the set. Not through NNX's __setattr__: a hook may remove a hook while a
        # transform traces the module (e.g. under nnx.jit), where NNX refuses to mutate the
        # module from a different trace level; the attribute is static and already declared.
        object.__setattr__(module, ATTR, hs)
    else:
        setattr(module, ATTR, hs)
    if registered:
        _context.track_hooked(module, hs is not None)
        _context.set_registered(module, hs)


# Adding or removing a hook reads a module's hook set and stores a new one: one thread at a time,
# so registrations from several threads on one module are never lost (re-entrant: a hook may
# remove a hook while another registration's callback runs).
_LOCK = threading.RLock()


def _drop(module: Any, token: int, registered: bool = True) -> None:
    with _LOCK:
        hs = hook_set(module)
        if hs is not None and any(r.token == token for r in hs.records):
            _store(module, hs.without(token), registered)


def _copies_in_call(token: int) -> None:
    """Drop ``token``'s hooks from the modules of the calls in progress on this thread.

    Inside a transform (``nnx.jit``, ``jax.jit`` over modules...) a hook runs on a copy of the
    module rebuilt from its graphdef, which ``nnx.jit`` writes back when the call returns: the
    hook removed from the original only would come back, and would still run in this call.
    """
    stack = _context.call_stack()
    seen: set[int] = set()
    for frame in stack:
        if id(frame.module) in seen or getattr(frame.adapter, "name", None) != "nnx":
            continue
        for _, m in frame.adapter.iter_modules(frame.module):
            if id(m) not in seen:
                seen.add(id(m))
                _drop(m, token, registered=False)


class HookHandle:
    """Removes the hooks one ``register_*`` call added. ``remove()`` is idempotent.

    Also a context manager: ``with hx.register_forward_hook(m, f): ...`` removes on exit.
    """

    def __init__(self, token: int, modules: list[Any]) -> None:
        self.id = token
        self._modules = [weakref.ref(m) for m in modules]

    def remove(self) -> None:
        """Remove the hooks from every module they were registered on (again: no-op)."""
        refs, self._modules = self._modules, []
        for ref in refs:
            module = ref()
            if module is not None:
                _drop(module, self.id)
        if refs:
            _publish()
            if _context.call_stack():
                _copies_in_call(self.id)

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"HookHandle(id={self.id}, modules={len(self._modules)})"


def _adapter(obj: Any, api: str) -> Any:
    adapter = _frameworks.adapter_for(obj)
    if _frameworks.is_haiku_model(obj):
        raise HookaxError(
            f"hx.{api} cannot store a hook on {type(obj).__name__}: Haiku modules are created "
            "anew by every init and apply, so hooks cannot live on them. Use the scoped form, "
            "which works on every framework and is cache-correct under jit: `with "
            "hx.hooks(where=..., forward=hook): y = transformed.apply(params, rng, x)` (where= "
            "selects the modules by their Haiku names: 'mlp/linear_0', a glob, a class, ...)."
        )
    if adapter is not None and getattr(adapter, "immutable", False):
        kind = {"linen": "Flax Linen", "equinox": "Equinox"}.get(adapter.name, adapter.name)
        raise HookaxError(
            f"hx.{api} cannot store a hook on {type(obj).__name__}: {kind} modules are "
            "immutable, so hooks cannot live on them. Use the scoped form, which works on every "
            "framework and is cache-correct under jit: `with hx.hooks(where=..., "
            "forward=hook): y = model(x)` (where= selects the modules: a class, a path glob, "
            "...)."
        )
    if adapter is None or adapter.name != "nnx":
        raise HookaxError(
            f"hx.{api} expects a Flax NNX module (an nnx.Module instance) to store the hook on, "
            f"got {type(obj).__name__}: {obj!r:.80}. Modules of frameworks whose modules are "
            "immutable (Equinox, Linen) and plain functions take hooks in the scoped form. Fix: "
            "`with hx.hooks(where=..., forward=hook): y = model(x)`."
        )
    return adapter


def _method_names(module: Any) -> list[str]:
    """The call sites of ``module``: its wrapped methods (``__call__`` and public ones)."""
    cls = type(module)
    return [
        n
        for n in dir(cls)
        if (n == "__call__" or not n.startswith("_")) and hasattr(getattr(cls, n, None), _MARK)
    ]


def _targets(
    module: Any, where: Any, api: str, adapter: Any
) -> list[tuple[Any, tuple[str, ...], frozenset[int] | None]]:
    """The (submodule, methods, scan iterations or None) a registration applies to."""
    if where is None:
        return [(module, CALL_ONLY, None)]
    sel = as_selector(where, CALL_ONLY)
    out = []
    for path, m in adapter.iter_modules(module):
        methods = []
        layers: frozenset[int] | None = None
        for name in _method_names(m):
            frame = _context.Frame(m, name, None, adapter)
            frame._path = path
            ctx = _context.Context(frame, getattr(m, name))
            if sel.matches(ctx):
                methods.append(name)
                layers = sel.layers(ctx) if sel.has_layers() else None
        if methods:
            out.append((m, tuple(methods), layers))
    if not out:
        found = ", ".join(
            f"{_context.path_str(p)!r} ({type(m).__name__})"
            for p, m in itertools.islice(adapter.iter_modules(module), 8)
        )
        raise SelectorError(
            f"hx.{api}(where={where!r}) matched no submodule of {type(module).__name__}; "
            f"its submodules (paths relative to it) include {found}. Fix: pass a where= that "
            'matches one of them, e.g. where=nnx.Linear or where="layers/*".'
        )
    return out


def _site(module: Any, targets: list[Any], adapter: Any) -> str:
    """The first call site a registration applies to, for messages: ``'layers/0' (Linear...)``."""
    m, methods, _ = targets[0]
    path = next((p for p, sub in adapter.iter_modules(module) if sub is m), ())
    more = f" and {len(targets) - 1} more" if len(targets) > 1 else ""
    return f"{_context.path_str(path)!r} ({type(m).__name__}.{methods[0]}){more}"


def _input_hook(fn: Callable[..., Any], with_kwargs: bool) -> Callable[..., Any]:
    """A forward hook at call sites' inputs (``where="blocks/1:in"``), run as a pre-hook: it
    gets the input (the one positional argument, or the tuple of them) as its ``output`` and
    may return a new one, of the same structure. A closure over ``fn``: equal hooks give equal
    records (and jit cache keys)."""

    def input_hook(module: Any, args: tuple, kwargs: Any = None) -> Any:
        value = args[0] if len(args) == 1 else args
        res = fn(module, args, kwargs, value) if with_kwargs else fn(module, args, value)
        if res is None:
            return None
        new = (res,) if len(args) == 1 else res
        if not isinstance(new, tuple) or len(new) != len(args):
            raise HookError(
                f"forward hook {getattr(fn, '__qualname__', fn)} at the input of "
                f"{type(module).__name__} (a 'key:in' where=) returned {type(res).__name__}, "
                f"not the {len(args)} positional arguments it was given. Fix: return a tuple "
                "of as many arrays, or None to keep them."
            )
        return (new, kwargs) if with_kwargs else new

    input_hook.__qualname__ = getattr(fn, "__qualname__", "input_hook")
    return input_hook


def _at_inputs(record: HookRecord, where: Any, api: str) -> list[tuple[HookRecord, Any]]:
    """``(record, where)`` pairs: ``record`` at the call sites ``where`` names, and, for its
    ``"key:in"`` entries, the record that runs at those call sites' inputs (a pre-hook: a
    forward hook there sees the input as its output, a pre-hook is one already)."""
    found = input_entries(where)
    if found is None:
        return [(record, where)]
    outs, ins = found
    if record.kind.startswith("backward"):
        raise SelectorError(
            f"hx.{api}(where={where!r}): a backward hook takes a call site, not its input: "
            f"the hook's grad_input is the gradient with respect to the input. Fix: "
            f"where={ins[0]!r}, and read grad_input."
        )
    at_input = record
    if record.kind == "forward":
        check_arity(record.fn, "forward", record.with_kwargs, api, f"the inputs of {ins!r}")
        at_input = dataclasses.replace(
            record, kind="forward_pre", fn=_input_hook(record.fn, record.with_kwargs)
        )
    pairs = [(at_input, ins if len(ins) > 1 else ins[0])]
    if outs:
        pairs.insert(0, (record, outs if len(outs) > 1 else outs[0]))
    return pairs


def _register(module: Any, record: HookRecord, where: Any, api: str) -> HookHandle:
    adapter = _adapter(module, api)
    if not callable(record.fn):
        raise HookaxError(
            f"hx.{api} expects a callable hook, got {record.fn!r} of type "
            f"{type(record.fn).__name__} to run at {type(module).__name__}.__call__. Fix: pass "
            "a function, e.g. `def hook(module, args, output): ...`."
        )
    pairs = _at_inputs(record, where, api)
    with _LOCK:  # finding the targets walks the modules' attributes, which _store changes
        plan = []  # every target checked before any is stored: an error leaves no hook behind
        for rec, at in pairs:
            targets = _targets(module, at, api, adapter)
            check_arity(rec.fn, rec.kind, rec.with_kwargs, api, _site(module, targets, adapter))
            for m, methods, layers in targets:
                if layers is not None and rec.kind.startswith("backward"):
                    raise SelectorError(
                        f"hx.{api}(where={where!r}): backward hooks of one layer of a scanned "
                        f"stack are not supported. Fix: read the gradient of that layer with "
                        f"hx.value_and_grad(loss_fn, where={where!r}), or hook every layer."
                    )
                plan.append((m, rec, methods, layers))
        token = next(_TOKENS)
        for m, rec, methods, layers in plan:
            rec = dataclasses.replace(rec, methods=methods, layers=layers, token=token)
            _store(m, (hook_set(m) or HookSet(())).add(rec))
        _publish()
    modules = list({id(m): m for m, _, _, _ in plan}.values())
    return HookHandle(token, modules)


def register_forward_pre_hook(
    module: Any,
    hook: Callable[..., Any],
    *,
    where: Where = None,
    with_kwargs: bool = False,
    prepend: bool = False,
) -> HookHandle:
    """Run ``hook`` before each call of ``module`` (PyTorch's ``register_forward_pre_hook``).

    ``hook(module, args) -> None | new_args``; a single value that is not a tuple means
    ``(value,)``. With ``with_kwargs=True``: ``hook(module, args, kwargs) -> None |
    (new_args, new_kwargs)``. Under jit, hooks run while tracing.

    Args:
      module: the NNX module to hook.
      hook: the hook.
      where: hook every submodule of ``module`` that matches instead (see ``hx.Select``).
      with_kwargs: pass and return keyword arguments too.
      prepend: run before the hooks already registered.

    Returns:
      A [`hx.HookHandle`][hookax.HookHandle]; ``remove()`` it, or use it as a context manager.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> with hx.register_forward_pre_hook(model, lambda m, args: args[0] * 0):
      ...     print(model(jnp.ones((1, 2))))
      [[0. 0. 0.]]
    """
    rec = HookRecord("forward_pre", hook, with_kwargs=with_kwargs, prepend=prepend)
    return _register(module, rec, where, "register_forward_pre_hook")


def register_forward_hook(
    module: Any,
    hook: Callable[..., Any],
    *,
    where: Where = None,
    with_kwargs: bool = False,
    always_call: bool = False,
    prepend: bool = False,
) -> HookHandle:
    """Run ``hook`` after each call of ``module`` (PyTorch's ``register_forward_hook``).

    ``hook(module, args, output) -> None | new_output``; with ``with_kwargs=True``:
    ``hook(module, args, kwargs, output)``. A new output may have another structure or shape, as
    in PyTorch. The forward hooks of a call are read after the method returns. With
    ``always_call=True`` the hook also runs, with ``output=None``, when a pre-hook or the method
    raised; the original exception then propagates.

    Args:
      module: the NNX module to hook.
      hook: the hook.
      where: hook every submodule of ``module`` that matches instead.
      with_kwargs: pass the keyword arguments too.
      always_call: also run when a pre-hook, the method or a forward hook raised.
      prepend: run before the hooks already registered.

    Returns:
      A [`hx.HookHandle`][hookax.HookHandle].

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs))
      >>> show = lambda m, a, out: print(out.shape)
      >>> h = hx.register_forward_hook(model, show, where=nnx.Linear)
      >>> _ = model(jnp.ones((4, 2)))
      (4, 3)
      (4, 1)
      >>> h.remove()
    """
    rec = HookRecord(
        "forward", hook, with_kwargs=with_kwargs, always_call=always_call, prepend=prepend
    )
    return _register(module, rec, where, "register_forward_hook")


def register_full_backward_pre_hook(
    module: Any, hook: Callable[..., Any], *, where: Where = None, prepend: bool = False
) -> HookHandle:
    """Run ``hook`` when JAX computes the gradient of ``module``'s output.

    ``hook(module, grad_output) -> None | new_grad_output``. As in PyTorch, ``grad_output`` is a
    tuple with one entry per output: an array output gives a 1-tuple, a tuple output its entries,
    any other pytree output a 1-tuple of the tree; an entry is None where there is no gradient (no
    float array, or an output that does not reach the loss). A replacement is a tuple like it (a
    None entry: zero) and is the gradient that flows on. The hook runs while JAX differentiates
    (``jax.grad``, ``nnx.grad``, ``jax.vjp``), so it must be JAX-traceable; print values with
    ``jax.debug.print``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
      >>> _ = hx.register_full_backward_pre_hook(model, lambda m, g: (g[0] * 3,))
      >>> dx = nnx.grad(lambda m, x: m(x).sum(), argnums=1)(model, jnp.ones((1, 1)))
      >>> dx / model.kernel[...]
      Array([[3.]], dtype=float32)
      >>> hx.remove_hooks(model)
    """
    rec = HookRecord("backward_pre", hook, prepend=prepend)
    return _register(module, rec, where, "register_full_backward_pre_hook")


def register_full_backward_hook(
    module: Any, hook: Callable[..., Any], *, where: Where = None, prepend: bool = False
) -> HookHandle:
    """Run ``hook`` when JAX computes the gradients of ``module``'s positional inputs.

    ``hook(module, grad_input, grad_output) -> None | new_grad_input``: as in PyTorch,
    ``grad_input`` is a tuple with one entry per positional argument (None for an argument with no
    float arrays, or not differentiated; zeros for one that is differentiated but does not reach the
    output) and ``grad_output`` the tuple of
    [`hx.register_full_backward_pre_hook`][hookax.register_full_backward_pre_hook]. A replacement is
    the gradient that flows on to the inputs; a None entry in it means a zero gradient. When no
    input is differentiated (the first layer, or gradients of the parameters only) the hook still
    runs, with ``grad_input`` all None, and must return None (or all None), as in PyTorch.
    JAX-traceable, like
    [`hx.register_full_backward_pre_hook`][hookax.register_full_backward_pre_hook].

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> h = hx.register_full_backward_hook(model, lambda m, gi, go: print(gi, go[0].shape))
      >>> _ = nnx.grad(lambda m, x: m(x).sum())(model, jnp.ones((3, 2)))  # parameters only
      (None,) (3, 1)
      >>> h.remove()
    """
    rec = HookRecord("backward", hook, prepend=prepend)
    return _register(module, rec, where, "register_full_backward_hook")


def remove_hooks(module: Any) -> None:
    """Remove every per-module hook from ``module`` and all its submodules."""
    adapter = _adapter(module, "remove_hooks")
    with _LOCK:
        for _, m in adapter.iter_modules(module):
            _store(m, None)
        _publish()


def hooks(
    where: Where = None,
    forward_pre: Callable[..., Any] | None = None,
    forward: Callable[..., Any] | None = None,
    backward_pre: Callable[..., Any] | None = None,
    backward: Callable[..., Any] | None = None,
    with_kwargs: bool = False,
    always_call: bool = False,
) -> contextlib.AbstractContextManager[None]:
    """Hooks on every selected call site, for a ``with`` block on this thread.

    Same signatures and semantics as the ``register_*`` functions (``forward_pre`` and ``forward``
    get keyword arguments when ``with_kwargs=True``; ``forward`` also runs when a pre-hook or the
    method raised when ``always_call=True``). At each call site scoped hooks run before the module's
    own hooks of the same kind, as PyTorch's global module hooks do; nested blocks run outermost
    first. Cache-correct under jit like [`hx.intercept`][hookax.intercept]: pass the same hook
    objects to hit the caches.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> with hx.hooks(forward=lambda m, args, out: jnp.zeros_like(out)):
      ...     print(model(jnp.ones((1, 2))))
      [[0. 0. 0.]]
    """
    given = {"forward_pre": forward_pre, "forward": forward, "backward_pre": backward_pre}
    given["backward"] = backward
    records = []
    for kind, fn in given.items():
        if fn is None:
            continue
        if not callable(fn):
            raise HookaxError(
                f"hx.hooks({kind}=...) expects a callable hook, got {fn!r}. Fix: pass a "
                "function, e.g. `def hook(module, args, output): ...`."
            )
        kw = with_kwargs and kind in ("forward_pre", "forward")
        check_arity(fn, kind, kw, "hooks", f"the call sites where={where!r} selects")
        always = always_call and kind == "forward"
        records.append(HookRecord(kind, fn, with_kwargs=kw, always_call=always))
        note_fresh(records[-1].key, "hx.hooks")
    if input_entries(where) is None:
        entry = Entry("hooks", tuple(records), as_selector(where, CALL_ONLY))
        return tracked(entry, "hx.hooks", where)
    # "key:in" entries: the records that run at those call sites' inputs, in a block of their own
    groups: dict[str, tuple[Any, Any, list[HookRecord]]] = {}
    for record in records:
        for rec, at in _at_inputs(record, where, "hooks"):
            shown = at if rec is record else _as_inputs(at)
            groups.setdefault(repr(at), (at, shown, []))[2].append(rec)
    entries = [
        (Entry("hooks", tuple(recs), as_selector(at, CALL_ONLY)), shown)
        for at, shown, recs in groups.values()
    ]
    return _blocks(entries)


def _as_inputs(at: Any) -> Any:
    """``where=`` of call sites as the ``"key:in"`` form the user wrote (for messages)."""
    return [f"{k}:in" for k in at] if isinstance(at, list) else f"{at}:in"


@contextlib.contextmanager
def _blocks(entries: list[tuple[Entry, Any]]) -> Iterator[None]:
    """The blocks of several entries (``hx.hooks`` with inputs and outputs), entered in order."""
    with contextlib.ExitStack() as stack:
        for entry, where in entries:
            stack.enter_context(tracked(entry, "hx.hooks", where))
        yield
