"""How :func:`hookax.summary` sees Flax Linen and Equinox models (NNX: ``_summary_trace``).

The same abstract recipe as for NNX: the model's arrays become ``jax.ShapeDtypeStruct``\\ s, the
call is traced by ``jax.jit(...).lower`` with an interceptor recording every call site, and each
call site's FLOPs come from lowering its method alone.

* Linen: an unbound module's variables come from ``jax.eval_shape`` of ``init`` (nothing is
  allocated); a bound module's own variables are used. Parameters are the ``"params"``
  collection, counted under the scope path of the module that owns them.
* Equinox: the model is split with ``eqx.partition`` into arrays and the rest. Parameters are its
  floating-point arrays (Equinox's convention), an array held in two places counted once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import jax
import numpy as np

from . import _summary_trace as trace
from ._intercept import intercept

__all__ = ["backend"]


def backend(name: str) -> Any:
    """A fresh tracer for one summary of a ``name`` (``"linen"``/``"equinox"``) model."""
    return _Linen() if name == "linen" else _Equinox()


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


def _size(x: Any) -> tuple[int, int]:
    n = int(np.prod(x.shape, dtype=np.int64))
    return n, n * np.dtype(x.dtype).itemsize


def _is_param(x: Any) -> bool:
    return _is_array(x) and bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))


def _table(
    modules: list[tuple[tuple[Any, ...], Any]],
    below_of: Any,
    direct_of: Any,
) -> trace.ParamTable:
    """A ParamTable from each module's parameters (with submodules) and its own parameters."""
    sizes: dict[int, tuple[int, int]] = {}
    owners: dict[int, list[tuple[Any, ...]]] = {}
    below: dict[tuple[Any, ...], set[int]] = {}
    direct: dict[tuple[Any, ...], set[int]] = {}
    for path, module in modules:
        below[path] = set()
        for x in below_of(path, module):
            sizes.setdefault(id(x), _size(x))
            below[path].add(id(x))
        direct[path] = {id(x) for x in direct_of(path, module)}
        for vid in direct[path]:
            owners.setdefault(vid, []).append(path)
    return trace.assemble_params(sizes, owners, below, direct)


class _Linen:
    """Linen: ``apply`` on abstract variables."""

    flops_of = staticmethod(trace.flops_of)

    def __init__(self) -> None:
        self.variables: Any = None

    def trace_calls(self, model: Any, args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
        flat = trace.Flat.of((args, kwargs))
        if model.scope is not None:
            model, variables = model.unbind()
        else:

            def init(dynamic: list[Any]) -> Any:
                a, k = flat.rebuild(dynamic)
                key = jax.random.key(0)
                return model.init({"params": key, "dropout": key}, *a, **k)

            variables = jax.eval_shape(init, flat.dynamic)
        self.variables = trace.abstract(dict(variables))
        mutable = [c for c in self.variables if c != "params"] or False

        def forward(variables: Any, dynamic: list[Any]) -> Any:
            a, k = flat.rebuild(dynamic)
            return model.apply(variables, *a, mutable=mutable, **k)

        recorder = trace._Recorder(site=_linen_site)
        with intercept(recorder):
            lowered = jax.jit(forward).lower(self.variables, flat.dynamic)
        return recorder.records, lowered

    def param_table(self, model: Any) -> trace.ParamTable:
        params = self.variables.get("params", {}) if self.variables else {}
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        named = [(tuple(k.key for k in kp[:-1]), x) for kp, x in leaves]
        paths = sorted({p[:i] for p, _ in named for i in range(len(p) + 1)}, key=len)
        return _table(
            [(p, None) for p in paths],
            lambda path, _: [x for p, x in named if p[: len(path)] == path],
            lambda path, _: [x for p, x in named if p == path],
        )

    @staticmethod
    def lower_flops(site: Any, cache: dict[Hashable, int | None]) -> int | None:
        def run(variables: Any, module: Any, dynamic: list[Any]) -> Any:
            a, k = site.args.rebuild(dynamic)
            return module.apply(variables, *a, method=site.method, mutable=True, **k)

        return _lower(site, cache, run)


def _linen_site(module: Any, method: str, args: tuple, kwargs: dict) -> trace.Site | None:
    try:
        unbound, variables = module.unbind()
        return trace.Site(
            unbound, trace.abstract(dict(variables)), method, trace.Flat.of((args, kwargs))
        )
    except Exception:  # a call site Linen cannot cut out here: no FLOPs for it
        return None


def _lower(site: Any, cache: dict[Hashable, int | None], run: Any) -> int | None:
    if site is None:
        return None
    key = site.cache_key()
    if key is not None and key in cache:
        return cache[key]
    try:
        fn = jax.jit(lambda state, dynamic: run(state, site.graphdef, dynamic))
        flops = trace.flops_of(fn.lower(site.state, site.args.dynamic))
    except Exception:  # lowering a call site alone can fail (e.g. it needs an outer transform)
        flops = None
    if key is not None:
        cache[key] = flops
    return flops


class _Equinox:
    """Equinox: the model's arrays abstract, the rest static."""

    flops_of = staticmethod(trace.flops_of)

    def trace_calls(self, model: Any, args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
        import equinox as eqx

        flat = trace.Flat.of((args, kwargs))
        dyn, static = eqx.partition(model, _is_array)

        def forward(dyn: Any, dynamic: list[Any]) -> Any:
            a, k = flat.rebuild(dynamic)
            return eqx.combine(dyn, static)(*a, **k)

        recorder = trace._Recorder(site=_eqx_site)
        with intercept(recorder):
            lowered = jax.jit(forward).lower(trace.abstract(dyn), flat.dynamic)
        return recorder.records, lowered

    def param_table(self, model: Any) -> trace.ParamTable:
        import equinox as eqx

        from .frameworks import _equinox

        def direct(_: Any, module: Any) -> Iterator[Any]:
            leaves = jax.tree.leaves(
                module, is_leaf=lambda x: x is not module and isinstance(x, eqx.Module)
            )
            return (x for x in leaves if _is_param(x))

        return _table(
            list(_equinox.ADAPTER.iter_modules(model)),
            lambda _, module: [x for x in jax.tree.leaves(module) if _is_param(x)],
            direct,
        )

    @staticmethod
    def lower_flops(site: Any, cache: dict[Hashable, int | None]) -> int | None:
        import equinox as eqx

        def run(dyn: Any, static: Any, dynamic: list[Any]) -> Any:
            a, k = site.args.rebuild(dynamic)
            return getattr(eqx.combine(dyn, static), site.method)(*a, **k)

        return _lower(site, cache, run)


def _eqx_site(module: Any, method: str, args: tuple, kwargs: dict) -> trace.Site | None:
    import equinox as eqx

    try:
        dyn, static = eqx.partition(module, _is_array)
        return trace.Site(static, trace.abstract(dyn), method, trace.Flat.of((args, kwargs)))
    except Exception:  # pragma: no cover - partition of a module does not fail in practice
        return None
