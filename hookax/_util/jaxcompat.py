"""Every use of JAX internals, in one place, for JAX 0.10.2 through 0.12.x.

hookax rewrites jaxprs (marks leave ``scan``/``cond``/``while``/``remat``/``jit`` as extra
outputs; probes enter them as extra inputs), so it reads and rebuilds the parameters of JAX's
higher-order primitives and runs its own traces. Those names are not public API and they move
between releases. The rest of hookax imports them from here only:

* the public ``jax.extend.core`` names where they exist on every supported release
  (``ClosedJaxpr``, ``Jaxpr``, ``Primitive``, ``Var``, ``Literal``, ``JaxprEqn``,
  ``jaxprs_in_params``, ``jaxpr_as_fun``);
* the private modules (``jax._src.core``, ``partial_eval``, ...) re-exported under the names
  hookax uses, for what has no public form;
* one helper per thing that differs between releases: a closed jaxpr's parts
  (:func:`closed_parts`; JAX 0.12 merged ``ClosedJaxpr`` into ``Jaxpr``, which carries its
  constants), the counts of a scan's inputs (:func:`scan_counts`; 0.12 replaced ``num_consts``,
  ``num_carry`` and ``linear`` by the flat trees ``ft_in``/``ft_out``), a scan with added inputs
  or outputs (:func:`scan_params`), and the flat trees a ``shard_map`` body returns
  (:func:`ft_pack`, :func:`ft_flatten`).

A new JAX release that moves a name breaks this module only; the version table in the README
lists the releases CI runs.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
from jax._src import ad_checkpoint, ad_util, config, core, dispatch, pjit, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax.control_flow import conditionals, loops
from jax.extend.core import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    Primitive,
    Var,
    jaxpr_as_fun,
    jaxprs_in_params,
)

__all__ = [
    "JAX_VERSION",
    "ClosedJaxpr",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Primitive",
    "Tracer",
    "Var",
    "ad",
    "ad_checkpoint",
    "ad_util",
    "as_closed",
    "batching",
    "bind_eqn",
    "closed_parts",
    "conditionals",
    "config",
    "core",
    "dispatch",
    "eqn_context",
    "ft_flatten",
    "ft_pack",
    "invars_to_constvars",
    "jaxpr_as_fun",
    "jaxprs_in_params",
    "jit_inlined",
    "loops",
    "lu",
    "mlir",
    "pe",
    "pjit",
    "register_aval",
    "scan_counts",
    "scan_params",
    "source_info_util",
    "trace_context",
    "treedef_from",
]

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3])

Tracer = core.Tracer
# Every configuration value a trace depends on (JAX's jit caches key on it; hookax's keys too).
trace_context = config.trace_context

# JAX 0.12 folded ClosedJaxpr into Jaxpr: a Jaxpr carries its constants (``.consts``) and
# ``jax.extend.core.ClosedJaxpr`` is Jaxpr itself.
_MERGED = ClosedJaxpr is Jaxpr

# JAX 0.12 describes a scan's inputs and outputs by flat trees (``ft_in``, ``ft_out``).
_ft: Any
try:
    _ft = importlib.import_module("jax._src.flattree")
except ImportError:  # JAX < 0.12
    _ft = None


def closed_parts(jaxpr: Any) -> tuple[Any, list[Any]]:
    """``(open jaxpr, constants)`` of a closed or open jaxpr, for ``core.eval_jaxpr``."""
    return getattr(jaxpr, "jaxpr", jaxpr), list(getattr(jaxpr, "consts", ()))


def as_closed(jaxpr: Any) -> Any:
    """``jaxpr`` as a closed jaxpr (an open one gets no constants)."""
    if _MERGED or isinstance(jaxpr, ClosedJaxpr):
        return jaxpr
    return ClosedJaxpr(jaxpr, ())


def invars_to_constvars(jaxpr: Any, n: int) -> Any:
    """``jaxpr`` with its first ``n`` inputs made constants again (undoing
    ``pe.convert_constvars_jaxpr``); on JAX 0.12, where constants without values are plain
    leading inputs, the jaxpr as it is."""
    if not n or _MERGED:
        return jaxpr
    return pe.convert_invars_to_constvars(jaxpr, n)


def jit_inlined(params: dict) -> bool:
    """Whether a ``jit`` equation is inlined into the enclosing jaxpr while tracing (jax.numpy's
    own functions): ``inline=True`` before JAX 0.12, ``Inline.JAX_EARLY`` since (whose other
    values, ``AUTO`` included, keep the call)."""
    inline = params.get("inline")
    return inline is True or getattr(inline, "value", None) == "jax_early"


def scan_counts(params: dict) -> tuple[int, int, int]:
    """``(consts, carry, xs)``: how many inputs of a ``scan`` equation are loop constants,
    carries and scanned inputs (its outputs are the carries, then the stacked ``ys``)."""
    if "ft_in" in params:
        consts, carry, xs = params["ft_in"].unpack()
        return len(consts), len(carry), len(xs)
    nc, nk = params["num_consts"], params["num_carry"]
    return nc, nk, len(params["jaxpr"].in_avals) - nc - nk


def scan_params(
    params: dict, jaxpr: Any, *, consts: int = 0, xs: int = 0, ys: int = 0, **changes: Any
) -> dict:
    """A ``scan``'s params for the body ``jaxpr``, which takes ``consts`` more loop constants
    in front, ``xs`` more scanned inputs at the end and returns ``ys`` more stacked outputs at
    the end; other params replaced by ``changes`` (``length=``)."""
    p = dict(params, jaxpr=jaxpr, **changes)
    if "ft_in" in params:
        assert _ft is not None
        c_g, k_g, x_g = params["ft_in"].unpack()
        ck_g, y_g = params["ft_out"].unpack()
        p["ft_in"] = _ft.pack((_grow(c_g, consts, front=True), k_g, _grow(x_g, xs)))
        p["ft_out"] = _ft.pack((ck_g, _grow(y_g, ys)))
        return p
    p["num_consts"] = params["num_consts"] + consts
    if "linear" in params:
        p["linear"] = (*[False] * consts, *params["linear"], *[False] * xs)
    return p


def _grow(group: Any, n: int, front: bool = False) -> Any:
    if not n:
        return group
    extra = _ft.nones(n)
    return _ft.pack((extra, group) if front else (group, extra))


def ft_pack(parts: tuple[Any, ...]) -> Any:
    """A tuple of flat trees as one (``shard_map`` bodies return flat trees)."""
    if _ft is not None:
        return _ft.pack(parts)
    from jax._src.tree_util import FlatTree

    return FlatTree.pack(parts)


def ft_flatten(tree: Any) -> Any:
    """A pytree as a flat tree."""
    if _ft is not None:
        return _ft.flatten(tree)
    from jax._src.tree_util import FlatTree

    return FlatTree.flatten(tree)


def treedef_from(node_type: Any, aux: Any, children: list[Any]) -> Any:
    """The treedef of one node (``node_data()``'s type and aux data) over child treedefs."""
    registry = jax.tree_util.default_registry
    return jax.tree_util.PyTreeDef.from_node_data_and_children(registry, (node_type, aux), children)


def eqn_context(eqn: Any) -> Any:
    """The context an equation is bound in when a jaxpr is evaluated again (its source
    location and name stack, its context manager), as ``jax.core.eval_jaxpr`` binds."""
    import contextlib

    stack = contextlib.ExitStack()
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack.enter_context(
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
    )
    stack.enter_context(eqn.ctx.manager)
    return stack


def bind_eqn(eqn: Any, invals: list[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """``eqn``'s primitive bound on ``invals`` (with ``params``, default its own) in
    :func:`eqn_context`; its outputs as a list."""
    p = eqn.primitive
    with eqn_context(eqn):
        out = p.bind(*invals, **p.get_bind_params(eqn.params if params is None else params))
    return list(out) if p.multiple_results else [out]


def to_context_mesh(x: Any) -> Any:
    """``x`` typed for the current mesh context: a value made outside an ``auto_axes`` body
    (Explicit axes) used inside it (the same axes, Auto), as ``auto_axes`` converts its
    arguments; ``x`` itself where the meshes agree or there is none."""
    from jax.sharding import get_abstract_mesh, reshard

    cur = get_abstract_mesh()
    sharding: Any = getattr(core.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if cur.empty or mesh is None or mesh.empty or mesh == cur:
        return x
    if mesh.axis_names != cur.axis_names:
        return x
    return reshard(x, core.modify_spec_for_auto_manual(sharding.spec, cur))


def mesh_context(ctx: Any) -> Any:
    """The context manager of an equation's context (``eqn.ctx``) where its mesh differs from
    the current one (inside an ``auto_axes`` body: the same axes, Auto); else none."""
    import contextlib

    from jax.sharding import get_abstract_mesh

    mesh = getattr(ctx, "cur_abstract_mesh", None)
    if mesh is None or mesh == get_abstract_mesh():
        return contextlib.nullcontext()
    return ctx.manager


def register_aval(cls: type, aval_of: Any) -> None:
    """Give ``jax.typeof`` the abstract value of ``cls``, a Python subclass of ``jax.Array``
    that is a pytree around an array (``hx.LabelledArray``): libraries that test
    ``isinstance(x, jax.Array)`` then ask ``jax.typeof(x)`` (Flax NNX does) get its array's."""
    core.pytype_aval_mappings[cls] = aval_of
