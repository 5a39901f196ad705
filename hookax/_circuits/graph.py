"""The residual graph of a transformer, read off one run, and the run that rewires it.

*Senders* write to the residual stream: each embedding (``"embed"``), each head's output after
the output projection without its bias (``"L0H1"``), each MLP's output (``"MLP0"``).
*Receivers* read it: each head's query, key and value inputs (``"L1H0.q"``), each MLP's input
(``"MLP0"``) and the readout (``"logits"``: the final norm's input, or the unembedding's); in
pre-norm blocks, the inputs of the norms before the attention and the MLP. An
edge joins every sender to every receiver called after it: blocks are taken to be sequential,
each part reading the stream with every earlier output added.

One interceptor does it all: it records each sender's value as the run makes it, and adds a
*shift* to each receiver's input. The model's scans run unrolled and its vmaps are followed
(:mod:`hookax._circuits.traces`): values are kept whole, in the trace the model's call starts
in. A head reads its own copy of the projection's input: the projections are affine, so head
``h`` of ``proj(x + shift)`` is head ``h`` of ``proj(x) + linear(shift)``, the projection
linearized (``jax.linearize``: the module runs once, as Linen's compact modules require); a
head's result is the output projection's linear part applied to that head's part of its input.
The shifts are zeros to differentiate with respect to (each receiver's gradient), or, to corrupt
edges, ``corrupt - value`` of the senders whose edge to that receiver is cut.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import context as _context
from .._engine.select import Select, glob_to_regex
from .._hooks.intercept import intercept
from .._interp.components import Components, as_tuple
from .._util.errors import HookaxError
from .._util.jaxcompat import core
from . import traces

__all__ = ["Graph", "Rewire", "discover", "rewired"]


@dataclasses.dataclass(frozen=True)
class Graph:
    """The senders and receivers of one model, in the order the run makes and reads them.

    ``before[j]``: how many senders the run has made when receiver ``j`` reads the stream (its
    edges come from ``senders[:before[j]]``); ``shapes[j]``: receiver ``j``'s input shape."""

    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    before: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

    def allowed(self) -> np.ndarray:
        """``[sender, receiver]``: whether the edge exists."""
        s = np.arange(len(self.senders))[:, None]
        return s < np.asarray(self.before, int)[None, :]

    def edges(self) -> tuple[tuple[str, str], ...]:
        """Every edge, ``(sender, receiver)``, receiver by receiver."""
        return tuple(
            (self.senders[i], r) for r, n in zip(self.receivers, self.before) for i in range(n)
        )


@dataclasses.dataclass
class Rewire:
    """What one run does besides running: ``shifts`` (receiver -> array added to its input),
    ``corrupt`` (sender -> corrupted value) with ``keep`` (``[sender, receiver]`` 1 for an
    edge kept clean, 0 for one corrupted), ``alpha`` with ``corrupt_embeds`` (each embedding
    made ``corrupt + alpha * (own - corrupt)``)."""

    graph: Graph | None = None
    shifts: Mapping[str, Any] | None = None
    corrupt: Mapping[str, Any] | None = None
    keep: Any = None
    alpha: Any = None
    corrupt_embeds: Mapping[str, Any] | None = None


class _Run:
    """The state of one run: the senders made so far and the receivers read."""

    def __init__(self, parts: Components, rewire: Rewire, who: str) -> None:
        self.parts, self.rewire, self.who = parts, rewire, who
        self.top = _context.current_trace()  # the trace the model's call starts in
        self.maps: tuple[Any, ...] = ()  # the vmaps around the call site running (traces.py)
        self.values: dict[str, Any] = {}
        self.embeds: list[str] = []
        self.receivers: list[tuple[str, int, tuple[int, ...]]] = []
        self.layer: dict[str, int] = {}
        self.pending: tuple[Any, dict[str, Any]] | None = None  # a norm's output, its copies
        roles: list[tuple[str, str | None]] = [("embed", g) for g in as_tuple(parts.embed)]
        roles += [("heads", parts.heads)] if parts.heads else []
        roles += [(k, g) for k, g in zip("qkv", parts.qkv or ())]
        roles += [("mlp", parts.mlp)] if parts.mlp else []
        attn_norm, mlp_norm = parts.norms or (None, None)
        roles += [("attn_norm", attn_norm), ("mlp_norm", mlp_norm)]
        self.mlp_normed = mlp_norm is not None
        roles += [("readout", parts.final_norm or parts.unembed)]
        self.roles = [(role, glob_to_regex(g)) for role, g in roles if g]

    def role(self, key: str) -> str | None:
        return next((role for role, rx in self.roles if rx.fullmatch(key)), None)

    def next_layer(self, role: str) -> int:
        n = self.layer.get(role, 0)
        self.layer[role] = n + 1
        return n

    def shift(self, label: str, x: Any) -> Any:
        """What the receiver ``label`` adds to its input ``x``: its shift and its cut edges'
        corrections (``sender_corrupt - sender_here``), in ``x``'s shape (an element's, inside
        a vmap); None for nothing. Its shape in the graph is the whole input's."""
        r = self.rewire
        shape = tuple(v.axis_data.size for v in self.maps) + tuple(jnp.shape(x))
        self.receivers.append((label, len(self.values), shape))
        if r.shifts is None and r.corrupt is None:
            return None
        with core.set_current_trace(self.top):
            total = None
            if r.shifts is not None and label in r.shifts:
                total = r.shifts[label]
            if r.corrupt is not None and r.graph is not None:
                j = r.graph.receivers.index(label)
                for i, name in enumerate(r.graph.senders[: r.graph.before[j]]):
                    term = (1 - r.keep[i, j]) * (r.corrupt[name] - self.values[name])
                    total = term if total is None else total + term
            if total is None:
                return None
            total = jnp.broadcast_to(total, shape).astype(x.dtype)
        return traces.each(total, self.maps)

    def shifted(self, label: str, x: Any) -> Any:
        s = self.shift(label, x)
        return x if s is None else x + s

    def record(self, label: str, value: Any) -> None:
        self.values[label] = traces.whole(value, self.maps)

    def __call__(
        self, next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: Any
    ) -> Any:
        role = self.role(context.key)
        if role is None or not args:
            return next_fun(*args, **kwargs)
        maps = traces.vmaps(self.top, self.who, context.key)
        if maps is None:
            return next_fun(*args, **kwargs)
        self.maps = maps
        x, rest = args[0], args[1:]
        if role == "embed":
            y = next_fun(*args, **kwargs)
            r = self.rewire
            self.embeds.append(context.key)
            if r.alpha is None or r.corrupt_embeds is None:
                self.record(context.key, y)
                return y
            with core.set_current_trace(self.top):
                c = r.corrupt_embeds[context.key]
                mixed = c + r.alpha * (traces.whole(y, self.maps) - c)
            self.values[context.key] = mixed
            return traces.each(mixed, self.maps)
        if role == "heads":
            return self._heads(next_fun, x, rest, kwargs)
        if role in ("q", "k", "v"):
            return self._projection(role, next_fun, x, rest, kwargs)
        if role == "mlp":
            label = f"MLP{self.next_layer('mlp')}"
            y = next_fun(x if self.mlp_normed else self.shifted(label, x), *rest, **kwargs)
            self.record(label, y)
            return y
        if role == "mlp_norm":
            label = f"MLP{self.next_layer('mlp_norm')}"
            return next_fun(self.shifted(label, x), *rest, **kwargs)
        if role == "attn_norm":
            return self._attn_norm(next_fun, x, rest, kwargs)
        return next_fun(self.shifted("logits", x), *rest, **kwargs)  # the readout

    def _n_heads(self, x: Any, y: Any, what: str) -> int | None:
        """The heads on their own axis (-2 of ``x``): None; concatenated: ``n_heads``."""
        if jnp.ndim(x) == jnp.ndim(y) + 1:
            return None
        n = self.parts.n_heads
        if not n or jnp.shape(x)[-1] % n:
            raise HookaxError(
                f"{self.who}: {what} holds the heads concatenated ({jnp.shape(x)[-1]} "
                f"features); give Components(n_heads=...) dividing it."
            )
        return n

    def _heads(self, next_fun: Callable[..., Any], z: Any, rest: tuple, kw: dict) -> Any:
        """The output projection: each head's result, the projection's linear part (no bias)
        applied to that head's part of its input."""
        layer = self.next_layer("heads")
        y, linear = jax.linearize(lambda v: next_fun(v, *rest, **kw), z)
        n = self._n_heads(z, y, "the output projection's input")
        split = z if n is None else z.reshape(*z.shape[:-1], n, -1)
        for h in range(split.shape[-2]):
            one = jnp.zeros_like(split).at[..., h, :].set(split[..., h, :])
            self.record(f"L{layer}H{h}", linear(one.reshape(z.shape)))
        return y

    def _attn_norm(self, next_fun: Callable[..., Any], x: Any, rest: tuple, kw: dict) -> Any:
        """The norm before the attention: each head's query, key and value read the norm of
        their own copy of the stream, all copies normed in one ``vmap``."""
        layer = self.next_layer("attn_norm")
        self.pending = None
        n = self.parts.n_heads
        if not n:
            raise HookaxError(
                f"{self.who}: with the norm before the attention (components.norms), give "
                f"Components(n_heads=...): the heads' copies are made before their projections."
            )
        labels = [f"L{layer}H{h}.{kind}" for kind in "qkv" for h in range(n)]
        shifts = [self.shift(label, x) for label in labels]
        if all(s is None for s in shifts):
            return next_fun(x, *rest, **kw)
        # one call (Linen's compact modules run once): the stream first, then the copies
        stack = jnp.stack([x] + [x if s is None else x + s for s in shifts])
        normed = jax.vmap(lambda v: next_fun(v, *rest, **kw))(stack)
        y = normed[0]
        maps = self.maps
        copies = {label: traces.whole(normed[i + 1] - y, maps) for i, label in enumerate(labels)}
        self.pending = (traces.root(y, self.maps), copies)
        return y

    def _projection(
        self, kind: str, next_fun: Callable[..., Any], x: Any, rest: tuple, kw: dict
    ) -> Any:
        """A query, key or value projection: each head reads its own copy of the input, the
        projection's linear part applied to that copy's shift."""
        layer = self.next_layer(kind)
        y, linear = jax.linearize(lambda v: next_fun(v, *rest, **kw), x)
        n = self._n_heads(y, x, "the projection's output")
        split = (lambda v: v) if n is None else (lambda v: v.reshape(*v.shape[:-1], n, -1))
        heads = []
        mine = self.pending and traces.root(x, self.maps) is self.pending[0]
        normed = self.pending[1] if self.pending and mine else None
        if self.parts.norms and self.parts.norms[0] and normed is None and self.pending:
            raise HookaxError(
                f"{self.who}: the {kind} projection of layer {layer} does not read the output "
                f"of the norm components.norms names (the same array); the copies of the "
                f"heads' inputs cannot be found."
            )
        for h in range(split(y).shape[-2]):
            label = f"L{layer}H{h}.{kind}"
            if self.parts.norms and self.parts.norms[0]:
                s = None if normed is None else traces.each(normed[label], self.maps)
            else:
                s = self.shift(label, x)
            heads.append(split(y if s is None else y + linear(s))[..., h, :])
        out = jnp.stack(heads, axis=-2)
        return out if n is None else out.reshape(y.shape)

    def graph(self) -> Graph:
        return Graph(
            tuple(self.values),
            tuple(r[0] for r in self.receivers),
            tuple(r[1] for r in self.receivers),
            tuple(r[2] for r in self.receivers),
        )


def _check_seen(run: _Run, parts: Components, who: str) -> None:
    """Raise if a part the components name matched no call site that ran."""
    named = {"heads": parts.heads, "mlp": parts.mlp}
    named |= dict(zip(("q", "k", "v"), parts.qkv or ()))
    missing = {role: glob for role, glob in named.items() if glob and role not in run.layer}
    if missing:
        role, glob = next(iter(missing.items()))
        field = "qkv" if role in "qkv" else role
        raise HookaxError(
            f"{who}: components.{field} names {glob!r}, which matched no call site that ran. "
            f"Fix: name the call sites as hx.capture(fn)(*args)[1] lists them (a stack of "
            f"layers run by a scan by its suffix, 'blocks/attn/query'; unrolled layers with "
            f"a '*', 'blocks/*/attn/query')."
        )


def _sites(parts: Components) -> tuple[str, ...]:
    sites = [*as_tuple(parts.embed), parts.heads, *(parts.qkv or ()), parts.mlp]
    sites += list(parts.norms or ())
    sites.append(parts.final_norm or parts.unembed)
    return tuple(s for s in sites if s)


def check(parts: Any, who: str) -> Components:
    if not isinstance(parts, Components):
        raise HookaxError(
            f"{who}: components= takes an hx.Components, got {type(parts).__name__}. Fix: "
            "hx.Components(attn='blocks/*/attn', embed=('embed', 'pos_embed'), "
            "heads='blocks/*/attn/out', qkv=('blocks/*/attn/query', 'blocks/*/attn/key', "
            "'blocks/*/attn/value'), unembed='unembed')."
        )
    if parts.heads is None or parts.qkv is None or not (parts.final_norm or parts.unembed):
        raise HookaxError(
            f"{who}: the residual graph needs the heads' output projection (heads=), their "
            f"query, key and value projections (qkv=) and the readout (unembed= or "
            f"final_norm=); got heads={parts.heads!r}, qkv={parts.qkv!r}, "
            f"unembed={parts.unembed!r}, final_norm={parts.final_norm!r}."
        )
    return parts


def rewired(
    fn: Callable[..., Any], parts: Components, rewire: Rewire, who: str
) -> Callable[..., tuple[Any, _Run]]:
    """``fn`` run under the interceptor: ``y, run = rewired(...)(*args)``; ``run.values``
    holds the senders' values of this run, ``run.graph()`` the graph it saw."""

    def call(*args: Any) -> tuple[Any, _Run]:
        run = _Run(parts, rewire, who)
        with intercept(run, where=Select(paths=_sites(parts))), traces.unrolled():
            y = fn(*args)
        if not run.receivers or "logits" not in dict((r[0], 0) for r in run.receivers):
            raise HookaxError(
                f"{who}: the readout {parts.final_norm or parts.unembed!r} was not called; "
                f"the call sites that ran must match the components' paths."
            )
        _check_seen(run, parts, who)
        return y, run

    return call


_GRAPHS: dict[Any, Graph] = {}


def discover(fn: Any, args: tuple[Any, ...], parts: Components, who: str) -> Graph:
    """The graph of ``fn(*args)``, found abstractly (cached by structure and shapes)."""
    from .._patching import compiled

    dyn, rest = compiled.split((fn, args))
    key = (rest, parts, compiled.avals(dyn), who)
    hit = _GRAPHS.get(key)
    if hit is not None:
        return hit
    found: list[Graph] = []

    def run(dyn: list[Any]) -> None:
        f, a = compiled.join(dyn, rest)
        _, r = rewired(f, parts, Rewire(), who)(*a)
        found.append(r.graph())

    jax.eval_shape(run, dyn)
    if compiled.reusable(rest) and len(_GRAPHS) < 256:
        _GRAPHS[key] = found[0]
    return found[0]


@dataclasses.dataclass(frozen=True)
class Spec:
    """The static part of a compiled circuit program: the arguments' non-array rest (a
    ``compiled.Static``), the model's parts and its graph."""

    rest: Any
    parts: Components
    graph: Graph
