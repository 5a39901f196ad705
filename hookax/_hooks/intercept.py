"""``hx.intercept``: scoped method interceptors, cache-correct under jit."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .._engine import adapters as _frameworks
from .._engine import context as _context
from .._engine import eager as _eager
from .._engine.select import ALL_METHODS, Selector, Where, as_selector
from .._util.fnkey import FnKey, note_fresh
from .hookcheck import check_arity

__all__ = ["Entry", "Interceptor", "intercept", "scoped"]


class Interceptor(Protocol):
    """``interceptor(next_fun, args, kwargs, context) -> output`` (Linen's signature)."""

    def __call__(
        self,
        next_fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: _context.Context,
    ) -> Any: ...


class Entry:
    """One active scoped thing. Compared by value: it is part of the jit cache key.

    JAX hashes and compares the active entries on every jitted call and every eager operation,
    so the hash is computed once, and :func:`scoped` interns entries: entering a block again
    with an equal entry reuses the same object, and JAX's comparisons stop at identity.
    """

    __slots__ = ("__weakref__", "_hash", "key", "kind", "layered", "records", "selector")

    def __init__(self, kind: str, key: Any, selector: Selector) -> None:
        self.kind = kind
        self.key = key  # a FnKey for a function; for hooks, the tuple of hook records
        self.selector = selector
        self.layered = selector.has_layers()  # a path names layers of a scan: "blocks/attn[3]"
        self.records = getattr(key, "records_output", False)  # a capture's marker: outermost
        self._hash = hash((kind, key, selector))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Entry) or self._hash != other._hash:
            return False
        return (self.kind, self.key, self.selector) == (other.kind, other.key, other.selector)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Entry({self.kind!r}, {self.key!r}, {self.selector!r})"

    @property
    def fn(self) -> Any:
        return self.key.fn if isinstance(self.key, FnKey) else self.key


# hash -> weak reference: an entry stays interned while a block or one of JAX's cache keys holds
# it, no longer. (A hash collision just means the newer entry is not interned.)
_INTERNED: dict[int, weakref.ref[Entry]] = {}
_INTERN_LOCK = threading.RLock()  # re-entrant: a weakref callback may run inside _intern


def _intern(entry: Entry) -> Entry:
    h = entry._hash
    with _INTERN_LOCK:
        ref = _INTERNED.get(h)
        found = ref() if ref is not None else None
        if found is not None and found == entry:
            return found

        def forget(dead: weakref.ref[Entry]) -> None:
            with _INTERN_LOCK:
                if _INTERNED.get(h) is dead:
                    del _INTERNED[h]

        _INTERNED[h] = weakref.ref(entry, forget)
        return entry


@contextlib.contextmanager
def scoped(entry: Entry) -> Iterator[None]:
    """Make ``entry`` active on this thread for the block (innermost last)."""
    _frameworks.ensure_installed()
    _eager.install()
    with _context.ACTIVE((*_context.active_entries(), _intern(entry))):
        yield


class Tracker:
    """Which call sites ran while a user's ``intercept``/``hooks`` block was active, and whether
    its selector picked any: a ``where=`` that picks none of those that ran is an error."""

    __slots__ = ("matched", "seen")

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()
        self.matched = False

    def note(self, ctx: _context.Context, hit: bool) -> None:
        if hit:
            self.matched = True
        elif not self.matched:
            self.seen.add((ctx.key, ctx.path_str))


# Entries whose ``where=`` was checked in a block where it matched. A later block with an equal
# entry whose matching call sites ran only inside an already-compiled jitted function (the Python
# does not run on a cache hit) sees only the other call sites: it is not checked again. Weak: an
# entry no block or JAX cache key holds anymore cannot be hit in a cache.
_CHECKED: weakref.WeakSet[Entry] = weakref.WeakSet()


@contextlib.contextmanager
def tracked(entry: Entry, who: str, where: Any) -> Iterator[None]:
    """:func:`scoped`, raising ``SelectorError`` at the end of a block in which call sites ran
    but ``where=`` picked none of them. On a jit cache hit nothing runs; a block in which no call
    site ran says again the error of the last check of the same ``where=`` if it failed."""
    from .._engine.select import check_matched, forget_unmatched

    if where is None:  # every module: nothing to check (a block may run only other methods)
        with scoped(entry):
            yield
        return
    tracker = Tracker()
    entry = _intern(entry)
    mine = _context.trackers().setdefault(entry, [])
    mine.append(tracker)
    try:
        with scoped(entry):
            yield
    finally:
        mine.remove(tracker)
        if not mine:
            del _context.trackers()[entry]
    if tracker.matched:
        _CHECKED.add(entry)
        forget_unmatched(lambda: (who, repr(where), hash(entry)))
    elif entry not in _CHECKED:  # with nothing seen: says again what a cached trace hid
        check_matched(who, where, entry.selector, tracker, lambda: entry)


def intercept(
    interceptor: Interceptor, *, where: Where = None
) -> contextlib.AbstractContextManager:
    """Intercept module method calls in this thread for the duration of a ``with`` block.

    ``interceptor(next_fun, args, kwargs, context)`` runs instead of each selected method call;
    ``next_fun(*args, **kwargs)`` runs the rest of the chain (inner interceptors, hooks, the
    method). The first-entered interceptor is the outermost. Under ``jax.jit`` the interceptor
    runs while tracing; the active interceptors are part of the jit cache key, so a function
    traced inside the block is never reused outside it. The key is value-stable: the same
    interceptor, or a function re-created with the same code over the same closure objects
    (e.g. a lambda written inside a training step), hits every cache. A function closing over a
    new object or constant each call gets a new key, and so a new trace (and, in eager mode, a
    recompile of each operation): pass such values as arrays, or define the function once.

    Args:
      interceptor: the function to run around each selected call.
      where: which call sites; default every public method and ``__call__`` of every module.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> def show(next_fun, args, kwargs, context):
      ...     out = next_fun(*args, **kwargs)
      ...     print(type(context.module).__name__, context.method, out.shape)
      ...     return out
      >>> with hx.intercept(show):
      ...     _ = model(jnp.ones((4, 2)))
      Linear __call__ (4, 3)
    """
    if not callable(interceptor):
        from .._util.errors import HookaxError

        raise HookaxError(
            f"hx.intercept expects a callable interceptor(next_fun, args, kwargs, context), "
            f"got {interceptor!r} of type {type(interceptor).__name__}. Fix: "
            "`def interceptor(next_fun, args, kwargs, context): return next_fun(*args, **kwargs)`."
        )
    selector = as_selector(where, ALL_METHODS)
    check_arity(
        interceptor, "intercept", False, "intercept", f"the call sites where={where!r} selects"
    )
    key = FnKey(interceptor)
    note_fresh(key, "hx.intercept")
    return tracked(Entry("intercept", key, selector), "hx.intercept", where)
