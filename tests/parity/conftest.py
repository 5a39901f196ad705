"""The parity tests need torch and TransformerLens (``nox -s parity`` and ``nox -s parity_bridge``
install them in venvs of their own): where either is missing, nothing here is collected, the
doctest collection of these modules included, so the normal suite runs without them. Where
TransformerLens has no ``HookedTransformer`` (4.x), the modules built on it are not collected
either; ``test_bridge.py`` checks its ``TransformerBridge`` and skips where that is not 4.x."""

import importlib.util


def _found(module: str) -> bool:
    try:  # a submodule's find_spec imports its package
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


_MISSING = [m for m in ("torch", "transformer_lens") if not _found(m)]
if _MISSING:
    collect_ignore_glob = ["*.py"]
elif not _found("transformer_lens.HookedTransformer"):  # TransformerLens 4 removed it
    collect_ignore = ["compare.py", "report.py", "test_transformer_lens.py"]
