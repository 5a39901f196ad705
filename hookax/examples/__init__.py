"""Built-in example models for ``hookax summary --example NAME`` and ``hookax gradflow``.

Each example module defines ``make_model(rngs)`` (a Flax NNX model) and ``example_inputs()``
(a tuple of ``jax.ShapeDtypeStruct``, the default input). The examples in :data:`PROGRAMS` are
programs without modules (functions over a weight pytree, plain JAX): they define
``make_program()``, returning the function and its weights, in place of ``make_model``.
Importing this package imports no framework; :func:`load` imports one example. The example
models import nothing of hookax; ``induction`` (a model trained here, and the circuit hookax
finds in it) may import :mod:`hookax._patching`, :mod:`hookax._interp`, :mod:`hookax._circuits`
and the layers below them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["NAMES", "PROGRAMS", "load"]

NAMES: tuple[str, ...] = ("cnn", "mlp", "resnet", "transformer", "llama_functions")
PROGRAMS: tuple[str, ...] = ("llama_functions",)


def load(name: str) -> ModuleType:
    """The example module ``name`` (one of :data:`NAMES`); KeyError for any other name."""
    if name not in NAMES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")
