"""``hookax profile``: device time per call site of a model's forward and backward pass.

hookax profile --example mlp
hookax profile mypkg.models:make_model --input "f32[8,224,224,3]" [--runs 10] [--format json]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(c: argparse.ArgumentParser) -> None:
    from .common import add_model_arguments

    add_model_arguments(c)
    c.add_argument("--runs", type=int, default=5, help="measured runs (default 5)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    c.add_argument(
        "--forward", action="store_true", help="the forward pass only (default: with backward)"
    )
    c.add_argument("--format", choices=("table", "json"), default="table", help="how to print it")


def run(args: argparse.Namespace) -> None:
    from .._diagnostics.gradflow import random_inputs
    from .._diagnostics.profile import profile
    from .common import (
        UsageError,
        _concrete_kwargs,
        bind_linen,
        check_call,
        command_error,
        load_nnx_or_equinox,
    )

    if args.runs < 1:
        raise UsageError(f"--runs takes a number of at least 1, got {args.runs}")
    loaded = load_nnx_or_equinox(args, "hookax profile times", linen=True)
    check_call(loaded)
    inputs = random_inputs(loaded.args, args.seed, loaded.int_high)
    kwargs = _concrete_kwargs(loaded.kwargs, args.seed)
    try:
        if _is_linen(loaded.model):  # its variables are the step's argument, as Linen runs
            model = loaded.model
            variables = bind_linen(model, inputs, kwargs, args.seed).variables
            step = _linen_step(model, args.forward)
            table = profile(step, variables, *inputs, runs=args.runs, **kwargs)
        else:
            step = _step(loaded.model, args.forward)
            table = profile(step, loaded.model, *inputs, runs=args.runs, **kwargs)
    except Exception as e:
        raise command_error(e, loaded) from None
    if args.format == "json":
        print(table.to_json())
    else:
        from .._util.display import echo

        echo(table.grid())


def _is_linen(model: Any) -> bool:
    nn = sys.modules.get("flax.linen")
    return nn is not None and isinstance(model, nn.Module)


def _linen_step(model: Any, forward: bool) -> Any:
    """A Linen model's forward pass over its variables, or the gradient with respect to them
    of the mean square of its outputs."""
    import jax

    from .._diagnostics.gradflow import mean_square_loss

    def apply(variables: Any, *a: Any, **k: Any) -> Any:
        return model.apply(variables, *a, **k)

    def loss(variables: Any, *a: Any, **k: Any) -> Any:
        return mean_square_loss(lambda *b, **kk: apply(variables, *b, **kk), *a, **k)

    return apply if forward else jax.grad(loss)


def _step(model: Any, forward: bool) -> Any:
    """The model's forward pass, or the gradient of the mean square of its outputs."""
    from .._diagnostics.gradflow import mean_square_loss

    if forward:
        return lambda m, *a, **k: m(*a, **k)
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(model, nnx.Module):
        return lambda m, *a, **k: nnx.grad(mean_square_loss)(m, *a, **k)
    import equinox as eqx

    return lambda m, *a, **k: eqx.filter_grad(mean_square_loss)(m, *a, **k)
