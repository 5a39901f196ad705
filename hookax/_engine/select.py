"""Selectors: every ``where=`` form becomes one :class:`Selector`.

A selector decides whether a call site (a :class:`~hookax.Context`) is picked. Selectors are
immutable and compare by value, so the same ``where=`` always gives the same jit cache key.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, Union

from .._util.errors import SelectorError
from .context import path_str

if TYPE_CHECKING:
    from .context import Context

__all__ = ["Select", "Selector", "Where", "as_selector", "glob_to_regex"]

Where: TypeAlias = Union[  # Selector is defined below: the union names it as a string
    str,
    type,
    tuple[type, ...],
    "Selector",
    Callable[["Context"], bool],
    Sequence[Any],
    Any,
    None,
]
"""What every ``where=`` argument accepts (one grammar, on the page "Selecting call sites"):
``None`` (every module), a path glob (``"layers/*/attn"``, ``"blocks/mlp[3]"``,
``"encoder:encode"``), a class or a tuple of classes, an [`hx.Select`][hookax.Select] or any
[`hx.Selector`][hookax.Selector], a callable ``(ctx) -> bool``, a module instance, or a list of
these (their union). A module instance may be of any framework, so to a type checker this is
``Any``."""

ALL_METHODS = "*"
CALL_ONLY: tuple[str, ...] = ("__call__",)


class Selector:
    """Base class of selectors; combine them with ``&``, ``|`` and ``~``."""

    def matches(self, ctx: Context) -> bool:
        raise NotImplementedError

    def names_methods(self) -> bool:
        """Whether this selector says which methods it picks (else a default applies)."""
        return False

    def needs_path(self) -> bool:
        """Whether deciding needs the call site's path (which costs a walk of the model)."""
        return False

    def has_layers(self) -> bool:
        """Whether a path names layers of a scanned stack (``"blocks/attn[3]"``)."""
        return False

    def layers(self, ctx: Context) -> frozenset[int] | None:
        """For a call site this selector matches: the scan iterations it picks (None: all)."""
        return None

    def named_layers(self, ctx: Context) -> frozenset[int]:
        """The scan iterations that the layer suffixes matching this call site name, also where
        another pattern picks the whole call site (``["blocks", "blocks[1]"]``): a capture
        returns both keys."""
        return frozenset()

    def __and__(self, other: Any) -> Selector:
        return _And(self, _coerce(other))

    def __rand__(self, other: Any) -> Selector:
        return _And(_coerce(other), self)

    def __or__(self, other: Any) -> Selector:
        return _Or(self, _coerce(other))

    def __ror__(self, other: Any) -> Selector:
        return _Or(_coerce(other), self)

    def __invert__(self) -> Selector:
        return _Not(self)


@functools.lru_cache(maxsize=1024)
def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a path glob: ``*`` stays within one segment, ``**`` spans any number of them.

    Examples:
      >>> bool(glob_to_regex("**/mlp").fullmatch("mlp"))
      True
      >>> bool(glob_to_regex("layers/*/attn").fullmatch("layers/3/attn"))
      True
      >>> bool(glob_to_regex("layers/*").fullmatch("layers/3/attn"))
      False
      >>> bool(glob_to_regex("*").fullmatch(""))  # the root has no segment
      False
    """
    segs = pattern.split("/")
    out = ""
    for i, seg in enumerate(segs):
        if seg == "**":
            out += ".*" if len(segs) == 1 else "(?:[^/]+/)*" if i == 0 else "(?:/[^/]+)*"
            continue
        sep = "/" if i > 0 and not (i == 1 and segs[0] == "**") else ""
        body = "[^/]+" if seg == "*" else re.escape(seg).replace(r"\*", "[^/]*")
        out += sep + body
    return re.compile(out)


_GLOB_BAD = re.compile(r"[\[\]?{}!]|\*\*\*|\*\*[^/]|[^/]\*\*|//|^/|/$")


def check_glob(pattern: str) -> None:
    """Refuse a path glob hookax would read differently from what its author meant.

    Only ``*`` (within one segment) and ``**`` (a whole segment: any number of segments) are
    special; ``[``, ``?``, ``{`` and empty segments are mistakes (fnmatch or regex habits).

    Examples:
      >>> check_glob("layers/*/attn")
      >>> check_glob("layers/[")
      Traceback (most recent call last):
      ...
      hookax._util.errors.SelectorError: malformed path glob 'layers/[': ...
    """
    if pattern and _BARE_SUFFIX.search(pattern):
        raise _bare_suffix(pattern)
    if pattern and _GLOB_BAD.search(pattern):
        raise SelectorError(
            f"malformed path glob {pattern!r}: hookax globs use '/' between path segments, '*' "
            "for any part of one segment and '**' as a whole segment for any number of them; "
            "'[', ']', '?', '{', '}', '!', '***' and empty segments are not allowed (a layer "
            "suffix at the end, 'blocks/attn[3]', is the one use of brackets). Fix: e.g. "
            "'layers/*/attn', '**/mlp' or 'layers/0'."
        )


def _bare_suffix(pattern: str) -> SelectorError:
    return SelectorError(
        f"malformed path glob {pattern!r}: a layer suffix follows the path of a call site "
        "inside a scan, with no '/' before the bracket. Fix: name the call site first, "
        "e.g. 'blocks[1]', 'blocks/attn[1,3]', or '*[2:5]' for any top-level call site."
    )


# A layer suffix with no call site before it: ``"[1]"``, ``"blocks/[1,3]"``.
_BARE_SUFFIX = re.compile(r"(^|/)\[[^\[\]]*\]$")


_LAYERS = re.compile(r"^(.*[^\]])\[([^\[\]]*)\]$")


_KEY_METHOD = re.compile(r"^((?:[^:\[]|\[[^\]]*\])*)(?::(.*))?$", re.S)


def split_method(key: str) -> tuple[str, str]:
    """A key or pattern as ``(path, method)``, the colon inside a layer range kept in the path.

    Examples:
      >>> split_method("blocks/mlp[0:3]:encode"), split_method("blocks/mlp[1]")
      (('blocks/mlp[0:3]', 'encode'), ('blocks/mlp[1]', ''))
    """
    m = _KEY_METHOD.match(key)
    if m is None:  # an unbalanced '[': the glob check names it
        path, _, method = key.partition(":")
        return path, method
    return m.group(1), m.group(2) or ""


def split_layers(pattern: str) -> tuple[str, frozenset[int] | None]:
    """A path glob and the scan iterations its suffix names: ``"blocks/attn[3]"``,
    ``"blocks/attn[1,3]"``, ``"blocks/attn[2:5]"`` (a range, end excluded).

    Examples:
      >>> split_layers("blocks/attn[1, 4:6]")
      ('blocks/attn', frozenset({1, 4, 5}))
      >>> split_layers("layers/*/attn")
      ('layers/*/attn', None)
    """
    m = _LAYERS.match(pattern)
    if m is None:
        return pattern, None
    glob, spec = m.group(1), m.group(2)
    if glob.endswith("/"):
        raise _bare_suffix(pattern)
    picked: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        bounds = part.split(":")
        if not part or len(bounds) > 2 or not all(b.strip().isdigit() for b in bounds):
            raise SelectorError(
                f"malformed layer suffix in {pattern!r}: write one layer of a scanned stack as "
                "'blocks/attn[3]', several as 'blocks/attn[1,3]' or a range as 'blocks/attn[2:5]' "
                "(end excluded)."
            )
        lo = int(bounds[0])
        hi = int(bounds[1]) if len(bounds) == 2 else lo + 1
        picked |= set(range(lo, hi))
    if not picked:
        raise SelectorError(f"the layer suffix of {pattern!r} names no layer (an empty range).")
    return glob, frozenset(picked)


def _as_tuple(x: Any) -> tuple[Any, ...] | None:
    if x is None:
        return None
    return tuple(x) if isinstance(x, tuple | list) else (x,)


@dataclasses.dataclass(frozen=True)
class Select(Selector):
    """A selector by module type, path glob and method name; all given parts must match.

    Args:
      types: a class or tuple of classes; the module must be an instance of one.
      paths: a glob or tuple of globs over the path string (``"layers/*/attn"``, ``"**/mlp"``).
      methods: a method name, a tuple of names, or ``"*"`` for every public method and
        ``__call__``. Left out, the consumer's default applies (every method for
        [`hx.intercept`][hookax.intercept], ``__call__`` for hooks and capture).

    Examples:
      >>> import hookax as hx
      >>> sel = hx.Select(paths="layers/*") & ~hx.Select(paths="layers/0")
      >>> sel
      (Select(paths=('layers/*',)) & ~Select(paths=('layers/0',)))
    """

    types: Any = None
    paths: Any = None
    methods: Any = None
    # Set per instance in __post_init__: (glob, layers or None) per path. (Not a field.)
    _parsed: ClassVar[tuple[tuple[str, frozenset[int] | None], ...]] = ()

    def __post_init__(self) -> None:
        types, paths, methods = _as_tuple(self.types), _as_tuple(self.paths), self.methods
        if types is not None and not all(isinstance(t, type) for t in types):
            raise SelectorError(
                f"Select(types=...) takes a class or a tuple of classes, got {self.types!r}. "
                "Fix: pass the module classes themselves, e.g. Select(types=nnx.Linear)."
            )
        if paths is not None and not all(isinstance(p, str) for p in paths):
            raise SelectorError(
                f"Select(paths=...) takes a glob string or a tuple of them, got {self.paths!r}. "
                'Fix: Select(paths="layers/*/attn").'
            )
        parsed = tuple(split_layers(p) for p in paths or ())
        for glob, _ in parsed:
            check_glob(glob)
        object.__setattr__(self, "_parsed", parsed)
        if methods is not None and methods != ALL_METHODS:
            methods = _as_tuple(methods)
            if not all(isinstance(m, str) for m in methods or ()):
                raise SelectorError(
                    f"Select(methods=...) takes a method name, a tuple of names or '*', "
                    f"got {self.methods!r}. Fix: Select(methods=('__call__', 'encode'))."
                )
        object.__setattr__(self, "types", types)
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "methods", methods)

    def __repr__(self) -> str:
        parts = [f"{f}={getattr(self, f)!r}" for f in ("types", "paths", "methods")]
        return "Select(" + ", ".join(p for p in parts if not p.endswith("=None")) + ")"

    def matches(self, ctx: Context) -> bool:
        if self.methods is not None and not method_matches(self.methods, ctx.method):
            return False
        if self.types is not None and not isinstance(ctx.module, self.types):
            return False
        if self.paths is not None:
            s = ctx.path_str
            return any(glob_to_regex(g).fullmatch(s) for g, _ in self._parsed)
        return True

    def names_methods(self) -> bool:
        return self.methods is not None

    def needs_path(self) -> bool:
        return self.paths is not None

    def has_layers(self) -> bool:
        return any(layers is not None for _, layers in self._parsed)

    def layers(self, ctx: Context) -> frozenset[int] | None:
        s = ctx.path_str
        picked: frozenset[int] = frozenset()
        for glob, layers in self._parsed:
            if glob_to_regex(glob).fullmatch(s):
                if layers is None:
                    return None
                picked |= layers
        return picked if self._parsed else None

    def named_layers(self, ctx: Context) -> frozenset[int]:
        if not self.has_layers() or not self.matches(ctx):
            return frozenset()
        s = ctx.path_str
        picked: frozenset[int] = frozenset()
        for glob, layers in self._parsed:
            if layers is not None and glob_to_regex(glob).fullmatch(s):
                picked |= layers
        return picked


def method_matches(methods: tuple[str, ...] | str, method: str) -> bool:
    if methods == ALL_METHODS:
        return True
    return method in methods


@dataclasses.dataclass(frozen=True)
class _Predicate(Selector):
    fn: Callable[[Context], bool]

    def matches(self, ctx: Context) -> bool:
        return bool(self.fn(ctx))

    def needs_path(self) -> bool:
        return True  # a callable may read ctx.path

    def __repr__(self) -> str:
        return f"<predicate {getattr(self.fn, '__qualname__', self.fn)!r}>"


@dataclasses.dataclass(frozen=True)
class _And(Selector):
    a: Selector
    b: Selector

    def matches(self, ctx: Context) -> bool:
        return self.a.matches(ctx) and self.b.matches(ctx)

    def names_methods(self) -> bool:
        return self.a.names_methods() or self.b.names_methods()

    def needs_path(self) -> bool:
        return self.a.needs_path() or self.b.needs_path()

    def has_layers(self) -> bool:
        return self.a.has_layers() or self.b.has_layers()

    def layers(self, ctx: Context) -> frozenset[int] | None:
        a, b = self.a.layers(ctx), self.b.layers(ctx)
        return b if a is None else a if b is None else a & b

    def named_layers(self, ctx: Context) -> frozenset[int]:
        if not self.matches(ctx):
            return frozenset()
        return self.a.named_layers(ctx) | self.b.named_layers(ctx)

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


@dataclasses.dataclass(frozen=True)
class _Or(Selector):
    a: Selector
    b: Selector

    def matches(self, ctx: Context) -> bool:
        return self.a.matches(ctx) or self.b.matches(ctx)

    def names_methods(self) -> bool:
        return self.a.names_methods() or self.b.names_methods()

    def needs_path(self) -> bool:
        return self.a.needs_path() or self.b.needs_path()

    def has_layers(self) -> bool:
        return self.a.has_layers() or self.b.has_layers()

    def layers(self, ctx: Context) -> frozenset[int] | None:
        picked: frozenset[int] = frozenset()
        for sel in (self.a, self.b):
            if sel.matches(ctx):
                got = sel.layers(ctx)
                if got is None:
                    return None
                picked |= got
        return picked

    def named_layers(self, ctx: Context) -> frozenset[int]:
        return self.a.named_layers(ctx) | self.b.named_layers(ctx)

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


@dataclasses.dataclass(frozen=True)
class _Not(Selector):
    a: Selector

    def __post_init__(self) -> None:
        if self.a.has_layers():
            raise SelectorError(
                f"~{self.a!r}: a layer suffix cannot be negated (which layers a scan runs is "
                "known only when it runs). Fix: name the layers you want, e.g. 'blocks/mlp[0:3]'."
            )

    def matches(self, ctx: Context) -> bool:
        return not self.a.matches(ctx)

    def names_methods(self) -> bool:
        return self.a.names_methods()

    def needs_path(self) -> bool:
        return self.a.needs_path()

    def __repr__(self) -> str:
        return f"~{self.a!r}"


@dataclasses.dataclass(frozen=True)
class _WithMethods(Selector):
    """A selector plus the consumer's default methods (applied when it names none)."""

    inner: Selector | None
    methods: tuple[str, ...] | str

    def matches(self, ctx: Context) -> bool:
        if not method_matches(self.methods, ctx.method):
            return False
        return self.inner is None or self.inner.matches(ctx)

    def names_methods(self) -> bool:
        return True

    def needs_path(self) -> bool:
        return self.inner is not None and self.inner.needs_path()

    def has_layers(self) -> bool:
        return self.inner is not None and self.inner.has_layers()

    def layers(self, ctx: Context) -> frozenset[int] | None:
        return None if self.inner is None else self.inner.layers(ctx)

    def named_layers(self, ctx: Context) -> frozenset[int]:
        if self.inner is None or not method_matches(self.methods, ctx.method):
            return frozenset()
        return self.inner.named_layers(ctx)

    def __repr__(self) -> str:
        return f"{self.inner!r} (methods {self.methods!r})"


@dataclasses.dataclass(frozen=True, eq=False)
class _Instance(Selector):
    """One module instance (and the copies an NNX transform makes of it inside its body)."""

    module: Any

    def matches(self, ctx: Context) -> bool:
        adapter = ctx._frame.adapter
        aliases = getattr(adapter, "aliases", None)
        if aliases is None:
            return ctx.module is self.module
        return any(m is self.module for m in aliases(ctx.module))

    def __repr__(self) -> str:
        return f"<{type(self.module).__name__} instance at {id(self.module):#x}>"


def _is_module(obj: Any) -> bool:
    from . import adapters as frameworks

    return not isinstance(obj, type) and frameworks.adapter_for(obj) is not None


def _is_classes(where: Any) -> bool:
    return (
        isinstance(where, tuple | list) and bool(where) and all(isinstance(t, type) for t in where)
    )


def _union(items: list[Selector]) -> Selector:
    sel = items[0]
    for item in items[1:]:
        sel = _Or(sel, item)
    return sel


def _string(where: str) -> Selector:
    """A path glob, or ``"path:method"`` (``"encoder:encode"``, ``":encode"`` for the root)."""
    path, method = split_method(where)
    if not method:
        return Select(paths=where)
    return Select(paths=path, methods="*" if method == "*" else (method,))


def _coerce(where: Any) -> Selector:
    if isinstance(where, Selector):
        return where
    if isinstance(where, type) or _is_classes(where):
        return Select(types=tuple(where) if isinstance(where, list) else where)
    if isinstance(where, tuple | list):
        return _union(_items(where, _coerce))
    if _is_module(where):
        return _Instance(where)
    if isinstance(where, str):
        return _string(where)  # a key as hookax writes it: "attn:forward"
    if callable(where):
        return _Predicate(where)
    raise SelectorError(
        f"where= must be None, a class or tuple of classes, a path glob string, a callable "
        f"(ctx) -> bool, or hx.Select(...); got {where!r} of type {type(where).__name__}. "
        'Fix: e.g. where=nnx.Linear, where="layers/*/attn" or where=hx.Select(methods="encode"). '
        'A list of any of these is their union (where=["embed", "layers/*"]), and a string '
        'names a method other than __call__ after a colon ("encoder:encode").'
    )


def _items(where: tuple[Any, ...] | list[Any], coerce: Callable[[Any], Selector]) -> list[Selector]:
    if not where:
        raise SelectorError(
            f"where={where!r} is an empty list: it selects nothing. Fix: leave where= out for "
            'every module, or list patterns: where=["embed", "layers/*"].'
        )
    return [coerce(w) for w in where]


def input_entries(where: Any) -> tuple[list[Any], list[str]] | None:
    """``where=``'s entries as ``(those naming call sites, the call sites whose inputs the
    "key:in" ones name)``; None when no entry names an input.

    Examples:
      >>> input_entries(["blocks/0", "blocks/1:in"]), input_entries("blocks/*")
      ((['blocks/0'], ['blocks/1']), None)
    """
    entries = list(where) if isinstance(where, list | tuple) else [where]
    ins = [w[: -len(":in")] for w in entries if isinstance(w, str) and w.endswith(":in")]
    if not ins:
        return None
    return [w for w in entries if not (isinstance(w, str) and w.endswith(":in"))], ins


def as_selector(where: Any, default_methods: tuple[str, ...] | str) -> Selector:
    """Turn any ``where=`` form into a selector; the default methods apply unless it names some.

    A list (or a tuple that is not all classes) is the union of its entries, each with the
    default methods unless it names its own.

    Examples:
      >>> as_selector(None, ("__call__",))
      None (methods ('__call__',))
      >>> as_selector(["a", "b:encode"], ("__call__",))
      (Select(paths=('a',)) (methods ('__call__',)) | Select(paths=('b',), methods=('encode',)))
    """
    if where is None:
        return _WithMethods(None, default_methods)
    if isinstance(where, tuple | list) and not _is_classes(where):
        return _union(_items(where, lambda w: as_selector(w, default_methods)))
    sel = _coerce(where)
    if sel.names_methods():
        return sel
    return _WithMethods(sel, default_methods)


def _globs(sel: Any) -> list[str]:
    """The path globs a selector requires to match (not those under ``~``)."""
    if isinstance(sel, Select):
        return [g for g, _ in sel._parsed]
    if isinstance(sel, _And | _Or):
        return _globs(sel.a) + _globs(sel.b)
    if isinstance(sel, _WithMethods):
        return _globs(sel.inner)
    return []


def resolve_instances(where: Any, objs: Any) -> Any:
    """``where=`` with a module instance turned into its path below a module in ``objs``.

    Inside ``jax.jit`` a module passed as an argument is rebuilt, so identity cannot select it;
    its path can. An instance not found below ``objs`` stays an identity selector.
    """
    if isinstance(where, tuple | list):
        return type(where)(resolve_instances(w, objs) for w in where)
    if not _is_module(where):
        return where
    import jax

    from . import adapters as frameworks

    leaves = jax.tree.leaves(objs, is_leaf=_is_module)
    for leaf in leaves:
        adapter = frameworks.adapter_for(leaf)
        if adapter is None or not hasattr(adapter, "iter_modules"):
            continue
        for path, m in adapter.iter_modules(leaf):
            if m is where:
                return Select(types=type(where), paths=path_str(path) or "")
    return where


# (who, what was asked, a hash of who asked: the interceptor, the captured function) -> the
# message of a selection that matched nothing, for a later call that reuses the cached trace
# (where the Python that would see the call sites does not run). Hashes only: nothing is kept
# alive by it.
_UNMATCHED: dict[tuple[str, str, int], str] = {}
_UNMATCHED_LOCK = threading.Lock()


Key = tuple[str, str, int]


def remember_unmatched(key: Callable[[], Key], message: str) -> None:
    with _UNMATCHED_LOCK:
        if len(_UNMATCHED) >= 256:
            _UNMATCHED.pop(next(iter(_UNMATCHED)), None)
        _UNMATCHED[key()] = message


def repeat_unmatched(key: Callable[[], Key]) -> None:
    """Raise the remembered error of ``key()`` again, if its last check failed (``key`` is
    computed only when something is remembered: the common path costs one truth test)."""
    message = _UNMATCHED.get(key()) if _UNMATCHED else None
    if message is not None:
        raise SelectorError(
            message + " (Said again: no call site ran where hookax could see it, as when a "
            "jitted function reuses the trace in which this first failed.)"
        )


def forget_unmatched(key: Callable[[], Key]) -> None:
    if _UNMATCHED:
        with _UNMATCHED_LOCK:
            _UNMATCHED.pop(key(), None)


def check_matched(
    who: str,
    where: Any,
    selector: Selector,
    session: Any,
    asker: Callable[[], Any] = lambda: None,
) -> None:
    """Raise :class:`SelectorError` when ``where=`` selected nothing that ran, or a glob matched
    nothing, naming the nearest call sites that did run. ``asker()`` (hashable: the
    interceptor's entry, the captured function's key) tells apart what a cached trace's failure
    is said for."""
    seen = sorted(session.seen)

    def remembered() -> Key:
        return (who, repr(where), hash(asker()))

    if not session.matched and not getattr(session, "records", None):
        if not seen:
            if where is None:
                raise SelectorError(
                    f"{who}: no call site ran (the function calls no module of Flax NNX, Flax "
                    "Linen, Equinox or Haiku, and no program of JAX functions was traced), so "
                    f"there is nothing to capture. Fix: give {who} the model, or the function "
                    "that calls it, as its first argument."
                )
            # The Python did not run (a cached trace), or no module did. A trace in which this
            # where= matched nothing was reported when it traced; its caller may have caught
            # the error (a notebook cell run again): say it again.
            repeat_unmatched(remembered)
            return
        message = (
            f"{who}(where={where!r}) matched no call site; those that ran include "
            f"{_nearest(str(where), seen)}. Fix: pass a where= that matches one of them."
        )
        remember_unmatched(remembered, message)
        raise SelectorError(message)
    forget_unmatched(remembered)
    if not seen:
        return
    paths = {p for _, p in seen}
    for glob in _globs(selector):
        rx = glob_to_regex(glob)
        if not any(rx.fullmatch(p) for p in paths):
            raise SelectorError(
                f"{who}(where={where!r}): the path glob {glob!r} matched no call site; those "
                f"that ran include {_nearest(glob, seen)}. Fix: correct the path."
            )


def _nearest(target: str, seen: list[tuple[str, str]]) -> str:
    import difflib

    keys = [k for k, _ in seen]
    near = difflib.get_close_matches(target, keys, n=6, cutoff=0.0) or keys[:6]
    return ", ".join(repr(k) for k in near)
