"""The registry of framework adapters: how each framework's modules become call sites.

An adapter is loaded the first time hookax is used while its framework is imported, so
``import hookax`` imports no framework. Each adapter provides:

* ``install()``: make every module class's methods interceptable (once, never undone);
* ``iter_modules(root)``: ``(path, module)`` pairs below ``root``;
* ``aliases(module)``: ``module`` and the outer modules it stands for inside transforms;
* ``root_done()``: called when the outermost call site on this thread returns.

Optional: ``relative_path(root, module)`` (a path without walking the model, where modules know
their own: Linen), ``own_path(module)`` (the whole path, whatever the root: Haiku, whose
outermost module is keyed by its name, not ``""``), ``outer_trace()`` (the JAX trace a root's
model call started in, where that is before the root's own call: Haiku's ``apply``) and
``immutable`` (modules take only scoped hooks: Linen, Equinox, Haiku).

Adapters install when hookax is first used, or at ``import hookax`` for frameworks imported
before it; Linen's also right after ``flax.linen`` is imported when hookax came first (an import
hook), so what hookax does to ``nn.intercept_methods`` does not depend on import order.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

__all__ = [
    "StaleTraceWarning",
    "adapter_for",
    "ensure_installed",
    "haiku_transform_given",
    "installed",
    "is_haiku_model",
    "is_linen",
    "key_linen_interceptors",
    "linen_needs_variables",
    "note_haiku_outside_transform",
    "unbound_linen",
]

_LOCK = threading.RLock()  # re-entrant: installing one adapter may import another's framework
_INSTALLED: dict[str, Any] = {}


# adapter name -> (the framework's module that must be imported, its adapter in hookax.frameworks)
_FRAMEWORKS: tuple[tuple[str, str, str], ...] = (
    ("nnx", "flax.nnx", "_nnx"),
    ("linen", "flax.linen", "_linen"),
    ("equinox", "equinox", "_equinox"),
    ("haiku", "haiku", "_haiku"),
    # Programs without modules: their functions' calls and named scopes (jax is always there).
    ("functions", "jax", "_functions"),
)


def ensure_installed(only: str | None = None) -> None:
    """Install the adapter of every supported framework that is imported (cheap when done).

    ``only`` names one adapter (``"linen"``) to install, if its framework is imported.
    """
    if len(_INSTALLED) == len(_FRAMEWORKS):
        return
    for name, framework, module in _FRAMEWORKS:
        if only not in (None, name) or name in _INSTALLED or framework not in sys.modules:
            continue
        with _LOCK:
            if name not in _INSTALLED:
                import importlib

                adapter = importlib.import_module(f"hookax.frameworks.{module}")
                if not hasattr(adapter, "install"):
                    # Still being imported (importing its framework ran the import hook):
                    # installed by the next call.
                    continue
                adapter.install()
                _INSTALLED[name] = adapter.ADAPTER


def installed() -> dict[str, Any]:
    return _INSTALLED


def adapter_for(obj: Any) -> Any | None:
    """The adapter whose framework ``obj`` is a module of, or None."""
    ensure_installed()
    for adapter in _INSTALLED.values():
        if adapter.is_module(obj):
            return adapter
    return None


# ---------------------------------------------------------------------------------------------
# Linen modules without their variables: one message, wherever hookax is given one.

# How each API runs a Linen model with its variables: bound, or through ``model.apply``.
_LINEN_FIX = {
    "hx.capture": "bind them: hx.capture(model.bind(variables))(x), or pass them: "
    "hx.capture(model.apply)(variables, x)",
    "hx.ops": "bind them: hx.ops(model.bind(variables), x), or pass them: "
    "hx.ops(model.apply, variables, x)",
    "hx.value_and_grad": "pass them, and bind them inside the loss: hx.value_and_grad(lambda "
    "variables, x: loss_fn(model.bind(variables), x))(variables, x)",
    "gradient flow": "bind them: hx.grad_flow(model.bind(variables), x)",
}


def linen_needs_variables(who: str, module: Any) -> Exception:
    """The error for a Linen module given to ``who`` without its variables (unbound, or as an
    argument to differentiate): how to bind it or pass its variables."""
    from .._util.errors import HookaxError

    fix = _LINEN_FIX.get(who, f"bind them: {who}(model.bind(variables), ...)")
    return HookaxError(
        f"{who} of a Linen {type(module).__name__} needs its variables. Fix: {fix}, with "
        "variables = model.init(key, x)."
    )


def unbound_linen(objs: Any) -> Any | None:
    """The first unbound Linen module among ``objs`` (an iterable), or None."""
    nn = sys.modules.get("flax.linen")
    if nn is None:
        return None
    for obj in objs:
        if isinstance(obj, nn.Module) and obj.scope is None:
            return obj
    return None


def is_haiku_model(obj: Any) -> bool:
    """A Haiku module, or what ``hk.transform(_with_state)`` returns, or its ``init``/``apply``."""
    hk = sys.modules.get("haiku")
    if hk is None:
        return False
    if isinstance(obj, hk.Module | hk.Transformed | hk.TransformedWithState):
        return True
    # Haiku's init and apply functions carry their transformed function; looked up in the
    # function's own attributes (an object answering every attribute, like nnx.Rngs, is none).
    return isinstance(obj, types.FunctionType) and "_original_fn" in vars(obj)


def haiku_transform_given(who: str, obj: Any) -> Exception | None:
    """The error for what ``hk.transform`` returns given to ``who`` in place of a function
    (it runs through its ``apply``, with the parameters), or None for anything else."""
    hk = sys.modules.get("haiku")
    if hk is None or not isinstance(obj, hk.Transformed | hk.TransformedWithState):
        return None
    from .._util.errors import HookaxError

    state = ", state" if isinstance(obj, hk.TransformedWithState) else ""
    return HookaxError(
        f"{who} of a Haiku {type(obj).__name__}: Haiku runs a model through its apply, with its "
        f"parameters. Fix: pass apply, {_haiku_fix(who, state)}, with params{state} = "
        "t.init(rng, x) (rng may be None where the model draws no numbers)."
    )


def _haiku_fix(who: str, state: str = "") -> str:
    """How ``who`` runs a Haiku model ``t = hk.transform(fn)``."""
    if who == "hx.ops":
        return f"hx.ops(t.apply, params{state}, rng, x)"
    if who == "hx.value_and_grad":
        return f"hx.value_and_grad(lambda p, x: loss(t.apply(p{state}, rng, x)))(params, x)"
    return f"{who}(t.apply)(params{state}, rng, x)"


_HAIKU_OUTSIDE = "must be initialized inside an `hk.transform`"


def note_haiku_outside_transform(e: BaseException, who: str) -> None:
    """Add the fix to Haiku's error for a module built outside ``hk.transform``."""
    if isinstance(e, ValueError) and _HAIKU_OUTSIDE in str(e) and "haiku" in sys.modules:
        from .._util.errors import add_note

        add_note(
            e,
            f"hookax: {who} ran a function that builds Haiku modules outside hk.transform. Fix: "
            f"t = hk.transform(fn); params = t.init(rng, x); {_haiku_fix(who)}.",
        )


def is_linen(obj: Any) -> bool:
    nn = sys.modules.get("flax.linen")
    return nn is not None and isinstance(obj, nn.Module)


# ---------------------------------------------------------------------------------------------
# Linen's own interceptors: as Linen has them, unless the user opts in to cache keys.

LINEN_KEYED = [False]  # read by the Linen adapter each time nn.intercept_methods is entered


class StaleTraceWarning(UserWarning):
    """An ``nn.intercept_methods`` block ended without its interceptor having been called.

    Linen's interceptors are not part of the jit cache key, so this is what a jitted function
    reusing a trace made without (or with another) interceptor looks like. Issued once per
    interceptor function; see [`hx.key_linen_interceptors`][hookax.key_linen_interceptors].
    """


def key_linen_interceptors(enabled: bool = True) -> bool:
    """Make Linen's own ``nn.intercept_methods`` part of the jit cache key (process-wide).

    By default hookax leaves ``nn.intercept_methods`` as Linen has it: a function jitted outside
    a block is reused inside it without running the interceptor, and the other way round.
    Opting in keys every jit cache, and JAX's eager per-operation caches, by the active Linen
    interceptors, as ``hx.intercept`` always is: the same interceptor, or a function re-created
    with the same code over the same objects, hits the caches; an interceptor that closes over a
    new object each step (a fresh dict to collect activations) then retraces every jitted step
    and recompiles every eager operation, and JAX's caches keep each step's object alive. Takes
    effect for blocks entered afterwards, in any thread; works whether or not ``flax.linen`` is
    imported yet.

    Args:
      enabled: True to key Linen's interceptors, False for Linen's own behaviour.

    Returns:
      The previous setting.

    Examples:
      >>> import hookax as hx
      >>> previous = hx.key_linen_interceptors()
      >>> hx.key_linen_interceptors(previous)
      True
    """
    previous, LINEN_KEYED[0] = LINEN_KEYED[0], bool(enabled)
    if "flax.linen" in sys.modules:
        ensure_installed(only="linen")
    return previous


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Installs the Linen adapter right after ``flax.linen`` is imported, then removes itself."""

    NAME = "flax.linen"

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name != self.NAME:
            return None
        finders = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
        for finder in finders:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_install(module: Any) -> None:
            exec_module(module)
            self.remove()
            ensure_installed(only="linen")  # no other framework: hookax is not in use yet

        loader.exec_module = exec_then_install  # this module's own loader object only
        return spec

    def remove(self) -> None:
        with contextlib.suppress(ValueError):  # another thread removed it first
            sys.meta_path.remove(self)


def _watch_linen_import() -> None:
    if "flax.linen" not in sys.modules and not any(
        isinstance(f, _InstallAfterImport) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _InstallAfterImport())


_watch_linen_import()
