"""hookax: PyTorch-style hooks, interceptors and activation capture for JAX models.

The public API is the names in ``__all__``; everything else lives in private modules.

>>> import hookax as hx
>>> hx.__version__ != ""
True
"""

from importlib import metadata as _metadata

from ._capture.actgrad import value_and_grad
from ._capture.capture import capture
from ._capture.ops import OpRow, intercept_op, named_scopes
from ._capture.opslist import Ops, ops
from ._diagnostics.gradflow import GradFlow, grad_flow, layer_grad_norms, plot_grad_flow
from ._engine.adapters import StaleTraceWarning, key_linen_interceptors
from ._engine.adapters import ensure_installed as _ensure_installed
from ._engine.context import Context
from ._engine.select import Select, Selector
from ._harvest.harvest import harvest
from ._hooks.grad import hook_grad
from ._hooks.hooks import (
    HookHandle,
    hooks,
    register_forward_hook,
    register_forward_pre_hook,
    register_full_backward_hook,
    register_full_backward_pre_hook,
    remove_hooks,
)
from ._hooks.intercept import Interceptor, intercept
from ._summary.summary import Memory, Summary, SummaryRow, SummaryTotals, summary
from ._transforms.optrace import OpContext
from ._util.errors import HookaxError, HookError, SelectorError

try:
    __version__ = _metadata.version("hookax")
except _metadata.PackageNotFoundError:  # pragma: no cover - a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "Context",
    "GradFlow",
    "HookError",
    "HookHandle",
    "HookaxError",
    "Interceptor",
    "Memory",
    "OpContext",
    "OpRow",
    "Ops",
    "Select",
    "Selector",
    "SelectorError",
    "StaleTraceWarning",
    "Summary",
    "SummaryRow",
    "SummaryTotals",
    "capture",
    "grad_flow",
    "harvest",
    "hook_grad",
    "hooks",
    "intercept",
    "intercept_op",
    "key_linen_interceptors",
    "layer_grad_norms",
    "named_scopes",
    "ops",
    "plot_grad_flow",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "remove_hooks",
    "summary",
    "value_and_grad",
]

_ensure_installed()  # adapters of frameworks imported already (none is imported here)
