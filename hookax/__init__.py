"""hookax: PyTorch-style hooks, interceptors and activation capture for JAX models.

The public API is the names in ``__all__``; everything else lives in private modules.

Examples:
  >>> import hookax as hx
  >>> hx.__version__ != ""
  True
"""

# First, before JAX loads: in the `hookax` command, Ctrl-C is one line and exit 130, never a crash
from ._cli import interrupt as _interrupt

if _interrupt.running_as_command():
    _interrupt.install()

from importlib import metadata as _metadata

from ._capture.actgrad import value_and_grad as value_and_grad
from ._capture.capture import capture as capture
from ._capture.ops import OpRow as OpRow
from ._capture.ops import intercept_op as intercept_op
from ._capture.ops import named_scopes as named_scopes
from ._capture.opslist import Ops as Ops
from ._capture.opslist import ops as ops
from ._circuits.attribute import edge_attribution as edge_attribution
from ._circuits.circuit import faithfulness as faithfulness
from ._circuits.circuit import prune_edges as prune_edges
from ._circuits.circuit import run_circuit as run_circuit
from ._circuits.edges import Edges as Edges
from ._circuits.paths import path_patch as path_patch
from ._diagnostics.gradflow import GradFlow as GradFlow
from ._diagnostics.gradflow import grad_flow as grad_flow
from ._diagnostics.gradflow import layer_grad_norms as layer_grad_norms
from ._diagnostics.gradflow import plot_grad_flow as plot_grad_flow
from ._diagnostics.logger import StatsLogger as StatsLogger
from ._diagnostics.logger import read_events as read_events
from ._diagnostics.nonfinite import Nonfinite as Nonfinite
from ._diagnostics.nonfinite import find_nonfinite as find_nonfinite
from ._diagnostics.profile import profile as profile
from ._diagnostics.profview import Profile as Profile
from ._diagnostics.profview import ProfileRow as ProfileRow
from ._diagnostics.stats import value_grad_and_stats as value_grad_and_stats
from ._diagnostics.statsplot import plot_stats as plot_stats
from ._diagnostics.statsview import SiteStats as SiteStats
from ._diagnostics.statsview import Stats as Stats
from ._diagnostics.values import Values as Values
from ._diagnostics.values import show as show
from ._engine.adapters import StaleTraceWarning as StaleTraceWarning
from ._engine.adapters import ensure_installed as _ensure_installed
from ._engine.adapters import key_linen_interceptors as key_linen_interceptors
from ._engine.context import Context as Context
from ._engine.firstcall import first_call as first_call
from ._engine.select import Select as Select
from ._engine.select import Selector as Selector
from ._engine.select import Where as Where
from ._harvest.harvest import harvest as harvest
from ._harvest.opened import ActivationStore as ActivationStore
from ._harvest.opened import open_store as open_store
from ._harvest.reader import StoreReader as StoreReader
from ._harvest.splice import Splice as Splice
from ._harvest.splice import splice_eval as splice_eval
from ._harvest.tokens import token_batches as token_batches
from ._hooks import hookrun as _hookrun  # noqa: F401 (fills the dispatcher's hooks slot)
from ._hooks import layergate as _layergate  # noqa: F401 (one layer of a scan: the gate)
from ._hooks.grad import hook_grad as hook_grad
from ._hooks.hooks import HookHandle as HookHandle
from ._hooks.hooks import hooks as hooks
from ._hooks.hooks import register_forward_hook as register_forward_hook
from ._hooks.hooks import register_forward_pre_hook as register_forward_pre_hook
from ._hooks.hooks import register_full_backward_hook as register_full_backward_hook
from ._hooks.hooks import register_full_backward_pre_hook as register_full_backward_pre_hook
from ._hooks.hooks import remove_hooks as remove_hooks
from ._hooks.intercept import Interceptor as Interceptor
from ._hooks.intercept import intercept as intercept
from ._interp.components import Components as Components
from ._interp.names import Name as Name
from ._interp.names import Names as Names
from ._interp.names import names as names
from ._interp.names import transformer_names as transformer_names
from ._interp.resid import ResidualStream as ResidualStream
from ._interp.stack import Stack as Stack
from ._interp.sweeps import patch_block_every as patch_block_every
from ._interp.sweeps import patch_head_every as patch_head_every
from ._patching.attribution import attribution_patch as attribution_patch
from ._patching.cache import logit_lens as logit_lens
from ._patching.cache import split_heads as split_heads
from ._patching.cache import stack_layers as stack_layers
from ._patching.grid import patch_grid as patch_grid
from ._patching.labelled import LabelledArray as LabelledArray
from ._patching.patch import PatchError as PatchError
from ._patching.patch import patching as patching
from ._summary.summary import Memory as Memory
from ._summary.summary import Summary as Summary
from ._summary.summary import SummaryRow as SummaryRow
from ._summary.summary import SummaryTotals as SummaryTotals
from ._summary.summary import summary as summary
from ._transforms.optrace import OpContext as OpContext
from ._util.compcache import compilation_cache as compilation_cache
from ._util.errors import HookaxError as HookaxError
from ._util.errors import HookError as HookError
from ._util.errors import SelectorError as SelectorError
from ._util.errors import StoreError as StoreError
from ._util.fnkey import RecompileWarning as RecompileWarning
from .frameworks._functions import program as program

try:
    __version__ = _metadata.version("hookax")
except _metadata.PackageNotFoundError:  # pragma: no cover - a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "ActivationStore",
    "Components",
    "Context",
    "Edges",
    "GradFlow",
    "HookError",
    "HookHandle",
    "HookaxError",
    "Interceptor",
    "LabelledArray",
    "Memory",
    "Name",
    "Names",
    "Nonfinite",
    "OpContext",
    "OpRow",
    "Ops",
    "PatchError",
    "Profile",
    "ProfileRow",
    "RecompileWarning",
    "ResidualStream",
    "Select",
    "Selector",
    "SelectorError",
    "SiteStats",
    "Splice",
    "Stack",
    "StaleTraceWarning",
    "Stats",
    "StatsLogger",
    "StoreError",
    "StoreReader",
    "Summary",
    "SummaryRow",
    "SummaryTotals",
    "Values",
    "Where",
    "attribution_patch",
    "capture",
    "compilation_cache",
    "edge_attribution",
    "faithfulness",
    "find_nonfinite",
    "first_call",
    "grad_flow",
    "harvest",
    "hook_grad",
    "hooks",
    "intercept",
    "intercept_op",
    "key_linen_interceptors",
    "layer_grad_norms",
    "logit_lens",
    "named_scopes",
    "names",
    "open_store",
    "ops",
    "patch_block_every",
    "patch_grid",
    "patch_head_every",
    "patching",
    "path_patch",
    "plot_grad_flow",
    "plot_stats",
    "profile",
    "program",
    "prune_edges",
    "read_events",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "remove_hooks",
    "run_circuit",
    "show",
    "splice_eval",
    "split_heads",
    "stack_layers",
    "summary",
    "token_batches",
    "transformer_names",
    "value_and_grad",
    "value_grad_and_stats",
]

_ensure_installed()  # adapters of frameworks imported already (none is imported here)
