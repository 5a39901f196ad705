"""The parity tests need torch and TransformerLens (``nox -s parity`` installs them in a venv of
its own): where either is missing, nothing here is collected, the doctest collection of these
modules included, so the normal suite runs without them."""

import importlib.util

_MISSING = [m for m in ("torch", "transformer_lens") if importlib.util.find_spec(m) is None]
collect_ignore_glob = ["*.py"] if _MISSING else []
