"""``hx.summary``: one row per call site: shapes, parameters by collection, FLOPs, memory."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from collections.abc import Hashable, Mapping
from typing import Any

from .._util.errors import HookaxError
from .._util.words import counted
from . import haiku as _summary_haiku
from . import render as _summary_render

__all__ = ["Memory", "Summary", "SummaryRow", "SummaryTotals", "summary"]

Collection = tuple[str, int, int]  # (collection name, how many values, bytes)


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One call site of the summarised call, in call order.

    Attributes:
      key: the call site's key (``"layers/0/attn"``, ``"embed:attend"``; ``""`` for the model).
      path: the module's path from the model, a tuple of keys.
      type: the module's class name (a program's call site: its function's name, or
        ``"named_scope"``).
      method: the method called (``"__call__"``, ...).
      inputs: each array leaf of the arguments as ``"f32[8,64]"`` (other leaves by ``repr``);
        keyword arguments and leaves of pytree arguments are named (``"cache/k: f32[1,8,64]"``).
      outputs: each leaf of the returned value the same way, named by its key in a pytree output
        (``"logits: f32[8,10]"``, ``"0: f32[8]"``).
      params: trainable parameters (``nnx.Param``; Linen's ``"params"`` collection; Equinox's
        floating-point arrays) of the module and its submodules, each counted once.
      param_bytes: their size in bytes.
      flops: XLA's FLOP count of this call (submodule calls included), over all its trips
        through a scan and all the elements of an inner ``vmap``; None where it could not be
        lowered alone.
      shared_with: keys of the other modules holding some of this module's own parameters
        (tied weights); empty when none.
      depth: how many other rows' modules contain this one (the model is 0, its direct
        submodules 1, the blocks of an ``nnx.List`` of blocks 1, their layers 2, ...).
      folded: how many deeper call sites ``depth=`` folded into this row.
      vjp_flops: FLOPs of the forward and backward pass of this call (``jax.vjp`` and its
        pullback, as ``nnx.tabulate(compute_vjp_flops=True)`` counts), scaled like ``flops``.
      state: the non-trainable collections of the module and its submodules, as
        ``(name, count, bytes)``: ``("BatchStat", 32, 128)``, ``("RngState", 2, 12)``.
      variables: the module's own variables, one ``"name: Collection f32[64,32]"`` each, when
        [`hx.summary`][hookax.summary] was asked for ``variables=True``.
      trips: how many times this call site runs per call of the model: the product of the
        lengths of the scans around it (1 outside any scan; None inside a ``while`` loop).
      vmapped: the sizes of the ``vmap``\\ s this call runs under, outermost first (its shapes
        are one element's).
      same_as: the key of the first row that called the very same module, when this row is a
        reuse (its parameters are counted there, not here).
      params_in: the key of the row of another method of the same module that counts its
        parameters, when this row is a second method of a module already listed (``attn`` for
        ``attn:native_forward``); its own ``params`` is then 0. None otherwise.
    """

    key: str
    path: tuple[Any, ...]
    type: str
    method: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: int
    param_bytes: int
    flops: int | None
    shared_with: tuple[str, ...] = ()
    depth: int = 0
    folded: int = 0
    vjp_flops: int | None = None
    state: tuple[Collection, ...] = ()
    variables: tuple[str, ...] = ()
    trips: int | None = 1
    vmapped: tuple[int, ...] = ()
    same_as: str | None = None
    params_in: str | None = None

    @property
    def shared(self) -> bool:
        """Whether this module holds parameters another module holds too."""
        return bool(self.shared_with)


@dataclasses.dataclass(frozen=True)
class Memory:
    """An estimate of the memory of one training step, in bytes (torchinfo's "sizes").

    Attributes:
      inputs: the example inputs.
      params: every variable of the model (trainable and not).
      gradients: one gradient per trainable parameter.
      activations: what the forward pass keeps for the backward pass: the residuals of
        ``jax.vjp``, the inputs and parameters themselves left out (``source="residuals"``),
        or XLA's temporary buffers of the compiled forward and backward (``source="xla"``).
      source: where ``activations`` come from (``"residuals"`` or ``"xla"``).
      total: their sum.
    """

    inputs: int
    params: int
    gradients: int
    activations: int
    source: str = "residuals"

    @property
    def total(self) -> int:
        return self.inputs + self.params + self.gradients + self.activations


@dataclasses.dataclass(frozen=True)
class SummaryTotals:
    """Totals of a summary.

    Attributes:
      params: trainable parameters of the model, tied/shared ones counted once.
      param_bytes: their size in bytes.
      flops: XLA's FLOP count of the whole call, scans counted per trip (None if unavailable).
      shared_params: how many of ``params`` are held by more than one module.
      vjp_flops: the FLOPs of the forward and backward pass of the whole call.
      state: the non-trainable collections as ``(name, count, bytes)``.
      memory: the estimate of one training step's memory.
    """

    params: int
    param_bytes: int
    flops: int | None
    shared_params: int = 0
    vjp_flops: int | None = None
    state: tuple[Collection, ...] = ()
    memory: Memory | None = None

    @property
    def non_trainable(self) -> int:
        """How many values the non-trainable collections hold."""
        return sum(n for _, n, _ in self.state)

    @property
    def non_trainable_bytes(self) -> int:
        return sum(b for _, _, b in self.state)


@dataclasses.dataclass(frozen=True)
class Summary:
    """The result of [`hx.summary`][hookax.summary]: ``rows`` in call order and ``totals``.

    ``print(summary)`` renders a table fitted to the terminal's width (a notebook shows it as HTML;
    [`to_markdown`][hookax.Summary.to_markdown] gives a Markdown one);
    [`to_json`][hookax.Summary.to_json] and [`from_json`][hookax.Summary.from_json] round-trip it.
    ``model``, ``method`` and ``inputs`` name the call.
    """

    rows: list[SummaryRow]
    totals: SummaryTotals
    model: str = ""
    method: str = "__call__"
    inputs: tuple[str, ...] = ()

    @property
    def title(self) -> str:
        """``"Decoder(i32[8,32])"``, ``"VAE.encode(f32[8,784])"``: the call summarised."""
        method = "" if self.method == "__call__" else f".{self.method}"
        return f"{self.model}{method}({', '.join(self.inputs)})"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """The summary as JSON (read it back with [`from_json`][hookax.Summary.from_json])."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Summary:
        """Read back what [`to_json`][hookax.Summary.to_json] wrote."""
        data = json.loads(text)
        rows = []
        for r in data.pop("rows"):
            for name in ("path", "inputs", "outputs", "shared_with", "variables", "vmapped"):
                r[name] = tuple(r[name])
            r["state"] = tuple(tuple(c) for c in r["state"])
            rows.append(SummaryRow(**r))
        t = data.pop("totals")
        t["state"] = tuple(tuple(c) for c in t["state"])
        t["memory"] = Memory(**t["memory"]) if t["memory"] else None
        data["inputs"] = tuple(data["inputs"])
        return cls(rows, SummaryTotals(**t), **data)

    def to_markdown(self) -> str:
        """The table as GitHub Markdown, the totals below it."""
        return _summary_render.markdown(self)

    def __rich__(self) -> Any:
        return _summary_render.grid(self)

    def __str__(self) -> str:
        """The table as text at the terminal's width (natural when piped or in a notebook)."""
        return _summary_render.render(self)

    def __repr__(self) -> str:
        t = self.totals
        return (
            f"<hx.Summary {self.title}: {counted(len(self.rows), 'call site')}, "
            f"{counted(t.params, 'parameter', ',')}, "
            f"{_summary_render.compact(t.flops)} FLOPs>"
        )

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text
        p.text(str(self))

    def _repr_html_(self) -> str:  # a notebook's table
        return _summary_render.html(self)


def summary(
    model: Any,
    *example_args: Any,
    depth: int | None = None,
    method: str = "__call__",
    train: bool | None = None,
    variables: bool = False,
    xla_memory: bool = False,
    **example_kwargs: Any,
) -> Summary:
    """Summarise ``model.method(*example_args, **example_kwargs)``: one row per call site.

    Every call of every method of every module (``__call__`` and public methods, like
    [`hx.intercept`][hookax.intercept]'s default) is one row, in call order. Nothing runs and
    nothing weights-sized is allocated: the model is traced on abstract values
    (``jax.jit(...).trace`` and ``.lower``, never compiled), so the model may come from
    ``nnx.eval_shape`` and the arguments may be ``jax.ShapeDtypeStruct``\\ s or spec strings
    (``"f32[8,784]"``).

    A row's FLOPs are XLA's cost analysis of that call site's method lowered alone (identical
    call sites share one lowering), times the trips of the scans around it; its VJP FLOPs count
    the forward and backward pass the same way. The totals are XLA's count of the whole call
    with every scan counted once per trip. Parameters are counted per module including its
    submodules, by collection; parameters held by several modules (tied embeddings) are counted
    once in the totals and the rows holding them say with whom they share; a module called
    twice (the same method of the very same module) is marked on its second row (``same_as``)
    and counted once; a second method of a module (``attn:native_forward`` called by
    ``attn``'s ``__call__``) shows no parameters of its own, only where they are counted
    (``params_in``). The memory estimate is
    one training step: inputs, variables, gradients of the trainable parameters, and the
    activations the backward pass keeps.

    Args:
      model: a Flax NNX module; a Flax Linen module (unbound: its variables are initialised
        abstractly, or bound: its variables are used); or an Equinox module. Or a function that
        calls one, as [`hx.capture`][hookax.capture] takes: ``hx.summary(forward, model, cache,
        tokens)``; the rows are the call sites of the first NNX or Equinox module among its
        positional arguments, and the first row and the totals count the function's own work.
        Or a function that calls no module (a program over a weight pytree):
        ``hx.summary(forward, weights, tokens)``; the rows are its own call sites (its Python
        functions' calls and its ``jax.named_scope`` blocks) and the parameters are the
        floating-point leaves of its weights, the first positional argument that holds more
        than one array (see the summary guide, "Programs without modules").
      *example_args: its positional arguments: arrays, ``jax.ShapeDtypeStruct``\\ s, spec
        strings like ``"f32[8,784]"``, or anything else the method takes.
      depth: keep rows at most this deep (see [`SummaryRow`][hookax.SummaryRow]'s ``depth``: the
        model is 0, the modules it calls 1, ...); deeper call sites fold into the row above them,
        whose parameters and FLOPs already include theirs.
      method: the method of ``model`` to call.
      train: None runs the model as it is; True/False switch training behaviour (dropout,
        batch statistics) on or off for the summary only: NNX ``train()``/``eval()``, Equinox
        ``inference_mode``, Linen ``deterministic=``/``train=`` keyword arguments where the
        method takes them. A method that takes a ``train`` argument receives it (so
        ``hx.summary(model, x, train=False)`` also reads as the model's own ``train=False``).
      variables: list each module's own variables (name, collection, shape) in its row.
      xla_memory: take the activations of the memory estimate from XLA's memory analysis of
        the compiled forward and backward pass (its temporary buffers: exact for XLA's
        program, but compiling costs seconds on large models) instead of the residuals that
        ``jax.vjp`` keeps (no compilation; XLA may fuse some away or need workspace beyond).
      **example_kwargs: its keyword arguments (arrays, specs, pytrees such as a KV cache).

    Returns:
      A [`hx.Summary`][hookax.Summary].

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import hookax as hx
      >>> layer = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
      >>> s = hx.summary(layer, "f32[8,64]")
      >>> s.title, s.rows[0].outputs, s.totals.params, s.totals.flops
      ('Linear(f32[8,64])', ('f32[8,32]',), 2080, 33024)
      >>> s.totals.vjp_flops  # forward and backward
      98784

      A program without modules, its weights a pytree of arrays:

      >>> def mlp(x, w):
      ...     return jax.nn.relu(x @ w["up"]) @ w["down"]
      >>> def forward(weights, x):
      ...     return mlp(x, weights["mlp"]) + x
      >>> weights = {"mlp": {"up": jnp.ones((64, 128)), "down": jnp.ones((128, 64))}}
      >>> p = hx.summary(forward, weights, "f32[8,64]")
      >>> [(r.key, r.type, r.params) for r in p.rows]
      [('', 'forward', 16384), ('mlp', 'mlp', 16384)]
    """
    args, kwargs = _specs_to_structs(example_args), _specs_to_structs(example_kwargs)
    model, args = _linen_apply(model, args, kwargs)
    name, call, backend = None, None, None
    _check_options(depth, method, train)
    from .._engine.adapters import is_haiku_model

    if _is_function(model) and is_haiku_model(model):
        raise HookaxError(
            "hx.summary of a Haiku function: pass what hk.transform returned, hx.summary(t, x); "
            "its parameters are initialised abstractly."
        )
    if _is_function(model) and _module_position(args) is None:  # a program without modules
        name = getattr(model, "__name__", "function")
        backend, sig = _program_call(model, args, kwargs, method, train)
    elif _is_function(model):  # hx.summary(forward, model, cache, tokens), as hx.capture takes
        name = getattr(model, "__name__", "function")
        model, args, call, sig = _function_call(model, args, kwargs, method)
    if backend is None:
        backend = _check(model)
    if _summary_haiku.is_transformed(model):  # the function hk.transform was given runs
        fn = _summary_haiku.original_fn(model)
        name, sig = getattr(fn, "__name__", "function"), _summary_haiku.signature(fn)
    elif call is None and name is None:
        sig = _signature(model, method)
        if train is not None and sig is not None and "train" in sig.parameters:
            kwargs["train"] = train  # a model's own train= argument gets the switch too
        _check_arguments(model, method, args, kwargs)
    from . import cost
    from .trace import describe_call

    # 1. one abstract trace of the whole call, recording every call site
    whole = backend.trace_calls(model, args, kwargs, method=method, train=train, call=call)
    colls = backend.collections(model, variables)
    trips = cost.site_trips(whole.traced.jaxpr.jaxpr)
    records = _drop_discarded_traces(whole.records, trips)
    # 2. one row per call site: shapes, parameters, FLOPs
    rows, activations = _rows(whole, records, trips, colls, variables, xla_memory)
    # 3. the totals, then the table folded to ``depth``
    totals = _totals(whole, colls, rows, activations, xla_memory)
    return Summary(
        fold(rows, depth),
        totals,
        model=type(model).__name__ if name is None else name,
        method=method,
        inputs=describe_call(sig, args, kwargs),
    )


def _rows(
    whole: Any,
    records: list[Any],
    trips: dict[int, int | None],
    colls: Any,
    variables: bool,
    xla_memory: bool,
) -> tuple[list[SummaryRow], int]:
    """The rows of the recorded call sites, and the bytes of activations kept for backward."""
    cache: dict[Hashable, tuple[int | None, int | None]] = {}
    rows = []
    activations = 0
    seen = {rec.path for _, rec in records}
    first: dict[tuple[int, str], str] = {}
    counted: dict[tuple[int, tuple[Any, ...]], str] = {}  # module -> row counting its params
    for i, (n_site, rec) in enumerate(records):
        n = trips.get(n_site, 1)
        if i == 0:
            flops, (vjp, activations) = whole.flops(), whole.backward(xla_memory)
        else:
            flops, vjp = (_scale(c, n, rec.vmapped) for c in _site_costs(rec.site, cache))
        same_as = first.get((rec.module_id, rec.method))
        if same_as is None:
            first[(rec.module_id, rec.method)] = rec.key
        reuse = same_as is not None
        params_in = None if reuse else counted.get((rec.module_id, rec.path))
        counted.setdefault((rec.module_id, rec.path), rec.key)
        hide = reuse or params_in is not None
        p, b, state = colls.of(rec.path)
        rows.append(
            SummaryRow(
                key=rec.key,
                path=rec.path,
                type=rec.type,
                method=rec.method,
                inputs=rec.inputs,
                outputs=rec.outputs,
                params=0 if hide else p,
                param_bytes=0 if hide else b,
                flops=flops,
                shared_with=colls.shared_with(rec.path),
                depth=sum(1 for j in range(len(rec.path)) if rec.path[:j] in seen),
                vjp_flops=vjp,
                state=() if hide else state,
                variables=colls.variables.get(rec.path, ()) if variables and not hide else (),
                trips=n,
                vmapped=rec.vmapped,
                same_as=same_as if reuse else None,
                params_in=params_in,
            )
        )
    return rows, activations


def _totals(
    whole: Any, colls: Any, rows: list[SummaryRow], activations: int, xla_memory: bool
) -> SummaryTotals:
    """Parameters counted once, FLOPs of the whole call, and the memory of a training step."""
    p, b, state = colls.of(())
    memory = Memory(
        inputs=whole.input_bytes,
        params=b + sum(nb for _, _, nb in state),
        gradients=b,
        activations=activations,
        source="xla" if xla_memory else "residuals",
    )
    return SummaryTotals(
        p, b, rows[0].flops, colls.shared_total(), rows[0].vjp_flops, state, memory
    )


def _drop_discarded_traces(records: list[Any], trips: dict[int, int | None]) -> list[Any]:
    """``(site number, record)`` pairs, without the calls that are not calls of the program.

    A call site absent from the program either did no work or ran in a trace that was thrown
    away (Linen's ``nn.scan`` traces its body twice); only the second kind has a twin of the
    same key and method that the program has. Linen's lifted ``nn.scan`` module is also called
    once around the loop, then once per trip inside it: the row inside (with its trip count)
    stays.
    """
    present = {(r.key, r.method) for i, r in enumerate(records) if i in trips}
    looped = {(r.key, r.method) for i, r in enumerate(records) if trips.get(i, 1) != 1}
    return [
        (i, r)
        for i, r in enumerate(records)
        if i == 0
        or (i in trips and (trips[i] != 1 or (r.key, r.method) not in looped))
        or (i not in trips and (r.key, r.method) not in present)
    ]


def _scale(n: int | None, trips: int | None, vmapped: tuple[int, ...]) -> int | None:
    if n is None or trips is None:
        return None
    for size in vmapped:
        n *= size
    return n * trips


def _site_costs(
    site: Any, cache: dict[Hashable, tuple[int | None, int | None]]
) -> tuple[int | None, int | None]:
    """FLOPs of one call site alone, forward and forward+backward (cached per identical site)."""
    if site is None:
        return None, None
    key = site.cache_key()
    if key is not None and key in cache:
        return cache[key]
    import jax

    from . import cost

    out: list[int | None] = []
    for fn in (site.run, cost.vjp_fn(site.run)):
        try:
            out.append(cost.flops(jax.jit(fn).trace(site.state, site.args.dynamic)))
        except Exception:  # lowering a call site alone can fail (it may need an outer transform)
            out.append(None)
    result = (out[0], out[1])
    if key is not None:
        cache[key] = result
    return result


def _specs_to_structs(tree: Any) -> Any:
    """Spec strings (``"f32[8,784]"``) among the top-level arguments become ShapeDtypeStructs."""
    from .._util.specs import SpecError, parse_spec

    def convert(x: Any) -> Any:
        if isinstance(x, str) and "[" in x:
            try:
                return parse_spec(x)
            except SpecError as e:
                raise HookaxError(f"hx.summary: {e}") from None
        return x

    if isinstance(tree, dict):
        return {k: convert(v) for k, v in tree.items()}
    return tuple(convert(x) for x in tree)


def _linen_apply(fn: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """``hx.summary(model.apply, variables, *inputs)`` is ``hx.summary(model.bind(variables),
    *inputs)``: a Linen module's ``apply`` with its variables first; anything else unchanged."""
    nn = sys.modules.get("flax.linen")
    owner = getattr(fn, "__self__", None)
    if nn is None or not isinstance(owner, nn.Module) or getattr(fn, "__name__", "") != "apply":
        return fn, args
    if not args or not isinstance(args[0], Mapping) or _APPLY_OPTIONS & set(kwargs):
        return fn, args
    return owner.bind(args[0]), args[1:]


# ``Module.apply``'s own keywords: a summary that passes them is left to the general path.
_APPLY_OPTIONS = {"rngs", "mutable", "capture_intermediates"}


def _is_function(obj: Any) -> bool:
    """A plain function (or other callable) rather than a module of a supported framework."""
    from .._engine.adapters import adapter_for

    return callable(obj) and not isinstance(obj, type) and adapter_for(obj) is None


def _module_position(args: tuple) -> int | None:
    """The position of the first module among ``args``, None when none is one."""
    from .._engine.adapters import adapter_for

    return next((i for i, a in enumerate(args) if adapter_for(a) is not None), None)


def _function_signature(fn: Any, args: tuple, kwargs: dict) -> inspect.Signature | None:
    """``fn``'s signature, after checking that it takes ``args`` and ``kwargs``."""
    sig: inspect.Signature | None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature: leave it to the call
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise HookaxError(
            f"hx.summary cannot call {getattr(fn, '__name__', fn)}{sig}: {e}. Fix: pass "
            "the function's arguments after it: the model among them "
            "(hx.summary(forward, model, tokens)), or for a function that calls no module, its "
            "weights (hx.summary(forward, weights, tokens))."
        ) from None
    return sig


def _program_call(
    fn: Any, args: tuple, kwargs: dict, method: str, train: bool | None
) -> tuple[Any, inspect.Signature | None]:
    """For ``hx.summary(forward, weights, tokens)`` with no module among the arguments: the
    backend that summarises ``forward`` as a program without modules, and the signature
    (with a placeholder first parameter) that names its inputs in the title."""
    from . import programs
    from .trace import describe_call

    if method != "__call__":
        raise HookaxError(
            f"hx.summary: method={method!r} applies to a module; {fn!r} is a function. Fix: "
            "call the method inside the function."
        )
    sig = _function_signature(fn, args, kwargs)
    if train is not None:
        if sig is None or "train" not in sig.parameters:
            raise HookaxError(
                f"hx.summary(train={train}): {getattr(fn, '__name__', fn)} calls no module, "
                "so there is no training mode to switch, and it takes no train= argument. "
                "Fix: pass the program's own switch as a keyword argument, or leave train=None."
            )
        kwargs["train"] = train
    if sig is not None:
        first = inspect.Parameter("_program", inspect.Parameter.POSITIONAL_ONLY)
        sig = sig.replace(parameters=[first, *sig.parameters.values()])
    backend = programs.Program(fn, args, kwargs, describe_call(sig, args, kwargs))
    return backend, sig


def _function_call(
    fn: Any, args: tuple, kwargs: dict, method: str
) -> tuple[Any, tuple, Any, inspect.Signature | None]:
    """For ``hx.summary(fn, *args)``: the first module among ``args`` (the model whose call
    sites are the rows), the other arguments, how to call ``fn`` with the model, and ``fn``'s
    signature without the model's parameter (for the title)."""
    from .._engine.adapters import adapter_for

    if method != "__call__":
        raise HookaxError(
            f"hx.summary: method={method!r} applies to a module; {fn!r} is a function. Fix: "
            "call the method inside the function."
        )
    at = next((i for i, a in enumerate(args) if adapter_for(a) is not None), None)
    if at is None:
        raise HookaxError(
            f"hx.summary({getattr(fn, '__name__', fn)!r}, ...): none of the positional "
            "arguments is a module, so there is no model to summarise. Fix: pass the model as "
            "an argument of the function: hx.summary(forward, model, cache, tokens)."
        )
    model, rest = args[at], args[:at] + args[at + 1 :]

    def call(m: Any, *a: Any, **k: Any) -> Any:
        return fn(*a[:at], m, *a[at:], **k)

    sig = _function_signature(fn, args, kwargs)
    if sig is not None:
        params = list(sig.parameters.values())
        del params[at]
        first = inspect.Parameter("_model", inspect.Parameter.POSITIONAL_ONLY)
        sig = sig.replace(parameters=[first, *params])  # describe_call skips the first
    return model, rest, call, sig


def _signature(model: Any, method: str) -> inspect.Signature | None:
    fn = getattr(type(model), method, None)
    try:
        return inspect.signature(fn) if fn is not None else None
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return None


def _check_arguments(model: Any, method: str, args: tuple, kwargs: dict) -> None:
    """A clear error for missing inputs and torchinfo-style shape tuples, before any tracing."""
    name = type(model).__name__
    if not callable(getattr(model, method, None)):
        raise HookaxError(
            f"hx.summary: {name} has no method {method!r}. Fix: pass method= one of its methods."
        )
    sig = _signature(model, method)
    try:
        if sig is not None:
            sig.bind(model, *args, **kwargs)
    except TypeError as e:
        shown = f"{name}.{method}{str(sig).replace('(self, ', '(', 1).replace('(self)', '()')}"
        raise HookaxError(
            f"hx.summary({name}, ...) cannot call {shown}: {e}. Fix: pass the example inputs "
            f"after the model, as arrays, jax.ShapeDtypeStructs or specs: "
            f'hx.summary(model, "f32[8,784]").'
        ) from None
    for x in args:
        if isinstance(x, tuple) and x and all(isinstance(d, int) for d in x):
            raise HookaxError(
                f"hx.summary({name}, {x!r}): a tuple of ints is not an input shape here "
                f"(torchinfo's input_size). Fix: pass a spec with the dtype, "
                f'hx.summary(model, "f32[{",".join(map(str, x))}]"), or '
                f"jax.ShapeDtypeStruct({x!r}, jnp.float32)."
            )


def _check_options(depth: Any, method: Any, train: Any) -> None:
    if depth is not None and (not isinstance(depth, int) or depth < 0):
        raise HookaxError(f"hx.summary(depth=...) takes an int >= 0 or None, got {depth!r}.")
    if not isinstance(method, str):
        raise HookaxError(f"hx.summary(method=...) takes a method name, got {method!r}.")
    if train not in (None, True, False):
        raise HookaxError(f"hx.summary(train=...) takes None, True or False, got {train!r}.")


def _check(model: Any) -> Any:
    """The backend that traces ``model``'s framework (``trace_calls``, ``collections``)."""
    from .._engine.adapters import adapter_for

    if _summary_haiku.is_transformed(model):
        return _summary_haiku.Haiku()
    adapter = adapter_for(model)
    if adapter is not None and adapter.name == "haiku":
        raise HookaxError(
            f"hx.summary of a Haiku {type(model).__name__} module: Haiku modules live inside "
            "the function given to hk.transform. Fix: summarise that, hx.summary(t, x) with "
            "t = hk.transform(forward)."
        )
    if adapter is not None and adapter.name in ("linen", "equinox"):
        from . import frameworks as _summary_frameworks

        return _summary_frameworks.backend(adapter.name)
    nnx_module = _nnx_module_type()
    if nnx_module is None or not isinstance(model, nnx_module):
        raise HookaxError(
            f"hx.summary supports Flax NNX, Flax Linen and Equinox modules and Haiku "
            f"transforms; got {type(model).__name__}. Fix: pass the model (an nnx.Module, an "
            "unbound or bound nn.Module, an eqx.Module, or hk.transform(forward); build it "
            "abstractly to keep it small)."
        )
    from . import trace as _summary_trace

    return _summary_trace.NNX()


def _nnx_module_type() -> type | None:
    import sys

    if "flax.nnx" not in sys.modules:
        return None
    return sys.modules["flax.nnx"].Module


def fold(rows: list[SummaryRow], depth: int | None) -> list[SummaryRow]:
    """Drop rows deeper than ``depth``, counting them in the nearest kept row above them.

    A row's parameters and FLOPs already include its submodules' calls, so folding only counts.
    """
    if depth is None:
        return list(rows)
    kept: list[SummaryRow] = []
    for row in rows:
        if row.depth <= depth or not kept:
            kept.append(row)
        else:
            kept[-1] = dataclasses.replace(kept[-1], folded=kept[-1].folded + 1)
    return kept
