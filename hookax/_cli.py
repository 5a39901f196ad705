"""The ``hookax`` command line: ``hookax summary``, ``hookax gradflow`` and ``hookax harvest``.

    hookax summary --example cnn
    hookax summary mypkg.models:make_model --input "f32[8,224,224,3]" [--depth 2] [--json]
    hookax gradflow --example mlp --out gradflow.png
    hookax harvest --example transformer --where "layers/*/mlp" --batches 100 --out acts.zarr

A mistake on the command line (an unknown example, a factory that does not import, an input spec
that does not parse, an input the model rejects) prints one line on stderr and exits with 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["UsageError", "main"]


class UsageError(Exception):
    """A mistake of the person at the command line: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see: {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    from .examples import NAMES

    p = _Parser(prog="hookax", description="Summaries and gradient flow of JAX (Flax NNX) models.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_ in (
        ("summary", "one row per call site: shapes, parameters, FLOPs"),
        ("gradflow", "per-layer gradient norms of one backward pass, as a bar chart (PNG)"),
    ):
        c = sub.add_parser(name, help=help_, description=help_)
        c.add_argument(
            "factory",
            nargs="?",
            help="package.module:function returning an nnx.Module (called with no arguments)",
        )
        c.add_argument("--example", help=f"a built-in example: {', '.join(NAMES)}")
        c.add_argument(
            "--input",
            action="append",
            default=[],
            metavar="SPEC",
            help='an input like "f32[8,224,224,3]"; repeat for several positional arguments',
        )
        if name == "summary":
            c.add_argument("--depth", type=int, help="fold rows deeper than this")
            c.add_argument("--json", action="store_true", help="print JSON instead of a table")
        else:
            c.add_argument("--out", default="gradflow.png", help="the PNG to write")
            c.add_argument("--seed", type=int, default=0, help="seed of the random input")
    # hookax harvest: its arguments and its run live in _harvest_cli
    from ._harvest_cli import add_parser as add_harvest_parser

    add_harvest_parser(sub)
    return p


def _load_factory(spec: str) -> Any:
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise UsageError(f"a factory looks like 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        raise UsageError(f"cannot import factory {spec!r}: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"cannot import factory {spec!r}: {mod_name} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"factory {spec!r} is not callable")
    return obj


def _inputs(args: argparse.Namespace, default: tuple[Any, ...] | None) -> tuple[Any, ...]:
    from ._specs import SpecError, parse_spec

    if not args.input:
        if default is None:
            raise UsageError('a factory needs its input: add --input "f32[8,224,224,3]"')
        return default
    try:
        return tuple(parse_spec(s) for s in args.input)
    except SpecError as e:
        raise UsageError(str(e)) from None


def _model(args: argparse.Namespace, *, abstract: bool) -> tuple[Any, tuple[Any, ...], int]:
    """The model (abstract when asked), its inputs, and the bound of random integer inputs."""
    from flax import nnx

    if (args.factory is None) == (args.example is None):
        raise UsageError("give either a factory (package.module:function) or --example NAME")
    if args.example is not None:
        from . import examples

        try:
            ex = examples.load(args.example)
        except KeyError:
            raise UsageError(
                f"unknown example {args.example!r}; choose one of: {', '.join(examples.NAMES)}"
            ) from None
        inputs = _inputs(args, ex.example_inputs())
        build = lambda: ex.make_model(nnx.Rngs(0))  # noqa: E731
        int_high = getattr(ex, "INT_HIGH", 2)
    else:
        factory = _load_factory(args.factory)
        inputs = _inputs(args, None)
        build, int_high = factory, 2
    model = _build(build, args.factory or args.example, abstract)
    if not isinstance(model, nnx.Module):
        raise UsageError(f"{args.factory!r} returned {type(model).__name__}, not an nnx.Module")
    return model, inputs, int_high


def _build(build: Any, name: str, abstract: bool) -> Any:
    """Call the factory: under ``nnx.eval_shape`` when ``abstract`` (nothing allocated), else
    inside one ``nnx.jit`` (one compile, not one per initializer); plainly where those fail."""
    from flax import nnx

    for transform in (nnx.eval_shape,) if abstract else (nnx.jit,):
        try:
            model = transform(build)() if transform is nnx.jit else transform(build)
        except Exception:
            continue
        if isinstance(model, nnx.Module):
            return model
    try:
        return build()
    except Exception as e:
        raise UsageError(f"factory {name!r} raised {type(e).__name__}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _rejected(e: Exception, inputs: tuple[Any, ...]) -> UsageError:
    from ._specs import describe
    from ._summary_trace import rejection

    shown = ", ".join(describe(x) for x in inputs)
    where = rejection(e)
    where = f"{where}: " if where else ""
    return UsageError(
        f"input {shown} does not fit the model: {where}{type(e).__name__}: {_first_line(e)}"
    )


def _summary(args: argparse.Namespace) -> None:
    from ._summary import summary

    if args.depth is not None and args.depth < 0:
        raise UsageError(f"--depth takes an integer >= 0, got {args.depth}")
    model, inputs, _ = _model(args, abstract=True)
    try:
        s = summary(model, *inputs, depth=args.depth)
    except Exception as e:
        raise _rejected(e, inputs) from None
    print(s.to_json() if args.json else s)


def _gradflow(args: argparse.Namespace) -> None:
    from ._gradflow import layer_grad_norms, plot_grad_norms, random_inputs

    model, specs, int_high = _model(args, abstract=False)
    inputs = random_inputs(specs, args.seed, int_high)
    try:
        norms = layer_grad_norms(model, *inputs)
    except Exception as e:
        raise _rejected(e, specs) from None
    if not norms:
        raise UsageError("the model has no parameters: nothing to plot")
    name = args.example or args.factory
    try:
        plot_grad_norms(norms, args.out, title=f"gradient flow: {name}")
    except OSError as e:
        raise UsageError(f"cannot write {args.out!r}: {e.strerror or e}") from None
    width = max(len(k) for k in norms)
    for key, value in norms.items():
        print(f"{key:<{width}}  {value:.4e}")
    print(f"wrote {args.out} ({len(norms)} layers)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hookax`` command; returns the exit code (0, or 2 for a usage mistake)."""
    from ._extras import MissingExtraError, require

    try:
        args = _parser().parse_args(argv)
        # Missing packages are named before any work (gradients are not computed for nothing).
        require("flax", "nnx", f"hookax {args.command} (it takes Flax NNX models)")
        if args.command == "gradflow":
            require("matplotlib", "plot", "hookax gradflow (it draws a chart)")
        if args.command == "harvest":
            require("tensorstore", "harvest", "hookax harvest (it writes a zarr store)")
        from ._harvest_cli import run as _harvest

        {"summary": _summary, "gradflow": _gradflow, "harvest": _harvest}[args.command](args)
    except (UsageError, MissingExtraError) as e:
        print(f"hookax: error: {e}", file=sys.stderr)
        return 2
    return 0
