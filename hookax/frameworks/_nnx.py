"""Flax NNX: wrap the methods of every ``nnx.Module`` subclass once; paths from the graph."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from flax import nnx
from flax.nnx import graphlib

from .._engine import context as _context
from .._engine import dispatch as _dispatch
from ._classwrap import MARK, install_on

__all__ = ["ADAPTER", "install", "wrap_class"]

wrap_class: Callable[[type], None]  # set by install()
_INTERNAL: tuple[type, ...] = ()  # NNX's own containers and wrappers: never call sites

_MARK = MARK
_active = _context._ACTIVE_VALUE
_hooked = _context.HOOKED
_HOOKS = "_hookax_hooks"  # where per-module hooks live (see _hooks.HookSet)
_call = _dispatch.call


class _Local(threading.local):
    def __init__(self) -> None:
        # id(inner module) -> (weakref to inner, outer): modules an NNX transform rebuilt inside
        # its body. Weak: an inner module holds the body's tracers, which must not outlive it.
        self.aliases: dict[int, tuple[Any, Any]] = {}
        # id(graphdef) -> (graphdef, module): what ``nnx.split`` split during the root's call, so
        # that ``nnx.merge`` of that graphdef (inside ``jax.checkpoint``, a ``lax.scan`` body)
        # builds copies that keep the paths of the modules they were split from. Strong
        # references: held only until the root's call returns.
        self.splits: dict[int, tuple[Any, Any]] = {}


class NNXAdapter:
    name = "nnx"

    def __reduce__(self) -> str:
        # By reference: the method wrappers hold the adapter, and cloudpickle pickles the
        # wrappers of a class defined in __main__ or in a function by value.
        return "ADAPTER"

    def __init__(self) -> None:
        self._local = _Local()

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, nnx.Module)

    def iter_modules(self, root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
        for path, node in graphlib.iter_graph(root):
            if isinstance(node, nnx.Module):
                yield tuple(path), node

    def aliases(self, module: Any) -> Iterator[Any]:
        table = self._local.aliases
        seen = 0
        while module is not None and seen < 64:
            yield module
            hit = table.get(id(module))
            module = hit[1] if hit is not None and hit[0]() is module else None
            seen += 1

    def record_aliases(self, ctx: Any) -> None:
        inner_refs = ctx.outer_index_inner_ref
        outer_refs = ctx.outer_index_outer_ref
        if not inner_refs or not outer_refs:
            return
        table = self._local.aliases
        for index, inner in inner_refs.items():
            outer = outer_refs.get(index)
            if outer is not None and outer is not inner and isinstance(inner, nnx.Module):
                table[id(inner)] = (weakref.ref(inner), outer)

    def record_split(self, graphdef: Any, node: Any) -> None:
        self._local.splits[id(graphdef)] = (graphdef, node)

    def record_merge(self, graphdef: Any, node: Any) -> None:
        """``node`` was merged from ``graphdef``: alias its modules to those it was split from."""
        hit = self._local.splits.get(id(graphdef))
        if hit is None or hit[0] is not graphdef:
            return
        outer = {tuple(p): m for p, m in self.iter_modules(hit[1])}
        table = self._local.aliases
        for path, inner in self.iter_modules(node):
            source = outer.get(path)
            if source is not None and source is not inner:
                table[id(inner)] = (weakref.ref(inner), source)

    def root_done(self) -> None:
        self._local.aliases.clear()
        self._local.splits.clear()


ADAPTER = NNXAdapter()


def _wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    adapter = ADAPTER

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _active.value and not _hooked and _HOOKS not in self.__dict__:
            return fn(self, *args, **kwargs)
        return _call(fn, name, self, args, kwargs, adapter)

    return wrapper


def _internal_classes() -> tuple[type, ...]:
    from flax.nnx.bridge import module as bridge_module
    from flax.nnx.transforms import transforms as nnx_transforms

    return (nnx.List, nnx.Dict, bridge_module.Module, nnx_transforms.LiftedModule)


def install() -> None:
    """Wrap every existing ``nnx.Module`` subclass and every one defined from now on."""
    global _INTERNAL, wrap_class
    _INTERNAL = _internal_classes()
    wrap_class = install_on(nnx.Module, _wrap, lambda cls: cls in _INTERNAL)

    update_ctx = graphlib.UpdateContext
    orig_unflatten_end = update_ctx.unflatten_end

    @functools.wraps(orig_unflatten_end)
    def unflatten_end(self: Any, index_ref: Any, inner_merge: bool) -> None:
        orig_unflatten_end(self, index_ref, inner_merge)
        if inner_merge and _context.call_stack():
            ADAPTER.record_aliases(self)

    update_ctx.unflatten_end = unflatten_end  # type: ignore[method-assign]
    _install_split_merge()


def _install_split_merge() -> None:
    """``nnx.split`` then ``nnx.merge`` during a call (the functional API inside a JAX transform:
    ``jax.checkpoint``, a ``lax.scan`` body): the merged copies keep the paths of the modules
    they were split from. ``split``/``merge`` call ``graphlib.flatten``/``unflatten`` by name;
    NNX's own transforms pass ``ref_index``/``index_ref`` and are aliased by ``unflatten_end``."""
    orig_flatten, orig_unflatten = graphlib.flatten, graphlib.unflatten

    @functools.wraps(orig_flatten)
    def flatten(node: Any, /, **kwargs: Any) -> Any:
        out = orig_flatten(node, **kwargs)
        if _context.call_stack() and kwargs.get("ref_index") is None:
            ADAPTER.record_split(out[0], node)
        return out

    @functools.wraps(orig_unflatten)
    def unflatten(graphdef: Any, state: Any, /, **kwargs: Any) -> Any:
        node = orig_unflatten(graphdef, state, **kwargs)
        if _context.call_stack() and kwargs.get("index_ref") is None:
            ADAPTER.record_merge(graphdef, node)
        return node

    graphlib.flatten = flatten
    graphlib.unflatten = unflatten
