"""``hookax``: the command's entry point. Builds the parser from the registered subcommands
(``summary`` and ``gradflow`` in :mod:`hookax._cli.common`, ``ops``, ``stats-plot``, ``profile``
and ``harvest`` here, each run from its own module) and maps errors to one line and an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from . import common, interrupt
from .common import COMMANDS, Command, UnknownArguments, UsageError, _Parser, register

__all__ = ["main"]


# One paragraph per line: argparse wraps them at the terminal's width (helptext.HelpFormatter).
EPILOG = (
    "errors and Ctrl-C:\n"
    "  A mistake or a failure is one line on stderr, in the words of the flags, and exit status "
    "2: an input that does not fit the model, an exception of the model's own (with its call "
    "site and line), a --out that cannot be written. Ctrl-C ends any subcommand with status 130 "
    "and one line, at once, also while XLA compiles; an interrupted harvest keeps every "
    "committed batch and the same command resumes it (hookax harvest --help: safety)."
)


def _version() -> str:
    from importlib import metadata

    try:
        return f"hookax {metadata.version('hookax')}"
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree that is not installed
        return "hookax 0.0.0"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="hookax",
        description="Summaries and gradient flow of JAX models (Flax NNX, Flax Linen, Equinox).",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    for command in COMMANDS.values():
        if command.add_parser is not None:
            command.add_parser(sub)
            continue
        c = sub.add_parser(command.name, help=command.help, description=command.help)
        if command.add_arguments is not None:
            command.add_arguments(c)
    return p


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments; an unknown one raises :class:`UnknownArguments` with the nearest flag of
    the subcommand that was run (or the subcommands that take it) and that subcommand's usage."""
    p = _parser()
    args, unknown = p.parse_known_args(argv)
    if not unknown:
        return args
    subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices
    this = subs[args.command]
    hints = []
    for arg in unknown:
        if not arg.startswith("-"):
            continue
        name = arg.split("=", 1)[0]
        others = [c for c, parser in subs.items() if name in parser._option_string_actions]
        near = _nearest(arg, this)
        if others:
            hints.append(f"{name} is a flag of hookax {', '.join(others)}, not of {this.prog}")
        elif near is not None:
            hints.append(f"did you mean {near}?")
    hint = f"; {'; '.join(hints)}" if hints else ""
    message = f"unrecognized arguments: {' '.join(unknown)}{hint} (see: {this.prog} --help)"
    raise UnknownArguments(message, this.format_usage())


def _nearest(flag: str, parser: argparse.ArgumentParser) -> str | None:
    from .helptext import nearest_flag

    return nearest_flag(flag, parser._option_string_actions)


def _ops_arguments(c: argparse.ArgumentParser) -> None:
    from .ops import add_arguments

    add_arguments(c)


def _ops(args: argparse.Namespace) -> None:
    from .ops import run

    run(args)


register(
    Command(
        "ops",
        "the operations inside each call site, with the addresses ops= takes",
        _ops_arguments,
        _ops,
    )
)


def _statsplot_arguments(c: argparse.ArgumentParser) -> None:
    from .statsplot import add_arguments

    add_arguments(c)


def _statsplot(args: argparse.Namespace) -> None:
    from .statsplot import run

    run(args)


register(
    Command(
        "stats-plot",
        "per-layer statistics over the training steps (hx.StatsLogger's files), as a PNG figure",
        _statsplot_arguments,
        _statsplot,
    )
)


def _profile_arguments(c: argparse.ArgumentParser) -> None:
    from .profile import add_arguments

    add_arguments(c)


def _profile(args: argparse.Namespace) -> None:
    from .profile import run

    run(args)


register(
    Command(
        "profile",
        "device time per call site of the forward and backward pass (jax.profiler), as a table",
        _profile_arguments,
        _profile,
    )
)


def _harvest_parser(sub: Any) -> None:
    from .harvest import add_parser

    add_parser(sub)


def _harvest(args: argparse.Namespace) -> None:
    from .harvest import run

    run(args)


# hookax harvest: its arguments and its run live in _harvest_cli
register(Command("harvest", "", None, _harvest, add_parser=_harvest_parser))


@contextlib.contextmanager
def _whole_tracebacks() -> Iterator[None]:
    """JAX's own frames kept in tracebacks: where an exception was raised tells an input that
    does not fit (JAX refused it) from the model's own exception (:mod:`.failures`). The
    command shows no traceback, so nothing is lost."""
    import jax

    old = jax.config.jax_traceback_filtering  # type: ignore[attr-defined]
    jax.config.update("jax_traceback_filtering", "off")
    try:
        yield
    finally:
        jax.config.update("jax_traceback_filtering", old)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hookax`` command; returns the exit code (0, 2 for a usage mistake or a failure,
    130 for Ctrl-C: :mod:`hookax._cli.interrupt`)."""
    from .. import examples
    from .._util.extras import MissingExtraError, require

    try:
        args = _parse(argv)
        # Missing packages are named before any work (gradients are not computed for nothing).
        if getattr(args, "example", None) not in (None, *examples.PROGRAMS):
            require("flax", "nnx", f"hookax {args.command} --example (the examples are Flax NNX)")
        if args.command == "gradflow":
            require("matplotlib", "plot", "hookax gradflow (it draws a chart)")
        if args.command == "stats-plot":
            require("matplotlib", "plot", "hookax stats-plot (it draws a chart)")
            require("tensorboardX", "tensorboard", "hookax stats-plot (it reads TensorBoard files)")
        if args.command == "harvest":
            require("tensorstore", "harvest", "hookax harvest (it writes a zarr store)")
        with _whole_tracebacks(), contextlib.ExitStack() as model_context:
            common.MODEL_CONTEXT.append(model_context)
            try:
                COMMANDS[args.command].run(args)
            finally:
                common.MODEL_CONTEXT.remove(model_context)
        sys.stdout.flush()
    except (UsageError, MissingExtraError) as e:
        if interrupt.requested(e):  # an exception the Ctrl-C turned into (JAX wraps some)
            return _interrupted()
        if isinstance(e, UnknownArguments):
            print(e.usage, end="", file=sys.stderr)
        print(f"hookax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted()
    except BrokenPipeError:  # `hookax summary ... | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as e:
        if interrupt.requested(e):
            return _interrupted()
        raise
    return 0


def _interrupted() -> int:
    """Ctrl-C: the command exits here (:func:`interrupt.exit_now`); in-process (tests), one
    line and 130."""
    if interrupt.installed():
        interrupt.exit_now()
    print(f"hookax: {interrupt.message(clear=True)}", file=sys.stderr)
    return 130
