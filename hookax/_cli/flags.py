"""The library's errors in the words of the command line: the flags that stand for hookax's
keyword arguments (``--out`` for ``store=``, ``--where`` for ``where=``, ...).

The library's messages stay as they are (a Python user reads them); the command line rewrites
them here, on their way to stderr.

Examples:
  >>> in_flags(
  ...     "hx.harvest: store='a' is a file. Fix: pass a where= that matches, or overwrite=True."
  ... )
  "--out 'a' is a file. Fix: pass a --where that matches, or --overwrite."
  >>> in_flags("hx.value_and_grad(where='x') matched no call site")
  "--where 'x' matched no call site"
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

__all__ = ["call_problem", "function_problem", "in_flags", "public_methods", "where_error"]

# keyword argument -> flag
FLAGS = {
    "store": "--out",
    "where": "--where",
    "row_axes": "--row-axes",
    "dtype": "--dtype",
    "method": "--method",
    "overwrite": "--overwrite",
}

_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^hx\.\w+: "), ""),
    # hx.harvest(where='x') matched no call site ...
    (re.compile(r"\bhx\.\w+\(where=((?:'[^']*'|\"[^\"]*\"|None))\)"), r"--where \1"),
    (
        re.compile(
            r"a store is resumed only by a run with the same model, where=, dtype=, mask= "
            r"and metadata="
        ),
        "a store is resumed only by the same command: the same model, --where, --dtype, --input, "
        "--kw, --eval, --seed and --tokens",
    ),
    (re.compile(r"\bthe store (?=['\"])"), "--out "),
    (re.compile(r"\brun again with the same arguments\b"), "run the same command again"),
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r"\bstore=PATH\b"), "--out PATH"),
]
for _name, _flag in FLAGS.items():
    # with a value (store='a', row_axes=3) the flag takes it after a space; alone (a where=
    # that ...) it is the flag's name
    _RULES.append((re.compile(rf"\b{_name}=(?=['\"\w(\[.])"), f"{_flag} "))
    _RULES.append((re.compile(rf"\b{_name}="), _flag))
_RULES.append((re.compile(r"\brow_axes\b"), "--row-axes"))


def in_flags(message: str) -> str:
    """``message`` of a hookax error in the words of the command line (its flags)."""
    for pattern, flag in _RULES:
        message = pattern.sub(flag, message)
    return message


def where_error(where: str | None, message: str) -> str:
    """A ``--where`` error: the message in flags, led by the flag unless it names it."""
    text = in_flags(message)
    return text if "--where" in text else f"--where {where!r}: {text}"


# ---------------------------------------------------------------------------------------------
# --method, --input and --kw against the model's method, before any work


def _framework_bases() -> set[type]:
    """The classes every Flax NNX, Flax Linen or Equinox module inherits (their methods are
    the framework's, not the model's)."""
    out: set[type] = {object}
    for module, attr in (("flax.nnx", "Module"), ("flax.linen", "Module"), ("equinox", "Module")):
        if (m := sys.modules.get(module)) is not None:
            out.update(getattr(m, attr).__mro__)
    return out


def public_methods(cls: type) -> list[str]:
    """The methods of a model's class that take inputs: ``__call__`` and the public ones its
    classes define (not those every Flax or Equinox module has, nor Linen's ``setup``)."""
    names: set[str] = set()
    bases = _framework_bases()
    fields = getattr(cls, "__dataclass_fields__", {})  # Linen's and Equinox's attributes
    for klass in cls.__mro__:
        if klass in bases:
            continue
        for name, value in vars(klass).items():
            if not inspect.isfunction(value) or name in fields:
                continue
            if name == "__call__" or not name.startswith("_"):
                names.add(name)
    names.discard("setup")
    return sorted(names, key=lambda n: (n != "__call__", n))


def call_problem(
    model: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """What is wrong with calling ``model.method(*args, **kwargs)``, in the command's flags
    (``--method``, ``--input``, ``--kw``); None when nothing is."""
    from .._summary.haiku import is_transformed, original_fn

    if is_transformed(model):  # the function hk.transform was given is what runs
        fn = original_fn(model)
        if method != "__call__":
            return f"--method {method!r}: a Haiku transform runs its function; leave --method out"
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
            return None
        return _argument_problem(f"{getattr(fn, '__name__', 'forward')}{sig}", sig, args, kwargs)
    name = type(model).__name__
    methods = public_methods(type(model))
    private = method.startswith("_") and method != "__call__"
    if private or not callable(getattr(model, method, None)):
        has = ", ".join(methods) or "none"
        return f"--method {method!r}: {name} has no public method {method!r}; its methods: {has}"
    try:
        sig = inspect.signature(getattr(model, method))
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return None
    plain = sig.replace(
        parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
        return_annotation=sig.empty,
    )
    return _argument_problem(f"{name}.{method}{plain}", sig, args, kwargs)


def function_problem(
    fn: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """What is wrong with calling a program without modules, ``fn(*args, **kwargs)`` (its
    leading arguments from the factory, then the ``--input``\\ s), in the command's flags."""
    name = getattr(fn, "__name__", type(fn).__name__)
    if method != "__call__":
        return f"--method {method!r}: {name} is a function (a program without modules)"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return None
    plain = sig.replace(
        parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
        return_annotation=sig.empty,
    )
    return _argument_problem(f"{name}{plain}", sig, args, kwargs)


def _argument_problem(
    shown: str, sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    kinds = inspect.Parameter
    params = sig.parameters
    positional = [
        p for p in params.values() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    var_args = any(p.kind is kinds.VAR_POSITIONAL for p in params.values())
    var_kwargs = any(p.kind is kinds.VAR_KEYWORD for p in params.values())
    keywords = [
        p.name
        for p in params.values()
        if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    ]
    for key in kwargs:
        p = params.get(key)
        if (p is None or p.kind is kinds.POSITIONAL_ONLY) and not var_kwargs:
            return (
                f"--kw {key}: {shown} has no argument {key!r}; its keyword arguments: "
                f"{', '.join(keywords) or 'none'}"
            )
    if len(args) > len(positional) and not var_args:
        n = len(positional)
        return f"{shown} takes {n} input{'' if n == 1 else 's'}, got {len(args)} --input"
    for p in positional[: len(args)]:
        if p.name in kwargs:
            return f"--kw {p.name}: {p.name} is given by an --input already"
    for p in list(params.values())[len(args) :]:
        if p.default is not p.empty or p.name in kwargs:
            continue
        if p.kind is kinds.KEYWORD_ONLY:
            return f"{shown} needs {p.name}: add --kw {p.name}=VALUE"
        if p.kind is kinds.POSITIONAL_OR_KEYWORD or p.kind is kinds.POSITIONAL_ONLY:
            return f"{shown} needs its input {p.name}: add --input SPEC (or --kw {p.name}=SPEC)"
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:  # pragma: no cover - every case above
        return f"{shown}: {e}"
    return None
