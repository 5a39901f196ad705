"""How :func:`hookax.summary` sees a Haiku model: the ``hk.transform`` of a function.

Haiku has no model object: the model is the function given to ``hk.transform`` (or
``transform_with_state``, with or without ``without_apply_rng``), and its variables come from
``init``. The summary runs that function as ``hk.transform_with_state`` does: ``init`` under
``jax.eval_shape`` (nothing is allocated), then ``apply`` traced on the abstract ``params`` and
``state`` with the recorder on. The first row (key ``""``) is the function itself, typed by its
name, with the whole call's FLOPs (as a program without modules is summarised); its modules
follow, top-level ones at depth 1. Parameters are counted from ``params`` under the path of the
module that owns them (its Haiku name, as call sites are keyed), ``state`` as a collection of its
own.
A call site's FLOPs come from its method lowered alone in a transform of its own, on the abstract
variables of the transform it runs in: the model's, or, inside ``hk.layer_stack``, one layer's
(the row multiplies them by the layers).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import jax

from .._util.errors import HookaxError
from .._util.specs import describe
from . import trace

__all__ = ["Haiku", "is_transformed", "original_fn", "signature"]


def is_transformed(obj: Any) -> bool:
    """Whether ``obj`` is what ``hk.transform`` / ``hk.transform_with_state`` return."""
    hk = sys.modules.get("haiku")
    return hk is not None and isinstance(obj, hk.Transformed | hk.TransformedWithState)


def original_fn(transformed: Any) -> Any:
    """The function ``hk.transform`` was given."""
    from haiku._src.transform import get_original_fn

    return get_original_fn(transformed)


def signature(fn: Any) -> inspect.Signature | None:
    """``fn``'s signature with a first parameter added (``describe_call`` skips the first)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return None
    first = inspect.Parameter("_model", inspect.Parameter.POSITIONAL_ONLY)
    return sig.replace(parameters=[first, *sig.parameters.values()])


def _key() -> jax.Array:
    return jax.random.key(0)


class Haiku:
    """Haiku: ``init`` abstractly, then ``apply`` on the abstract variables."""

    def __init__(self) -> None:
        self.params: Any = {}
        self.state: Any = {}

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
        import haiku as hk

        if method != "__call__" or train is not None:
            raise HookaxError(
                "hx.summary of a Haiku transform takes no method= or train= (the transformed "
                "function is what runs). Fix: pass the function's own arguments, "
                "hx.summary(transformed, x, is_training=False)."
            )
        fn = original_fn(model)
        t = hk.transform_with_state(fn)
        flat = trace.Flat.of((args, kwargs))

        def init(dynamic: list[Any]) -> Any:
            a, k = flat.rebuild(dynamic)
            return t.init(_key(), *a, **k)

        self.params, self.state = trace.abstract(jax.eval_shape(init, flat.dynamic))

        # The first row is the function itself (its modules are called from it, several of
        # them at its top level maybe): the whole call's FLOPs, every parameter.
        root = trace.Record(
            key="",
            path=(),
            type=getattr(fn, "__name__", "function"),
            method="__call__",
            inputs=trace.describe_call(signature(fn), args, kwargs),
        )
        recorder = trace.Recorder(_site)
        recorder.records.append(root)

        def forward(variables: Any, dynamic: list[Any]) -> Any:
            a, k = flat.rebuild(dynamic)
            out = t.apply(*variables, _key(), *a, **k)[0]
            root.outputs = trace.describe_output(out)
            return out

        variables = (self.params, self.state)
        return trace.trace_whole(forward, (variables, flat.dynamic), _site, recorder)

    def collections(self, model: Any, variables: bool) -> trace.Collections:
        from ..frameworks._haiku import haiku_path

        entries = []
        own: dict[tuple[Any, ...], list[str]] = {}
        for coll, tree in (("params", self.params), ("state", self.state)):
            name = trace.TRAINABLE if coll == "params" else coll
            for module_name, values in tree.items():
                path = haiku_path(module_name)
                for value_name, x in values.items():
                    for i in range(len(path) + 1):
                        entries.append((path[:i], name, id(x), x, i == len(path)))
                    if variables:
                        own.setdefault(path, []).append(f"{value_name}: {coll} {describe(x)}")
        return trace.Collections.build(entries, {p: tuple(v) for p, v in own.items()})


def _site(module: Any, method: str, args: tuple, kwargs: dict) -> trace.Site | None:
    """How to lower one call site alone: its method in a transform of its own, on the abstract
    variables of the transform it runs in (a lifted one's: one layer of ``hk.layer_stack``)."""
    import haiku as hk
    from haiku._src import base as hk_base

    frame = hk_base.current_frame()
    variables = trace.abstract(
        (dict(frame.params), dict(hk_base.extract_state(frame.state or {}, initial=False)))
    )
    flat = trace.Flat.of((args, kwargs))

    def body(dynamic: list[Any]) -> Any:
        a, k = flat.rebuild(dynamic)
        return getattr(module, method)(*a, **k)

    t = hk.transform_with_state(body)

    def run(variables: Any, dynamic: list[Any]) -> Any:
        return t.apply(*variables, _key(), dynamic)[0]

    return trace.Site(module, variables, method, flat, run)
