"""Helpers shared by the reliability tests: the "nothing left behind" check."""

from __future__ import annotations

from typing import Any

from flax import nnx

from hookax._engine import context as _context
from hookax._hooks import hooks as _hooks
from hookax._transforms import tags as _tags


def assert_clean(*models: Any) -> None:
    """Nothing active, no call or capture in progress, no hook on any module of ``models``."""
    assert _context.active_entries() == ()
    assert _context.call_stack() == []
    assert _tags.depth() == 0
    for model in models:
        for path, m in nnx.graph.iter_graph(model):
            if isinstance(m, nnx.Module):
                assert _hooks.hook_set(m) is None, path
                assert not any(k.startswith("__hookax") for k in vars(m)), path


def hook_sets(model: Any) -> dict[tuple[Any, ...], Any]:
    """``{path: HookSet}`` of every hooked module below ``model``."""
    return {
        p: _hooks.hook_set(m)
        for p, m in nnx.graph.iter_graph(model)
        if isinstance(m, nnx.Module) and _hooks.hook_set(m) is not None
    }
