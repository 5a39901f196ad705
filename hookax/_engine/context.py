"""Call-site context, the per-thread call stack, and the jit-cache-keyed set of active scopes.

Two pieces of state exist, both per thread:

* ``ACTIVE``: a :func:`jax.make_user_context` whose value is a tuple of the active scoped entries
  (interceptors, scoped hooks, captures). Its value is part of every jit cache key, so a function
  traced with one set of entries is never reused with another. Entries compare by value, so
  entering a block again with the same objects hits every cache.
* the call stack of module method calls in progress, used to find the root and the paths of call
  sites, and to see a ``super().__call__`` as the same call site.
"""

from __future__ import annotations

import copyreg
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .._util.jaxcompat import core as _jax_core
from .._util.words import counted
from .plugins import Slot

__all__ = ["ACTIVE", "Context", "Frame", "active_entries", "call_stack", "path_str"]

ACTIVE = jax.make_user_context(())
_ACTIVE_VALUE = ACTIVE._obj  # the C++ config object: reading `.value` here is the fast path


def _active_value() -> Any:
    """``_ACTIVE_VALUE``, for unpickling: see :func:`_reduce_config`."""
    return _ACTIVE_VALUE


def _reduce_config(obj: Any) -> Any:
    """Pickle ``_ACTIVE_VALUE`` by reference; refuse every other object of its type as before.

    The method wrappers read ``_ACTIVE_VALUE`` as a global. cloudpickle pickles the methods of
    a class defined in ``__main__`` or in a function by value, with the globals they read: this
    makes the wrapper in the copy read this process's (or the loading process's) object.
    """
    if obj is _ACTIVE_VALUE:
        return (_active_value, ())
    raise TypeError(f"cannot pickle {type(obj).__name__!r} object")


copyreg.pickle(type(_ACTIVE_VALUE), _reduce_config)


class _ByName(dict):
    """A dict pickled by reference, as the module global ``HOOKED`` (see :func:`_reduce_config`)."""

    def __reduce__(self) -> str:
        return "HOOKED"


# Modules that hold per-module hooks, by id (dropped when hooks are removed or the module dies).
# While any exist, every module call takes the slow path, so the call stack knows the root and
# hooked call sites get their full path. (The wrappers also check each instance itself, so a
# copy made by nnx.merge that carries hooks always runs them.)
HOOKED: dict[int, Any] = _ByName()


def _forget(table: dict[int, Any], key: int, ref: Any) -> None:
    """A hooked module died: drop its entry. Reads no global (it may run at interpreter exit,
    after this module's globals are cleared)."""
    if table.get(key) is ref:
        del table[key]


def track_hooked(module: Any, hooked: bool) -> None:
    key = id(module)
    if not hooked:
        HOOKED.pop(key, None)
    elif key not in HOOKED:
        HOOKED[key] = weakref.ref(module, functools.partial(_forget, HOOKED, key))


# The registered hooks, as part of every jit cache key. A per-module hook lives in the module's
# graphdef, which a jitted function sees only when the module is one of its arguments; a closure
# (``jax.jit(lambda x: model(x))``) would reuse the trace it made before a hook was registered.
# So registering or removing a hook publishes a key of every module's hooks, compared by value
# (the same hooks on the same modules give an equal key, so nothing else retraces: JAX's eager
# per-operation dispatch is keyed the same way), and with no hooks left the key is the default
# again. The key holds modules and hook sets weakly: JAX's caches keep it, and a removed hook's
# closure must not live on in them. A hook set that died equals nothing (a reused id never hits).
REGISTERED = jax.make_user_context(None)
_REGISTRY: dict[int, _Held] = {}
_REGISTRY_LOCK = threading.RLock()
_INTERNED: dict[int, weakref.ref[_Registry]] = {}


class _Held:
    """One hooked module in the registry key: equal to another while both name the same live
    module with hook sets that are alive and equal."""

    __slots__ = ("__weakref__", "_hash", "hooks", "module")

    def __init__(self, module: Any, hooks: Any) -> None:
        self.module = weakref.ref(module)
        self.hooks = weakref.ref(hooks)
        self._hash = hash((id(module), hooks))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Held) or self._hash != other._hash:
            return False
        m, hooks = self.module(), self.hooks()
        if m is None or hooks is None or other.module() is not m:
            return False
        theirs = other.hooks()
        return theirs is hooks or (theirs is not None and theirs == hooks)

    def __hash__(self) -> int:
        return self._hash


class _Registry:
    """The registry key's value: a frozenset of :class:`_Held`, hashed once, interned."""

    __slots__ = ("__weakref__", "_hash", "held")

    def __init__(self, held: frozenset[_Held]) -> None:
        self.held = held
        self._hash = hash(held)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Registry) or self._hash != other._hash:
            return False
        return self.held == other.held

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"<hookax: hooks registered on {counted(len(self.held), 'module')}>"


def set_registered(module: Any, hooks: Any) -> None:
    """Record ``module``'s hooks (None: none) for the registry key; see :func:`publish`."""
    with _REGISTRY_LOCK:
        if hooks is None:
            _REGISTRY.pop(id(module), None)
        else:
            _REGISTRY[id(module)] = _Held(module, hooks)


def publish() -> None:
    """Make the registered hooks the registry key's value (once per register or remove)."""
    with _REGISTRY_LOCK:
        for k in [k for k, h in _REGISTRY.items() if h.module() is None or h.hooks() is None]:
            del _REGISTRY[k]  # modules that died
        live = frozenset(_REGISTRY.values())
        value: _Registry | None = None
        if live:
            value = _Registry(live)
            ref = _INTERNED.get(value._hash)
            found = ref() if ref is not None else None
            if found is not None and found == value:
                value = found
            else:
                if len(_INTERNED) > 256:
                    for k in [k for k, r in _INTERNED.items() if r() is None]:
                        del _INTERNED[k]
                _INTERNED[value._hash] = weakref.ref(value)
        if REGISTERED.get_global() is not value:
            REGISTERED.set_global(value)


def active_entries() -> tuple[Any, ...]:
    """The scoped entries active on this thread, outermost first."""
    return _ACTIVE_VALUE.value


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[Frame] = []
        self.trackers: dict[Any, list[Any]] = {}  # entry -> its _intercept.Tracker(s)


_LOCAL = _Local()


def trackers() -> dict[Any, list[Any]]:
    """The ``where=`` trackers of the user's ``intercept``/``hooks`` blocks on this thread."""
    return _LOCAL.trackers


def note_match(entry: Any, ctx: Context, hit: bool) -> None:
    """Tell the trackers of ``entry`` whether its selector picked the call site ``ctx``."""
    for tracker in _LOCAL.trackers.get(entry, ()):
        tracker.note(ctx, hit)


def call_stack() -> list[Frame]:
    """The module method calls in progress on this thread, outermost first."""
    return _LOCAL.stack


def path_str(path: tuple[Any, ...]) -> str:
    """The string form of a path: keys joined with ``/``.

    Examples:
      >>> path_str(("layers", 0, "attn"))
      'layers/0/attn'
    """
    return "/".join(str(k) for k in path)


def current_trace() -> Any:
    """JAX's current trace (the innermost transform being traced, or the eager one)."""
    return _jax_core.trace_ctx.trace


# What JAX's traces of a scan body say they are traced for (``fori_loop`` with static bounds is
# a scan; with traced bounds a while loop, whose lowering then reports the layer as unsupported).
# "flax scan": Linen's nn.scan traces its body once to find the broadcast outputs (newer Flax)
_SCAN_BODIES = frozenset({"scan", "fori_loop", "flax scan"})


def _in_linen_scan_prepass() -> bool:
    """Whether Linen's ``nn.scan`` is running its body under partial evaluation (a first pass
    that finds the broadcast outputs; the scan itself follows)."""
    import sys

    f: Any = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_name == "scan_fn" and code.co_filename.endswith("axes_scan.py"):
            return True
        f = f.f_back
    return False


def vmaps_between(trace: Any, stop: Any) -> list[Any]:
    """The ``jax.vmap`` traces (``BatchTrace``) from ``stop`` (excluded) down to ``trace``,
    outermost first: the vmaps a value made outside ``stop`` is batched by in ``trace``."""
    found = []
    t = trace
    while t is not None and t is not stop:
        if type(t).__name__ == "BatchTrace":
            found.append(t)
        t = _parent(t)
    return found[::-1]


def _parent(trace: Any) -> Any:
    """The trace ``trace`` was entered in: JAX's ``parent_trace``, or the ``parent`` of
    hookax's forwarding traces (capture's, an operation walker's)."""
    parent = getattr(trace, "parent_trace", None)
    return parent if parent is not None else getattr(trace, "parent", None)


LAYER_OF: Slot[Callable[[Frame], Any]] = Slot(
    "layer_of",
    lambda frame: None,
    "layer_of(frame) -> traced int | None: the scan iteration a call site runs in "
    "(hx.Context.layer).",
)


class Frame:
    """One call site in progress: a module, a method name, and how to find its path."""

    __slots__ = (
        "_bridged",
        "_path",
        "_paths",
        "adapter",
        "args",
        "context",
        "layer",
        "method",
        "module",
        "outer_trace",
        "parent",
        "scanned",
        "trace",
    )

    def __init__(self, module: Any, method: str, parent: Frame | None, adapter: Any) -> None:
        self.module = module
        self.method = method
        self.parent = parent
        self.adapter = adapter
        self._path: tuple[Any, ...] | None = None
        self._paths: dict[int, tuple[tuple[Any, ...], Any]] | None = None
        # A root of its own framework below a call of another's (an NNX module that Flax's
        # ToLinen bridge builds per call): its path is that call's, its modules' are below it.
        self._bridged = False
        # The call site's Context; set by the dispatcher whenever any scoped entry is active.
        self.context: Context | None = None
        # The call's (args, kwargs), and its layer index once asked (see Context.layer).
        self.args: Any = None
        self.layer: Any = None
        # The root's: the JAX trace its call started in (a scan entered below it runs layers).
        self.trace: Any = current_trace()  # the JAX trace the call started in
        self.outer_trace: Any = None
        if parent is None:
            # A framework whose calls run inside a transform of their own (Haiku's ``apply``)
            # gives the trace that transform started in: scans entered there are the root's.
            outer = getattr(adapter, "outer_trace", None)
            self.outer_trace = (outer() if outer is not None else None) or self.trace
        # Whether the call runs inside a scan, once pinned (see pin_scan).
        self.scanned: bool | None = None

    def pin_scan(self) -> None:
        """Decide :meth:`in_scan` now, at the call's own trace, for questions asked later from
        traces nested below it: an operation's value is seen inside the re-traced body of an
        inlined ``jax.numpy`` function, a trace with no link to the scan the call runs in."""
        if self.scanned is None:
            self.scanned = self.in_scan()

    def in_scan(self) -> bool:
        """Whether this call runs inside a ``lax.scan`` entered within the root's call."""
        if self.scanned is not None:
            return self.scanned
        root = self
        while root.parent is not None:
            root = root.parent
        stop = root.outer_trace
        t = current_trace()
        while t is not None and t is not stop:
            info = getattr(getattr(t, "frame", None), "debug_info", None)
            if getattr(info, "traced_for", None) in _SCAN_BODIES:
                return True
            if type(t).__name__ == "JaxprTrace" and _in_linen_scan_prepass():
                return True
            t = _parent(t)
        return False

    def _roots(self) -> Iterator[Frame]:
        """Frames whose module is a root for path lookups: innermost local root first."""
        f = self.parent
        while f is not None:
            if f.path == () or f._bridged:
                yield f
            f = f.parent

    def _lookup(self, module: Any) -> tuple[Any, ...] | None:
        relative = getattr(self.adapter, "relative_path", None)
        if relative is not None:  # frameworks whose modules know their own path (Linen)
            return relative(self.module, module)
        if self._paths is None:
            self._paths = {id(m): (p, m) for p, m in self.adapter.iter_modules(self.module)}
        for m in self.adapter.aliases(module):
            hit = self._paths.get(id(m))
            if hit is not None and hit[1] is m:
                return hit[0]
        return None

    @property
    def path(self) -> tuple[Any, ...]:
        if self._path is None:
            own = getattr(self.adapter, "own_path", None)
            if own is not None:  # modules that know their whole path (Haiku's module names)
                self._path = own(self.module)
                return self._path
            if self.parent is None:
                self._path = ()
                return ()
            path: tuple[Any, ...] | None = None
            for root in self._roots():
                path = root._lookup(self.module)
                if path is not None:
                    path = root.path + path
                    break
            if path is None:
                path = self._rebuilt_path()
            if path is None:
                path = self._bridged_path()
            if path is None:
                path = self._built_path()
            # Not reachable from any root in progress: this module is a root of its own.
            self._path = () if path is None else path
        return self._path

    def _bridged_path(self) -> tuple[Any, ...] | None:
        """The path of a root of its own framework called inside a call of another framework's
        module (Flax's ``nnx.bridge.ToLinen`` builds and calls an NNX module inside a Linen
        call): that call's path, its own modules below it."""
        f = self.parent
        while f is not None and f.adapter is self.adapter:
            f = f.parent
        if f is None or f.path == ():
            return None
        self._bridged = True
        return f.path

    def _built_path(self) -> tuple[Any, ...] | None:
        """The path of a module no root holds, called inside a call of its own framework's
        module (Haliax's ``hnn.Linear`` builds a ``DefaultDotGeneralOp`` on every call): below
        that call, named by its class; never the root's path."""
        f = self.parent
        while f is not None and f.adapter is not self.adapter:
            f = f.parent
        if f is None:
            return None
        return (*f.path, type(self.module).__name__)

    def bridged(self) -> bool:
        """Whether this call runs below a bridged root (modules rebuilt on every call)."""
        f: Frame | None = self
        while f is not None:
            if f._bridged:
                return True
            f = f.parent
        return False

    def _rebuilt_path(self) -> tuple[Any, ...] | None:
        """The path of a module that a JAX transform rebuilt from a module of the model (an
        Equinox module passed as ``lax.scan`` xs): below a caller that holds it, else the one
        module of the model it was rebuilt from (the adapter's ``rebuilt_from``)."""
        near: tuple[Any, ...] = ()
        f = self.parent
        while f is not None:
            if f.path != () and f.adapter is self.adapter:
                rel = f._lookup(self.module)  # a child of a rebuilt module: below its caller
                if rel is not None:
                    return f.path + rel
                near = near or f.path
            f = f.parent
        rebuilt_from = getattr(self.adapter, "rebuilt_from", None)
        if rebuilt_from is None:
            return None
        for root in self._roots():
            if root.adapter is self.adapter and root._paths is not None:
                path = rebuilt_from(self.module, list(root._paths.values()), near)
                if path is not None:
                    return path
        return None

    @property
    def key(self) -> str:
        s = path_str(self.path)
        return s if self.method == "__call__" else f"{s}:{self.method}"


class Context:
    """What an interceptor or selector knows about one call site. Immutable.

    Attributes:
      module: the module whose method is called.
      method: the method's name (``"__call__"``, ``"encode"``, ...).
      path: the tuple of keys from the root module (the outermost module whose method call is
        in progress) to ``module``; the root's path is ``()``.
      key: the call site's key: the path string, plus ``":" + method`` unless ``__call__``.
      orig_method: the method, bound to ``module``; calling it skips the interceptors that
        remain (the module's own hooks still run).
    """

    __slots__ = ("_frame", "orig_method")

    _frame: Frame
    orig_method: Callable[..., Any]

    def __init__(self, frame: Frame, orig_method: Callable[..., Any]) -> None:
        object.__setattr__(self, "_frame", frame)
        object.__setattr__(self, "orig_method", orig_method)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"hx.Context is immutable; cannot set {name!r}")

    @property
    def module(self) -> Any:
        return self._frame.module

    @property
    def method(self) -> str:
        return self._frame.method

    @property
    def path(self) -> tuple[Any, ...]:
        return self._frame.path

    @property
    def path_str(self) -> str:
        return path_str(self._frame.path)

    @property
    def key(self) -> str:
        return self._frame.key

    @property
    def layer(self) -> Any:
        """The iteration of the scan this call site runs in (one layer of a scanned stack), as a
        traced ``int32`` scalar; ``None`` when the call site is not inside a ``lax.scan``
        (``nnx.scan``, ``nn.scan``) entered within the model's call."""
        return LAYER_OF.fn(self._frame)

    def __repr__(self) -> str:
        return (
            f"Context(key={self.key!r}, module={type(self.module).__name__}, "
            f"method={self.method!r})"
        )
