"""How :func:`hookax.summary` sees Flax Linen and Equinox models (NNX: ``_summary_trace``).

The same abstract recipe as for NNX: the model's arrays become ``jax.ShapeDtypeStruct``\\ s, the
call is traced by ``jax.jit(...).trace`` with an interceptor recording every call site, and each
call site's FLOPs come from lowering its method alone.

* Linen: an unbound module's variables come from ``jax.eval_shape`` of ``init`` (nothing is
  allocated); a bound module's own variables are used. Every collection is counted under the
  scope path of the module that owns it; ``"params"`` is the trainable one.
* Equinox: the model is split with ``eqx.partition`` into arrays and the rest. Trainable
  parameters are its floating-point arrays (Equinox's convention), the other arrays (integer
  buffers, PRNG keys) are listed as ``"other arrays"``; an array held in two places is counted
  once.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .._util.errors import HookaxError
from .._util.specs import describe
from . import trace

__all__ = ["backend"]


def backend(name: str) -> Any:
    """A fresh tracer for one summary of a ``name`` (``"linen"``/``"equinox"``) model."""
    return _Linen() if name == "linen" else _Equinox()


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


def _inexact(x: Any) -> bool:
    try:
        return bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))
    except TypeError:  # PRNG keys
        return False


def _linen_train_kwargs(model: Any, method: str, train: bool | None) -> dict[str, Any]:
    """Linen's convention for training behaviour: ``deterministic=`` or ``train=`` arguments."""
    if train is None:
        return {}
    params = inspect.signature(getattr(type(model), method)).parameters
    if "deterministic" in params:
        return {"deterministic": not train}
    if "train" in params:
        return {"train": train}
    if "training" in params:
        return {"training": train}
    raise HookaxError(
        f"hx.summary(train={train}): {type(model).__name__}.{method} takes no deterministic=, "
        "train= or training= argument to switch. Fix: pass the model's own switch as a keyword "
        "argument to hx.summary, or leave train=None."
    )


class _Linen:
    """Linen: ``apply`` on abstract variables."""

    def __init__(self) -> None:
        self.variables: Any = None

    def trace_calls(
        self,
        model: Any,
        args: tuple,
        kwargs: dict,
        *,
        method: str,
        train: bool | None,
        call: Any = None,
    ) -> trace.Whole:
        if call is not None:
            raise HookaxError(
                "hx.summary of a function that calls a Linen module is not supported (Linen "
                "modules run through apply with their variables). Fix: summarise the module "
                "itself, hx.summary(model, *inputs), or wrap the function's work in a method."
            )
        kwargs = {**_linen_train_kwargs(model, method, train), **kwargs}
        flat = trace.Flat.of((args, kwargs))
        if model.scope is not None:
            model, variables = model.unbind()
        else:

            def init(dynamic: list[Any]) -> Any:
                a, k = flat.rebuild(dynamic)
                key = jax.random.key(0)
                return model.init({"params": key, "dropout": key}, *a, method=method, **k)

            variables = jax.eval_shape(init, flat.dynamic)
        self.variables = trace.abstract(dict(variables))
        mutable = [c for c in self.variables if c != "params"] or False
        key = jax.random.key(0)

        def forward(variables: Any, dynamic: list[Any]) -> Any:
            a, k = flat.rebuild(dynamic)
            rngs = {"dropout": key}
            return model.apply(variables, *a, method=method, mutable=mutable, rngs=rngs, **k)

        return trace.trace_whole(forward, (self.variables, flat.dynamic), _linen_site)

    def collections(self, model: Any, variables: bool) -> trace.Collections:
        entries = []
        own: dict[tuple[Any, ...], list[str]] = {}
        for coll, tree in (self.variables or {}).items():
            name = trace.TRAINABLE if coll == "params" else coll
            for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
                keys = tuple(getattr(k, "key", k) for k in kp)
                module = keys[:-1]
                for i in range(len(module) + 1):
                    entries.append((module[:i], name, id(x), x, i == len(module)))
                if variables:
                    own.setdefault(module, []).append(f"{keys[-1]}: {coll} {describe(x)}")
        return trace.Collections.build(entries, {p: tuple(v) for p, v in own.items()})


def _linen_site(module: Any, method: str, args: tuple, kwargs: dict) -> trace.Site | None:
    try:
        unbound, variables = module.unbind()
    except Exception:  # a call site Linen cannot cut out here: no FLOPs for it
        return None
    flat = trace.Flat.of((args, kwargs))

    def run(variables: Any, dynamic: list[Any]) -> Any:
        a, k = flat.rebuild(dynamic)
        rngs = {"dropout": jax.random.key(0)}
        return unbound.apply(variables, *a, method=method, mutable=True, rngs=rngs, **k)

    return trace.Site(unbound, trace.abstract(dict(variables)), method, flat, run)


class _Equinox:
    """Equinox: the model's arrays abstract, the rest static."""

    def trace_calls(
        self,
        model: Any,
        args: tuple,
        kwargs: dict,
        *,
        method: str,
        train: bool | None,
        call: Any = None,
    ) -> trace.Whole:
        import equinox as eqx

        from ..frameworks import _equinox

        if train is not None:
            model = eqx.nn.inference_mode(model, value=not train)
        flat = trace.Flat.of((args, kwargs))
        dyn, static = eqx.partition(model, _is_array)

        def forward(dyn: Any, dynamic: list[Any]) -> Any:
            a, k = flat.rebuild(dynamic)
            m = eqx.combine(dyn, static)
            return trace.root_call(m, method, call, a, k, _equinox.ADAPTER)

        return trace.trace_whole(forward, (trace.abstract(dyn), flat.dynamic), _eqx_site)

    def collections(self, model: Any, variables: bool) -> trace.Collections:
        import equinox as eqx

        from ..frameworks import _equinox

        def own_leaves(module: Any) -> Iterator[tuple[Any, Any]]:
            is_sub = lambda x: x is not module and isinstance(x, eqx.Module)  # noqa: E731
            for kp, x in jax.tree_util.tree_flatten_with_path(module, is_leaf=is_sub)[0]:
                if _is_array(x):
                    yield kp, x

        entries = []
        own: dict[tuple[Any, ...], tuple[str, ...]] = {}
        for path, module in _equinox.ADAPTER.iter_modules(model):
            direct = {id(x) for _, x in own_leaves(module)}
            for x in jax.tree.leaves(module):
                if _is_array(x):
                    coll = trace.TRAINABLE if _inexact(x) else "other arrays"
                    entries.append((path, coll, id(x), x, id(x) in direct))
            if variables:
                own[path] = tuple(
                    f"{jax.tree_util.keystr(kp, simple=True, separator='/')}: {describe(x)}"
                    for kp, x in own_leaves(module)
                )
        return trace.Collections.build(entries, {p: v for p, v in own.items() if v})


def _eqx_site(module: Any, method: str, args: tuple, kwargs: dict) -> trace.Site | None:
    import equinox as eqx

    try:
        dyn, static = eqx.partition(module, _is_array)
    except Exception:  # pragma: no cover - partition of a module does not fail in practice
        return None
    flat = trace.Flat.of((args, kwargs))

    def run(dyn: Any, dynamic: list[Any]) -> Any:
        a, k = flat.rebuild(dynamic)
        return getattr(eqx.combine(dyn, static), method)(*a, **k)

    return trace.Site(static, trace.abstract(dyn), method, flat, run)
