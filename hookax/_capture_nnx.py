"""Flax NNX storage for captured values recorded inside NNX transforms.

A value recorded inside ``nnx.scan``/``nnx.vmap``/``nnx.remat``/``nnx.jit`` belongs to that
transform's trace and must leave it the way module state does. As ``nnx.capture`` does, each
module reachable from the captured function's arguments gets a data attribute holding a Variable
before the function runs; values recorded inside a transform go into the (transform's copy of the)
module's Variable, which NNX carries out of the transform (stacked along the scan or batch axis),
and are read back from the outer module when the function returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flax import errors as flax_errors
from flax import nnx
from flax.nnx import graphlib

from .frameworks import _nnx

__all__ = ["Captured", "attach", "detach", "find_modules", "write"]


class Captured(nnx.Intermediate):
    """The Variable type holding values hookax captured: ``{call-site key: (value, ...)}``.

    A subclass of :class:`nnx.Intermediate`, so transform filters written for NNX's own captures
    (``nnx.StateAxes({nnx.Intermediate: 0, ...})``) also route it.
    """


def find_modules(objs: Any) -> Iterator[Any]:
    """Every NNX module reachable from ``objs`` (pytrees, modules and their submodules)."""
    import jax

    internal = _nnx._INTERNAL
    seen: set[int] = set()
    for leaf in jax.tree.leaves(objs, is_leaf=lambda x: isinstance(x, nnx.Module)):
        if not isinstance(leaf, nnx.Module):
            continue
        for _, node in graphlib.iter_graph(leaf):
            if (
                isinstance(node, nnx.Module)
                and not isinstance(node, internal)
                and id(node) not in seen
            ):
                seen.add(id(node))
                yield node


def attach(modules: Iterator[Any], attr: str) -> list[tuple[Any, Any]]:
    """Give each module an empty :class:`Captured` Variable under ``attr``.

    Modules that cannot be changed from the current trace (created outside a ``jax.jit`` that
    closes over them) are skipped: values recorded inside transforms are then refused by
    :func:`write`.
    """
    attached = []
    for m in modules:
        if attr in vars(m):
            continue
        var = Captured({})
        try:
            setattr(m, attr, nnx.data(var))
        except flax_errors.TraceContextError:
            continue
        attached.append((m, var))
    return attached


def detach(attached: list[tuple[Any, Any]], attr: str) -> list[dict[str, tuple[Any, ...]]]:
    """Remove the attributes; return each outer Variable's final ``{key: values}``."""
    out = []
    for m, _ in attached:
        var = vars(m).get(attr)
        if var is not None:
            out.append(dict(var.get_value()))
            delattr(m, attr)
    return out


def write(module: Any, attr: str, key: str, value: Any) -> int | None:
    """Append ``value`` to ``module``'s capture Variable under ``key``; its index, or None.

    None means this module carries no capture Variable this trace may change.
    """
    var = vars(module).get(attr)
    if not isinstance(var, Captured):
        return None
    try:
        d = var.get_value()
        prev = d.get(key, ())
        var.set_value({**d, key: (*prev, value)})
    except flax_errors.TraceContextError:
        return None
    return len(prev)
