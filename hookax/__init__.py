"""hookax: PyTorch-style hooks, interceptors and activation capture for JAX models.

>>> import hookax as hx
"""

from importlib.metadata import PackageNotFoundError, version

from ._context import Context as Context
from ._errors import HookaxError as HookaxError
from ._errors import HookError as HookError
from ._errors import SelectorError as SelectorError
from ._grad import hook_grad as hook_grad
from ._hooks import HookHandle as HookHandle
from ._hooks import hooks as hooks
from ._hooks import register_forward_hook as register_forward_hook
from ._hooks import register_forward_pre_hook as register_forward_pre_hook
from ._hooks import register_full_backward_hook as register_full_backward_hook
from ._hooks import register_full_backward_pre_hook as register_full_backward_pre_hook
from ._hooks import remove_hooks as remove_hooks
from ._intercept import Interceptor as Interceptor
from ._intercept import intercept as intercept
from ._select import Select as Select
from ._select import Selector as Selector
from ._summary import Summary as Summary
from ._summary import SummaryRow as SummaryRow
from ._summary import SummaryTotals as SummaryTotals
from ._summary import summary as summary

try:
    __version__ = version("hookax")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"
from ._actgrad import value_and_grad as value_and_grad
from ._capture import capture as capture
from .frameworks import StaleTraceWarning as StaleTraceWarning
from .frameworks import ensure_installed as _ensure_installed
from .frameworks import key_linen_interceptors as key_linen_interceptors

_ensure_installed()  # adapters of frameworks imported already (none is imported here)
