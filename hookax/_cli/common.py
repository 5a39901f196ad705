"""What every ``hookax`` subcommand shares (model options, loading, errors), and ``hookax
summary`` and ``hookax gradflow`` themselves; the entry point is :mod:`hookax._cli.main`.

    hookax summary --example cnn
    hookax summary mypkg.models:make_model --input "f32[8,224,224,3]" [--depth 2] [--format json]
    hookax summary ./mymodels.py:make --input "i32[1,128]" --kw cache.k="f32[1,128,64]" --eval
    hookax gradflow --example mlp --out gradflow.png [--where "layers/*"]
    hookax ops --example transformer --where "layers/0/attn"
    hookax harvest --example transformer --where "layers/*/mlp" --batches 100 --out acts.zarr

A factory is ``package.module:function`` (the current directory is importable) or
``path/to/file.py:function``; it is called once, with no arguments, and returns a Flax NNX, Flax
Linen or Equinox module, or a Haiku transform (``hk.transform(forward)``: ``hookax summary`` and
``hookax ops`` initialise its parameters abstractly). A mistake on the command line (an unknown
example, a factory that does not import, an input spec that does not parse, an input that does
not fit the model) prints one line on stderr and exits with 2; so does an exception of the
model's own, shown as the model's with its call site and line (:mod:`hookax._cli.failures`).

Subcommands are :class:`Command`\\ s in :data:`COMMANDS`; :func:`register` adds one, and
:func:`add_model_arguments` / :func:`load_model` give it the same model options as the others.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from .._util.words import counted
from .failures import _TRACING_ERRORS, model_failed
from .failures import first_line as _first_line
from .flags import call_problem, function_problem, in_flags, where_error

__all__ = [
    "COMMANDS",
    "Command",
    "LoadedModel",
    "UnknownArguments",
    "UsageError",
    "add_model_arguments",
    "load_model",
    "register",
]


class UsageError(Exception):
    """A mistake of the person at the command line: one line on stderr, exit code 2."""


class UnknownArguments(UsageError):
    """Arguments no parser took: the message names the nearest flags; ``usage`` is the usage of
    the (sub)command that was run, printed above it."""

    def __init__(self, message: str, usage: str) -> None:
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from .helptext import HelpFormatter

        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}{_did_you_mean(message)} (see: {self.prog} --help)")


def _did_you_mean(message: str) -> str:
    """``"; did you mean 'summary'?"`` for argparse's "invalid choice: 'sumary' (choose from
    ...)", else ``""``."""
    import difflib
    import re

    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m is None:
        return ""
    choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
    near = difflib.get_close_matches(m.group(1), choices, n=1)
    return f"; did you mean {near[0]!r}?" if near else ""


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its help, how it adds its arguments, and what it runs.

    ``add_parser``, when given, creates the subcommand's parser itself from the subparsers
    object (``sub.add_parser(name, ...)``) instead of ``add_arguments`` filling one.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None] | None
    run: Callable[[argparse.Namespace], None]
    add_parser: Callable[[Any], None] | None = None


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add a subcommand (in registration order in ``--help``)."""
    COMMANDS[command.name] = command
    return command


# ---------------------------------------------------------------------------------------------
# The model options shared by the subcommands


def add_model_arguments(c: argparse.ArgumentParser) -> None:
    """The factory or ``--example``, ``--input``, ``--kw`` and ``--eval``."""
    from ..examples import NAMES

    c.add_argument(
        "factory",
        nargs="?",
        help="package.module:function or path/to/file.py:function returning a Flax NNX, "
        "Flax Linen or Equinox module, or (hookax summary) a program without modules as a "
        "tuple (forward, weights, ...) of a function and its leading arguments (called once, "
        "with no arguments)",
    )
    c.add_argument("--example", help=f"a built-in example: {', '.join(NAMES)}")
    c.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SPEC",
        help='a positional input like "f32[8,224,224,3]", or package.module:function or '
        "file.py:function returning it (any pytree: a NamedArray, a dict of arrays or "
        "ShapeDtypeStructs); repeat for several",
    )
    c.add_argument(
        "--kw",
        "--kwarg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a keyword argument: a spec (f32[1,8]), an int, a float, true/false, none, or "
        "key(SEED) for a PRNG key; NAME.SUB=... builds a dict (cache.k=f32[1,8,64])",
    )
    c.add_argument(
        "--eval",
        action="store_true",
        help="evaluation mode: no dropout, running batch statistics",
    )


@dataclasses.dataclass
class LoadedModel:
    """What the model options give: the model, its inputs and a name to show."""

    model: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    name: str
    int_high: int = 2  # random integer inputs are drawn in [0, int_high)
    program: bool = False  # ``model`` is a function over its arguments, calling no module


def _load_factory(spec: str, what: str = "factory") -> Any:
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise UsageError(
            f"a {what} looks like 'package.module:function' or 'path/to/file.py:function', "
            f"got {spec!r}"
        )
    try:
        module = _import(mod_name)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot import {what} {spec!r}: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"cannot import {what} {spec!r}: {mod_name} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{what} {spec!r} is not callable")
    needed = _required_parameters(obj)
    if needed:
        names = ", ".join(needed)
        call = ", ".join(f"{n}=..." for n in needed)
        raise UsageError(
            f"{what} {spec!r} needs {names} (no default) and the command calls it with no "
            f"arguments. Fix: give {'it a default' if len(needed) == 1 else 'them defaults'}, "
            f"or add a function without arguments that calls it, def build(): return "
            f"{attr}({call}), and pass {mod_name}:build"
        )
    return obj


def _required_parameters(fn: Any) -> list[str]:
    """The parameters ``fn()`` would miss: those without a default, ``*args``/``**kw`` aside."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: the call will say
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        name
        for name, p in sig.parameters.items()
        if p.default is inspect.Parameter.empty and p.kind not in variadic
    ]


def _is_function_ref(text: str) -> bool:
    """Whether an ``--input`` names a function (``pkg.mod:fn``, ``file.py:fn``), not a spec."""
    return ":" in text and "[" not in text


def _input_from(spec: str) -> Any:
    """The value an ``--input pkg.mod:function`` returns (called once, with no arguments)."""
    fn = _load_factory(spec, "input function")
    try:
        return fn()
    except Exception as e:
        raise UsageError(f"--input {spec}: it raised {type(e).__name__}: {e}") from None


def _import(name: str) -> Any:
    """A module by dotted name (the current directory first on the path) or by file path."""
    if name.endswith(".py") or os.sep in name or "/" in name:
        path = os.path.abspath(name)
        if not os.path.isfile(path):
            raise UsageError(f"cannot import factory: no file {name!r}")
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # its sibling modules import too
        mod_name = os.path.splitext(os.path.basename(path))[0]
        loaded = sys.modules.get(mod_name)
        if loaded is not None and getattr(loaded, "__file__", None) == path:
            return loaded  # the factory's file: an input function's classes are the model's
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        return module
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(name)


def _parse_value(name: str, text: str) -> Any:
    import re

    from .._util.specs import SpecError, parse_spec

    if "[" in text:
        try:
            return parse_spec(text)
        except SpecError as e:
            raise UsageError(f"--kw {name}: {e}") from None
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    m = re.fullmatch(r"key\((\d+)\)", lowered)
    if m:
        import jax

        return jax.random.key(int(m.group(1)))
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    raise UsageError(
        f"cannot parse --kw {name}={text}: expected a spec like f32[1,8], an int, a float, "
        "true/false, none or key(SEED)"
    )


def _kwargs(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--kw takes NAME=VALUE, got {item!r}")
        *outer, last = name.split(".")
        target = out
        for part in outer:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise UsageError(f"--kw {name}: {part} was given a value already")
        target[last] = _parse_value(name, text)
    return out


def _inputs(args: argparse.Namespace, default: tuple[Any, ...] | None) -> tuple[Any, ...]:
    from .._util.specs import SpecError, parse_spec

    if not args.input:
        if default is None and not args.kw:
            raise UsageError(
                'a factory needs its input: add --input "f32[8,224,224,3]" (or --input '
                "pkg.module:function returning it)"
            )
        return default or ()
    try:
        return tuple(_input_from(s) if _is_function_ref(s) else parse_spec(s) for s in args.input)
    except SpecError as e:
        raise UsageError(str(e)) from None


def _warn_64_bit(specs: list[Any]) -> None:
    """Without x64, JAX traces 64-bit inputs as 32-bit: say so (a warning, on stderr)."""
    import jax

    if jax.config.read("jax_enable_x64"):
        return
    from .._util.specs import describe

    for spec in specs:
        if _is_64_bit(spec):
            print(
                f"hookax: warning: input {describe(spec)} asks for 64-bit values but JAX runs "
                "without x64, so it is traced as 32-bit; set JAX_ENABLE_X64=1 to keep 64 bits",
                file=sys.stderr,
            )


def _is_64_bit(spec: Any) -> bool:
    dtype = getattr(spec, "dtype", None)
    return getattr(dtype, "itemsize", 0) == 8 and getattr(dtype, "kind", "x") in "fiuc"


def _as_32_bit(tree: Any) -> Any:
    """Without x64, 64-bit input specs as the 32-bit ones JAX traces (said by
    :func:`_warn_64_bit`; JAX 0.12 also warns for each, an error under ``-W error``)."""
    import jax
    import jax.numpy as jnp

    if jax.config.read("jax_enable_x64"):
        return tree

    def narrow(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) and _is_64_bit(x):
            dtype = {"f": jnp.float32, "i": jnp.int32, "u": jnp.uint32, "c": jnp.complex64}
            return jax.ShapeDtypeStruct(x.shape, dtype[x.dtype.kind])
        return x

    return jax.tree.map(narrow, tree)


# What the running command entered for its model (a model's own mesh), left when it ends.
MODEL_CONTEXT: list[contextlib.ExitStack] = []


def _enter_model_mesh(model: Any) -> None:
    """A model that carries its device mesh (``model.mesh``, as EasyDeL's and MaxText's models
    do; their layers shard by the mesh in context) runs inside it, as its own code does."""
    import jax

    mesh = getattr(model, "mesh", None) if not isinstance(model, type) else None
    if isinstance(mesh, jax.sharding.Mesh) and MODEL_CONTEXT:
        import warnings

        # `with mesh:`, as these codebases enter it (their layers read the mesh it sets; newer
        # JAX calls that form deprecated).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            MODEL_CONTEXT[-1].enter_context(mesh)


def load_model(args: argparse.Namespace, *, abstract: bool) -> LoadedModel:
    """The model the options name (abstract when asked: nothing weights-sized allocated)."""
    import jax

    if (args.factory is None) == (args.example is None):
        raise UsageError(
            "give either a factory (package.module:function or file.py:function) or --example NAME"
        )
    kwargs = _kwargs(getattr(args, "kw", []))
    if args.example is not None:
        from .. import examples

        try:
            ex = examples.load(args.example)
        except KeyError:
            raise UsageError(
                f"unknown example {args.example!r}; choose one of: {', '.join(examples.NAMES)}"
            ) from None
        inputs = _inputs(args, ex.example_inputs())
        if args.example in examples.PROGRAMS:
            build: Callable[[], Any] = ex.make_program
        else:
            from flax import nnx

            build = lambda: ex.make_model(nnx.Rngs(0))  # noqa: E731
        name, int_high = args.example, getattr(ex, "INT_HIGH", 2)
    else:
        build = _load_factory(args.factory)
        inputs = _inputs(args, ()) if not args.input and not args.kw else _inputs(args, None)
        name, int_high = args.factory, 2
    _warn_64_bit(jax.tree.leaves((inputs, kwargs)))
    inputs, kwargs = _as_32_bit((inputs, kwargs))
    model = _build(build, name, abstract)
    program = _program(model)
    if program is not None:  # a program without modules and its leading arguments
        return LoadedModel(program[0], (*program[1], *inputs), kwargs, name, int_high, True)
    if args.factory is not None and not inputs and not kwargs:
        _inputs(args, None)  # a module needs its input: say how to give it
    from .._engine.adapters import adapter_for
    from .._summary.haiku import is_transformed

    import_nnx = sys.modules.get("flax.nnx")
    is_nnx = import_nnx is not None and isinstance(model, import_nnx.Module)
    if not is_nnx and adapter_for(model) is None and not is_transformed(model):
        raise UsageError(
            f"{name!r} returned {type(model).__name__}, not a Flax NNX, Flax Linen or "
            "Equinox module, a Haiku transform (hk.transform(forward)), nor a function with its "
            "arguments (forward, weights)"
        )
    _enter_model_mesh(model)
    return LoadedModel(model, inputs, kwargs, name, int_high)


def _program(made: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """``(function, its leading arguments)`` where a factory returned a program without modules
    as a tuple ``(forward, weights, ...)``; None for anything else."""
    from .._engine.adapters import adapter_for
    from .._summary.haiku import is_transformed

    if not isinstance(made, tuple) or not made or is_transformed(made):  # hk.transform's tuple
        return None
    fn = made[0]
    if not callable(fn) or isinstance(fn, type) or adapter_for(fn) is not None:
        return None
    return fn, made[1:]


def load_nnx_or_equinox(args: argparse.Namespace, does: str, *, linen: bool = False) -> LoadedModel:
    """:func:`load_model` with its arrays, for commands that run Flax NNX and Equinox models
    (``--eval``: NNX ``.eval()``, Equinox ``inference_mode``); a Linen model is refused unless
    ``linen`` (then it is returned unbound: :func:`bind_linen` gives it variables)."""
    loaded = load_model(args, abstract=False)
    nnx, eqx = sys.modules.get("flax.nnx"), sys.modules.get("equinox")
    nn = sys.modules.get("flax.linen")
    if nnx is not None and isinstance(loaded.model, nnx.Module):
        if args.eval:
            loaded.model.eval()
    elif eqx is not None and isinstance(loaded.model, eqx.Module):
        if args.eval:
            loaded.model = eqx.nn.inference_mode(loaded.model)
    elif linen and nn is not None and isinstance(loaded.model, nn.Module):
        if args.eval:
            raise UsageError(
                f"--eval: a Linen model has no mode to switch ({loaded.name!r} is a "
                f"{type(loaded.model).__name__}); pass its own argument instead, e.g. "
                f"--kw deterministic=true"
            )
    elif loaded.program:
        raise UsageError(
            f"{does} Flax NNX and Equinox models; {loaded.name!r} is a program without modules "
            "(hookax summary takes it)"
        )
    else:
        raise UsageError(
            f"{does} Flax NNX and Equinox models; {loaded.name!r} is a "
            f"{type(loaded.model).__name__} (hookax summary and hookax ops take it)"
        )
    return loaded


def check_call(
    loaded: LoadedModel, method: str = "__call__", kwargs: dict[str, Any] | None = None
) -> None:
    """Refuse, before any work, a ``--method`` the model does not have, or ``--input`` and
    ``--kw`` that its method does not take (``kwargs``: those it is called with)."""
    kwargs = loaded.kwargs if kwargs is None else kwargs
    if loaded.program:
        problem = function_problem(loaded.model, method, loaded.args, kwargs)
    else:
        problem = call_problem(loaded.model, method, loaded.args, kwargs)
    if problem is not None:
        raise UsageError(problem)


def command_error(e: Exception, loaded: LoadedModel, where: str | None = None) -> UsageError:
    """The one-line error for ``e``, raised while a command ran the model: a ``--where`` that
    selects nothing, another hookax error (in the command's flags), or an exception of the
    model's run (:func:`~hookax._cli.failures.model_failed`)."""
    from .._util.errors import HookaxError, SelectorError

    if isinstance(e, SelectorError):
        return UsageError(where_error(where, _first_line(e)))
    if isinstance(e, HookaxError):
        return UsageError(in_flags(_first_line(e)))
    return UsageError(model_failed(e, loaded))


def bind_linen(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any], seed: int) -> Any:
    """A Linen module bound to variables initialised (``model.init``) for these inputs; any other
    model unchanged."""
    nn = sys.modules.get("flax.linen")
    if nn is None or not isinstance(model, nn.Module):
        return model
    import jax

    variables = jax.jit(lambda k, *a: model.init(k, *a, **kwargs))(jax.random.key(seed), *inputs)
    return model.bind(variables)


def _build(build: Callable[[], Any], name: str, abstract: bool) -> Any:
    """Call the factory once: abstractly (``jax.eval_shape``, nothing allocated) or inside one
    ``jax.jit`` (one compile, not one per initializer). Only a factory that cannot be traced
    (it converts an array to a Python value) is called again, plainly."""
    import jax

    try:
        return _traced_build(build, jax.eval_shape if abstract else lambda f: jax.jit(f)())
    except Exception as e:
        if type(e).__name__ not in _TRACING_ERRORS:
            raise UsageError(
                f"factory {name!r} raised {type(e).__name__}: {_first_line(e)}"
            ) from None
    try:
        return build()
    except Exception as e:
        raise UsageError(f"factory {name!r} raised {type(e).__name__}: {_first_line(e)}") from None


def _traced_build(build: Callable[[], Any], transform: Callable[[Any], Any]) -> Any:
    """``build()`` under ``transform``: its arrays cross it, the rest of it is kept aside."""
    import jax

    kept: dict[str, Any] = {}

    def arrays() -> list[Any]:
        made = build()
        nnx = sys.modules.get("flax.nnx")
        if nnx is not None and isinstance(made, nnx.Module):
            graphdef, state = nnx.split(made)
            kept["rebuild"] = lambda state: nnx.merge(graphdef, state)
            return state
        leaves, treedef = jax.tree.flatten(made)
        mask = [isinstance(x, jax.Array) for x in leaves]
        others = [x for x, m in zip(leaves, mask) if not m]

        def rebuild(arrays: list[Any]) -> Any:
            a, o = iter(arrays), iter(others)
            return jax.tree.unflatten(treedef, [next(a) if m else next(o) for m in mask])

        kept["rebuild"] = rebuild
        return [x for x, m in zip(leaves, mask) if m]

    made = transform(arrays)
    return kept["rebuild"](made)


def _model(args: argparse.Namespace, *, abstract: bool) -> tuple[Any, tuple[Any, ...], int]:
    """The model, its positional input specs and the bound of random integer inputs."""
    loaded = load_model(args, abstract=abstract)
    return loaded.model, loaded.args, loaded.int_high


# ---------------------------------------------------------------------------------------------
# hookax summary


def _summary_arguments(c: argparse.ArgumentParser) -> None:
    add_model_arguments(c)
    c.add_argument("--depth", type=int, help="fold rows deeper than this")
    c.add_argument(
        "--format",
        choices=("table", "json", "markdown"),
        default="table",
        help="how to print it (default: table)",
    )
    c.add_argument("--json", action="store_true", help="the same as --format json")
    c.add_argument("--method", default="__call__", help="the method to summarise")
    c.add_argument(
        "--variables", action="store_true", help="list each module's variables and shapes"
    )


def _summary(args: argparse.Namespace) -> None:
    from .._summary.summary import summary
    from .._util.errors import HookaxError

    if args.depth is not None and args.depth < 0:
        raise UsageError(f"--depth takes an integer >= 0, got {args.depth}")
    loaded = load_model(args, abstract=True)
    kwargs = dict(loaded.kwargs)
    train = kwargs.pop("train", None)  # hx.summary passes it on to a model that takes it
    if not isinstance(train, bool | None):
        raise UsageError(f"--kw train takes true or false, got {train!r}")
    check_call(loaded, args.method, kwargs)
    try:
        s = summary(
            loaded.model,
            *loaded.args,
            depth=args.depth,
            method=args.method,
            train=False if args.eval else train,
            variables=args.variables,
            **kwargs,
        )
    except HookaxError as e:
        raise UsageError(in_flags(_first_line(e))) from None
    except Exception as e:
        raise UsageError(model_failed(e, loaded)) from None
    fmt = "json" if args.json else args.format
    if fmt == "table":  # at the terminal's width, in colour on a terminal
        from .._util.display import echo

        echo(s.__rich__())
        return
    print(s.to_json() if fmt == "json" else s.to_markdown())


register(
    Command(
        "summary",
        "one row per call site: shapes, parameters by collection, FLOPs, memory",
        _summary_arguments,
        _summary,
    )
)

# ---------------------------------------------------------------------------------------------
# hookax gradflow


def _gradflow_arguments(c: argparse.ArgumentParser) -> None:
    add_model_arguments(c)
    c.add_argument("--out", default="gradflow.png", help="the PNG to write")
    c.add_argument("--seed", type=int, default=0, help="seed of the random input")
    c.add_argument(
        "--where",
        help='which call sites get a bar (a glob like "layers/*" or "**/mlp"); default all',
    )


def _gradflow(args: argparse.Namespace) -> None:
    from .._diagnostics.gradflow import check_writable, grad_flow, plot_grad_flow, random_inputs

    try:
        check_writable(args.out)
    except OSError as e:
        raise UsageError(f"cannot write {args.out!r}: {e.strerror or e}") from None
    loaded = load_nnx_or_equinox(args, "gradflow plots", linen=True)
    check_call(loaded)
    inputs = random_inputs(loaded.args, args.seed, loaded.int_high)
    kwargs = _concrete_kwargs(loaded.kwargs, args.seed)
    try:
        model = bind_linen(loaded.model, inputs, kwargs, args.seed)
        flow = grad_flow(model, *inputs, where=args.where, **kwargs)
    except Exception as e:
        raise command_error(e, loaded, args.where) from None
    if not flow.outputs and not flow.params:
        raise UsageError("no call site reached the loss: nothing to plot")
    try:
        plot_grad_flow(flow, args.out, title=f"gradient flow: {loaded.name}")
    except OSError as e:
        raise UsageError(f"cannot write {args.out!r}: {e.strerror or e}") from None
    width = max(len(k) for k in [*flow.outputs, *flow.params])
    print("d loss / d (layer output), 2-norm:")
    for key, value in flow.outputs.items():
        print(f"  {key:<{width}}  {value:.4e}")
    if flow.params:
        print("d loss / d (parameters), mean and max of |g|:")
        for key, (mean, top) in flow.params.items():
            print(f"  {key:<{width}}  {mean:.4e}  {top:.4e}")
    sites = counted(len(flow.outputs), "call site")
    print(f"wrote {args.out} ({sites}, {len(flow.params)} with parameters)")


def _concrete_kwargs(kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    import jax

    from .._diagnostics.gradflow import random_inputs

    leaves, treedef = jax.tree.flatten(kwargs)
    return jax.tree.unflatten(treedef, list(random_inputs(tuple(leaves), seed + 1)))


register(
    Command(
        "gradflow",
        "gradients of one backward pass per layer (outputs and parameters), as a PNG figure",
        _gradflow_arguments,
        _gradflow,
    )
)
