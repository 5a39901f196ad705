"""Optional dependencies: an error that names the install to run, raised before any work.

``pip install hookax`` brings JAX and rich; each framework and the plots come with an extra
(``hookax[nnx]``, ``hookax[linen]``, ``hookax[equinox]``, ``hookax[plot]``). Code that needs one
calls :func:`require` first, so a missing package is reported with the command that fixes it,
not as a traceback from deep inside (or after minutes of computing gradients).

The command is the one that works for this installation: hookax installed from a checkout
(``pip install -e .``) gets ``pip install -e "/path/to/checkout[plot]"``, from a wheel file
``pip install "/path/to/hookax-0.1.0-py3-none-any.whl[plot]"``, from a package index
``pip install "hookax[plot]"`` (pip records where a package came from in ``direct_url.json``).

Examples:
  >>> require("json", "nnx", "hx.layer_grad_norms")  # present: nothing happens
  >>> require("no_such_package_xyz", "plot", "hx.plot_grad_norms")
  Traceback (most recent call last):
  ...
  hookax._util.extras.MissingExtraError: hx.plot_grad_norms needs the Python package ...
  Install it with: pip install ...[plot]"
"""

from __future__ import annotations

import importlib
import json
from importlib import metadata
from urllib.parse import unquote, urlparse

__all__ = ["MissingExtraError", "install_command", "require"]


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency of the feature in use is missing; the message names the extra."""


def install_command(extra: str, origin: dict | None = None) -> str:
    """The ``pip install`` that adds hookax's ``extra`` to this installation.

    Args:
        extra: the extra's name (``"plot"``).
        origin: pip's ``direct_url.json`` of the installed hookax (PEP 610); None reads it.

    Examples:
      >>> install_command("plot", {"url": "file:///src/hookax", "dir_info": {"editable": True}})
      'pip install -e "/src/hookax[plot]"'
      >>> install_command("nnx", {"url": "file:///tmp/hookax-0.1.0-py3-none-any.whl",
      ...                         "archive_info": {}})
      'pip install "/tmp/hookax-0.1.0-py3-none-any.whl[nnx]"'
      >>> install_command("nnx", {})  # from a package index
      'pip install "hookax[nnx]"'
    """
    origin = _origin() if origin is None else origin
    url = urlparse(origin.get("url", ""))
    if url.scheme != "file":  # a package index (no record), or a VCS or remote URL
        return f'pip install "hookax[{extra}]"'
    path = unquote(url.path)
    editable = "-e " if origin.get("dir_info", {}).get("editable") else ""
    return f'pip install {editable}"{path}[{extra}]"'


def _origin() -> dict:
    try:
        text = metadata.distribution("hookax").read_text("direct_url.json")
        return json.loads(text) if text else {}
    except (metadata.PackageNotFoundError, ValueError):
        return {}


def require(module: str, extra: str, feature: str) -> None:
    """Import ``module`` or raise :class:`MissingExtraError` naming the ``pip install`` of
    ``extra`` that works for this installation (:func:`install_command`).

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
            f"Install it with: {install_command(extra)}",
            name=module,
        ) from e
