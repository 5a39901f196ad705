"""Optional dependencies: an error that names the extra to install, raised before any work.

``pip install hookax`` brings JAX and rich; each framework and the plots come with an extra
(``hookax[nnx]``, ``hookax[linen]``, ``hookax[equinox]``, ``hookax[plot]``). Code that needs one
calls :func:`require` first, so a missing package is reported with the command that fixes it,
not as a traceback from deep inside (or after minutes of computing gradients).

Examples:
  >>> require("json", "nnx", "hx.layer_grad_norms")  # present: nothing happens
  >>> require("no_such_package_xyz", "plot", "hx.plot_grad_norms")
  Traceback (most recent call last):
  ...
  hookax._util.extras.MissingExtraError: hx.plot_grad_norms needs the Python package ...
  Install it with: pip install "hookax[plot]"
"""

from __future__ import annotations

import importlib

__all__ = ["MissingExtraError", "require"]


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency of the feature in use is missing; the message names the extra."""


def require(module: str, extra: str, feature: str) -> None:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``pip install "hookax[extra]"``.

    Args:
        module: the importable name of the optional package (``"flax"``, ``"matplotlib"``).
        extra: the hookax extra that installs it (``"nnx"``, ``"plot"``).
        feature: what the user called, for the message (``"hookax gradflow"``).
    """
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:  # installed, but something it imports is missing: not ours to name
            raise
        raise MissingExtraError(
            f"{feature} needs the Python package {module!r}, which is not installed. "
            f'Install it with: pip install "hookax[{extra}]"',
            name=module,
        ) from e
