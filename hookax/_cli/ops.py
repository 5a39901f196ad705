"""``hookax ops``: the operations inside each call site of a model, with their addresses.

hookax ops --example transformer --where "layers/0/attn"
hookax ops mypkg.models:make_model --input "f32[8,64]" --format json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(c: argparse.ArgumentParser) -> None:
    from .common import add_model_arguments

    add_model_arguments(c)
    c.add_argument(
        "--where",
        help='which call sites to list (a glob like "layers/0/attn" or "**/mlp"); default all',
    )
    c.add_argument("--format", choices=("table", "json"), default="table", help="how to print it")


def run(args: argparse.Namespace) -> None:
    from .._capture.opslist import ops
    from .common import check_call, command_error, load_model

    loaded = load_model(args, abstract=True)  # nothing weights-sized is allocated
    check_call(loaded)
    kwargs = dict(loaded.kwargs)
    try:
        fn, inputs = _abstract_call(loaded.model, loaded.args, loaded.kwargs, args.eval)
        table = ops(fn, *inputs, where=args.where, **kwargs)
    except Exception as e:
        raise command_error(e, loaded, args.where) from None
    if args.format == "json":
        print(table.to_json())
    else:
        from .._util.display import echo

        echo(table.grid())


def _abstract_call(model: Any, inputs: tuple, kwargs: dict, eval_mode: bool) -> tuple[Any, tuple]:
    """A function and arguments that run ``model`` with its parameters as abstract arguments
    (the model's arrays are ``jax.ShapeDtypeStruct``: they cannot be closed over)."""
    import jax

    from .._summary.haiku import is_transformed, original_fn

    nnx = sys.modules.get("flax.nnx")
    linen = sys.modules.get("flax.linen")
    if is_transformed(model):
        import haiku as hk

        t = hk.transform_with_state(original_fn(model))
        key = jax.random.key(0)
        variables = jax.eval_shape(lambda *a, **k: t.init(key, *a, **k), *inputs, **kwargs)
        return (lambda v, *a, **k: t.apply(*v, key, *a, **k)[0]), (variables, *inputs)
    if nnx is not None and isinstance(model, nnx.Module):
        if eval_mode:
            model.eval()
        graphdef, state = nnx.split(model)
        return (lambda s, *a, **k: nnx.merge(graphdef, s)(*a, **k)), (state, *inputs)
    if linen is not None and isinstance(model, linen.Module):
        variables = jax.eval_shape(model.init, jax.random.key(0), *inputs, **kwargs)
        return (lambda v, *a, **k: model.apply(v, *a, **k)), (variables, *inputs)
    import equinox as eqx

    if eval_mode:
        model = eqx.nn.inference_mode(model)
    dynamic, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return (lambda d, *a, **k: eqx.combine(d, static)(*a, **k)), (dynamic, *inputs)
