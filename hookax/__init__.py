"""hookax: PyTorch-style hooks, interceptors and activation capture for JAX models.

The public API is the names in ``__all__``; everything else lives in private modules.

>>> import hookax as hx
>>> hx.__version__ != ""
True
"""

from importlib import metadata as _metadata

from ._actgrad import value_and_grad as value_and_grad
from ._capture import capture as capture
from ._context import Context as Context
from ._errors import HookaxError as HookaxError
from ._errors import HookError as HookError
from ._errors import SelectorError as SelectorError
from ._grad import hook_grad as hook_grad
from ._gradflow import GradFlow as GradFlow
from ._gradflow import grad_flow as grad_flow
from ._gradflow import layer_grad_norms as layer_grad_norms
from ._gradflow import plot_grad_flow as plot_grad_flow
from ._harvest import harvest as harvest
from ._hooks import HookHandle as HookHandle
from ._hooks import hooks as hooks
from ._hooks import register_forward_hook as register_forward_hook
from ._hooks import register_forward_pre_hook as register_forward_pre_hook
from ._hooks import register_full_backward_hook as register_full_backward_hook
from ._hooks import register_full_backward_pre_hook as register_full_backward_pre_hook
from ._hooks import remove_hooks as remove_hooks
from ._intercept import Interceptor as Interceptor
from ._intercept import intercept as intercept
from ._ops import OpRow as OpRow
from ._ops import intercept_op as intercept_op
from ._ops import named_scopes as named_scopes
from ._opslist import Ops as Ops
from ._opslist import ops as ops
from ._optrace import OpContext as OpContext
from ._select import Select as Select
from ._select import Selector as Selector
from ._summary import Memory as Memory
from ._summary import Summary as Summary
from ._summary import SummaryRow as SummaryRow
from ._summary import SummaryTotals as SummaryTotals
from ._summary import summary as summary
from .frameworks import StaleTraceWarning as StaleTraceWarning
from .frameworks import ensure_installed as _ensure_installed
from .frameworks import key_linen_interceptors as key_linen_interceptors

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
