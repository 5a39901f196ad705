"""The residual stream of a transformer, seen through captured values: ``hx.Components`` names
a model's parts by call-site path, ``hx.ResidualStream`` builds TransformerLens'
``ActivationCache`` views from a capture of them.

Nothing here knows an architecture. The stream is what the components' call sites carried: a
block's input is its ``resid_pre``, the attention and MLP outputs are what each block adds, the
final norm's input is the last ``resid_post``. Per-head results split the attention's output
projection by heads from its own kernel (the projection's input times each head's rows of the
kernel); the final norm is applied to a stack linearly, with the scale it used in the forward
read from its own input and output. Unrolled layers (``"blocks/*"``) and a scanned stack
(``"blocks"``, values stacked by layer) give the same views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from .._capture.capture import capture
from .._engine.select import Select, glob_to_regex, split_method
from .._patching.cache import stack_layers
from .._util.errors import HookaxError
from .stack import Stack
from .weights import linear_at, norm_at, unembed_at

__all__ = ["Components", "ResidualStream"]

WHO = "hx.ResidualStream"


def _as_tuple(x: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if x is None else (x,) if isinstance(x, str) else tuple(x)


@dataclasses.dataclass(frozen=True)
class Components:
    """Where a transformer's parts are, by call-site path (globs over layers, or a scanned
    stack's one key).

    Args:
      attn: the attention outputs each block adds to the residual stream (``"blocks/*/attn"``).
      mlp: the MLP outputs (``"blocks/*/mlp"``); None for an attention-only model.
      blocks: the blocks, whose inputs are ``resid_pre`` (``"blocks/*"``); None: the stream is
        the embeddings plus the outputs added so far.
      embed: the embeddings whose sum starts the stream (``("embed", "pos_embed")``).
      final_norm: the norm before the unembedding (``"ln_f"``).
      unembed: the unembedding: a linear layer, or an embedding used tied.
      heads: the attention's output projection (``"blocks/*/attn/out"``): a linear layer whose
        input is the heads' outputs, concatenated (``nnx.Linear``, ``eqx.nn.Linear``,
        ``nn.Dense``: give ``n_heads``) or on their own axis (``nnx.MultiHeadAttention``'s
        ``out``, Linen's ``DenseGeneral``).
      n_heads: the number of heads, for a projection of concatenated heads.
      norm_kind: ``"layer"`` or ``"rms"`` when the final norm's type does not say (a Linen
        LayerNorm without a bias).
    """

    attn: str
    mlp: str | None = None
    blocks: str | None = None
    embed: str | tuple[str, ...] = ()
    final_norm: str | None = None
    unembed: str | None = None
    heads: str | None = None
    n_heads: int | None = None
    norm_kind: str | None = None

    def sites(self) -> tuple[str, ...]:
        """Every call site a view reads (their outputs and inputs are captured)."""
        names = [self.attn, self.mlp, self.blocks, self.final_norm, self.heads]
        return tuple(n for n in [*_as_tuple(self.embed), *names] if n is not None)

    def wanted(self) -> tuple[str, ...]:
        """The captured keys (as patterns) a view uses; the rest are dropped."""
        out = [*_as_tuple(self.embed), self.attn]
        out += [] if self.mlp is None else [self.mlp]
        out += [] if self.blocks is None else [f"{self.blocks}:in", self.blocks]
        out += [] if self.final_norm is None else [f"{self.final_norm}:in", self.final_norm]
        out += [] if self.heads is None else [f"{self.heads}:in"]
        return tuple(out)

    def capture(self, fn: Callable[..., Any]) -> Callable[..., tuple[Any, dict[str, Any]]]:
        """``hx.capture`` of what a view needs: ``y, acts = components.capture(fn)(*args)``;
        ``hx.ResidualStream(acts, components, weights)`` is the view."""
        forward = capture(fn, where=Select(paths=self.sites()), inputs=True)
        wanted = [(glob_to_regex(split_method(w)[0]), split_method(w)[1]) for w in self.wanted()]

        def run(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
            y, acts = forward(*args, **kwargs)
            keep = {}
            for key, values in acts.items():
                path, method = split_method(key)
                if any(rx.fullmatch(path) and m == method for rx, m in wanted):
                    keep[key] = values
            return y, keep

        return run


def _first(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """A call's input: its one positional argument, or the first of several."""
    return tuple(v[0] if isinstance(v, tuple) else v for v in values)


def _get(acts: Mapping[str, tuple[Any, ...]], key: str) -> Any:
    """The one value captured at ``key``; a key not captured raises, naming the fix."""
    if key not in acts:
        raise HookaxError(
            f"{WHO}: {key!r} was not captured (the keys include "
            f"{', '.join(repr(k) for k in list(acts)[:6])}). Fix: capture with the same "
            f"components, y, acts = components.capture(fn)(*args)."
        )
    return acts[key][0]


def _at_pos(x: Any, pos: Any) -> Any:
    """``x`` (``(..., position, feature)``) at ``pos``: an int, a slice or indices."""
    if pos is None:
        return x
    if isinstance(pos, slice | int):
        return x[..., pos, :]
    return jnp.take(x, jnp.asarray(pos), axis=-2)


class ResidualStream:
    """TransformerLens' ``ActivationCache`` views over a capture of ``components``.

    ``acts`` is what ``components.capture(fn)(*args)`` returned; ``weights`` is where the
    kernels are read: the model (NNX, Equinox) or Linen's variables. Built inside a jitted
    function from its arguments, every view is traced like the rest of it. Values are laid out
    ``(..., position, d_model)``; stacks put their components in front.

    Labels follow TransformerLens: ``"0_pre"``, ``"0_mid"``, ``"final_post"`` (accumulated),
    the embeddings' keys, ``"0_attn_out"``, ``"0_mlp_out"`` (decomposed), ``"L0H1"`` (heads),
    ``"bias"`` (what the attention outputs hold besides their heads' results: the output
    projection's bias).
    """

    def __init__(self, acts: Mapping[str, tuple[Any, ...]], components: Components, weights: Any):
        c = self.components = components
        self.weights = weights
        acts = {k: _first(v) if k.endswith(":in") else v for k, v in acts.items()}
        self.acts = acts
        self.attn = stack_layers(acts, c.attn)
        self.n_layers = int(self.attn.shape[0])
        self.mlp = None if c.mlp is None else stack_layers(acts, c.mlp)
        self.embeds = [(k, _get(acts, k)) for k in _as_tuple(c.embed)]
        out = self.attn + (0 if self.mlp is None else self.mlp)
        if c.blocks is not None:
            self.pre = stack_layers(acts, f"{c.blocks}:in")
        else:
            if not self.embeds:
                raise HookaxError(
                    f"{WHO}: the stream needs its start: give Components(blocks=...) (their "
                    f"inputs) or embed=... (the embeddings)."
                )
            start = jnp.broadcast_to(self._embed_sum(), self.attn.shape[1:])
            self.pre = start + jnp.concatenate([jnp.zeros_like(out[:1]), jnp.cumsum(out, 0)[:-1]])
        if c.final_norm is not None:
            self.final = _get(acts, f"{c.final_norm}:in")
        else:
            self.final = self.pre[-1] + out[-1]

    def _embed_sum(self) -> Any:
        total = self.embeds[0][1]
        for _, v in self.embeds[1:]:
            total = total + v
        return total

    def _layer(self, layer: int | None) -> int:
        if layer is None or layer == -1:
            return self.n_layers
        if not 0 <= layer <= self.n_layers:
            raise HookaxError(f"{WHO}: layer={layer} is outside 0..{self.n_layers}.")
        return layer

    # --- the stream at each layer -------------------------------------------------------------

    def resid_pre(self, layer: int) -> Any:
        """The stream entering block ``layer`` (``layer == n_layers``: leaving the last)."""
        return self.final if layer == self.n_layers else self.pre[layer]

    def resid_mid(self, layer: int) -> Any:
        """The stream after block ``layer``'s attention (a sequential block)."""
        return self.pre[layer] + self.attn[layer]

    def accumulated_resid(
        self,
        layer: int | None = None,
        *,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos: Any = None,
    ) -> Stack:
        """The stream before each block up to ``layer`` (``None``: every block and the final
        stream, ``"final_post"``), as TransformerLens' ``accumulated_resid``: ``[layer + 1,
        ...]``; ``incl_mid`` adds the stream after each attention; ``apply_ln`` applies the
        final norm with its scale frozen (the logit lens, linearly)."""
        top = self._layer(layer)
        values, labels = [], []
        for i in range(top + 1):
            if i == self.n_layers:
                values.append(self.final)
                labels.append("final_post")
                continue
            values.append(self.pre[i])
            labels.append(f"{i}_pre")
            if incl_mid and i < top:
                values.append(self.resid_mid(i))
                labels.append(f"{i}_mid")
        return self._finish(values, labels, apply_ln, pos)

    def decompose_resid(
        self,
        layer: int | None = None,
        *,
        mode: str = "all",
        incl_embeds: bool = True,
        apply_ln: bool = False,
        pos: Any = None,
    ) -> Stack:
        """What the stream before ``layer`` is made of: the embeddings, then each block's
        attention and MLP outputs (``mode``: ``"all"``, ``"attn"``, ``"mlp"``), as
        TransformerLens' ``decompose_resid``; the components add up to ``resid_pre(layer)``."""
        if mode not in ("all", "attn", "mlp"):
            raise HookaxError(f"{WHO}: mode= takes 'all', 'attn' or 'mlp', got {mode!r}.")
        top = self._layer(layer)
        values, labels = [], []
        if incl_embeds:
            for key, v in self.embeds:
                values.append(jnp.broadcast_to(v, self.final.shape))
                labels.append(key)
        for i in range(top):
            if mode != "mlp":
                values.append(self.attn[i])
                labels.append(f"{i}_attn_out")
            if mode != "attn" and self.mlp is not None:
                values.append(self.mlp[i])
                labels.append(f"{i}_mlp_out")
        return self._finish(values, labels, apply_ln, pos)

    # --- heads ------------------------------------------------------------------------------

    def head_results(self) -> Any:
        """Each head's output after the output projection, without its bias: ``[layer, head,
        ..., position, d_model]`` (TransformerLens' ``hook_result``, stacked)."""
        c = self.components
        if c.heads is None:
            raise HookaxError(
                f"{WHO}: per-head results need the attention's output projection: "
                f"Components(heads='blocks/*/attn/out', n_heads=...)."
            )
        z, kernel = self._head_kernel(stack_layers(self.acts, f"{c.heads}:in"))
        if kernel.ndim == 3:  # (layer, heads x d_head, d_model): split by heads
            if not c.n_heads or kernel.shape[1] % c.n_heads:
                raise HookaxError(
                    f"{WHO}: the projection {c.heads!r} takes the heads concatenated "
                    f"({kernel.shape[1]} features); give Components(n_heads=...) dividing it."
                )
            kernel = kernel.reshape(kernel.shape[0], c.n_heads, -1, kernel.shape[-1])
            z = z.reshape(*z.shape[:-1], c.n_heads, -1)
        return jnp.einsum("l...he,lhed->lh...d", z, kernel.astype(z.dtype))

    def _head_kernel(self, z: Any) -> tuple[Any, Any]:
        """The projection's inputs and kernels, both with a leading layer axis."""
        c = self.components
        assert c.heads is not None
        path = split_method(c.heads)[0]
        if "*" not in path:  # a scanned stack's one call site: its kernel is stacked already
            return z, linear_at(self.weights, path, WHO).kernel
        rx = glob_to_regex(path)
        keys = [k[: -len(":in")] for k in self.acts if k.endswith(":in")]
        keys = [k for k in keys if rx.fullmatch(k)]
        return z, jnp.stack([linear_at(self.weights, k, WHO).kernel for k in keys])

    def stack_head_results(
        self,
        layer: int | None = None,
        *,
        incl_remainder: bool = False,
        apply_ln: bool = False,
        pos: Any = None,
    ) -> Stack:
        """Every head's result in the layers before ``layer``, labelled ``"L0H1"``, as
        TransformerLens' ``stack_head_results``; ``incl_remainder`` adds the rest of
        ``resid_pre(layer)`` (``"remainder"``)."""
        top = self._layer(layer)
        res = self.head_results()[:top]
        n_heads = res.shape[1]
        values = list(res.reshape(-1, *res.shape[2:]))
        labels = [f"L{i}H{h}" for i in range(top) for h in range(n_heads)]
        if incl_remainder:
            values.append(self.resid_pre(top) - res.sum((0, 1)))
            labels.append("remainder")
        return self._finish(values, labels, apply_ln, pos)

    def full_resid_decomposition(
        self, layer: int | None = None, *, apply_ln: bool = False, pos: Any = None
    ) -> Stack:
        """The stream before ``layer`` as every head's result, every MLP output, the
        embeddings and ``"bias"`` (the attention outputs' parts outside their heads: the output
        projections' biases), as TransformerLens' ``get_full_resid_decomposition`` with
        ``expand_neurons=False``; the components add up to ``resid_pre(layer)``."""
        top = self._layer(layer)
        res = self.head_results()[:top]
        values = list(res.reshape(-1, *res.shape[2:]))
        labels = [f"L{i}H{h}" for i in range(top) for h in range(res.shape[1])]
        if self.mlp is not None:
            values += list(self.mlp[:top])
            labels += [f"{i}_mlp_out" for i in range(top)]
        for key, v in self.embeds:
            values.append(jnp.broadcast_to(v, self.final.shape))
            labels.append(key)
        values.append((self.attn[:top] - res.sum(1)).sum(0))
        labels.append("bias")
        return self._finish(values, labels, apply_ln, pos)

    # --- the final norm and the unembedding ---------------------------------------------------

    def norm_scale(self) -> Any:
        """The final norm's scale in the forward (``sqrt(var + eps)`` of a LayerNorm, the RMS
        of an RMSNorm), per position: ``(..., position, 1)``. Read from the norm's own input
        and output, so its epsilon convention does not matter."""
        c = self.components
        if c.final_norm is None:
            raise HookaxError(f"{WHO}: the final norm is unknown: Components(final_norm='ln_f').")
        norm = norm_at(self.weights, c.final_norm, WHO, c.norm_kind)
        x = self.final
        y = _get(self.acts, c.final_norm)
        if norm.centered:
            x = x - x.mean(-1, keepdims=True)
        u = x if norm.scale is None else x * norm.scale
        if norm.bias is not None:
            y = y - norm.bias
        return (u * u).sum(-1, keepdims=True) / (u * y).sum(-1, keepdims=True)

    def apply_ln_to_stack(
        self, stack: Stack | Any, *, pos: Any = None, weight: bool = True
    ) -> Stack | Any:
        """The final norm applied to each component of ``stack`` with the forward's scale
        frozen: centred (a LayerNorm), divided by `norm_scale()`, times the norm's weight
        (``weight=False``: without it, as TransformerLens' ``apply_ln_to_stack``, which
        assumes the weight folded into the unembedding). Linear, so the components' results
        add up to the norm's output less its bias. ``pos`` is the positions the stack was
        sliced at."""
        values = stack.values if isinstance(stack, Stack) else stack
        norm = norm_at(
            self.weights, self.components.final_norm or "", WHO, self.components.norm_kind
        )
        if norm.centered:
            values = values - values.mean(-1, keepdims=True)
        values = values / _at_pos(self.norm_scale(), pos)
        if weight and norm.scale is not None:
            values = values * norm.scale
        return Stack(values, stack.labels) if isinstance(stack, Stack) else values

    def unembed_directions(self, tokens: Any) -> Any:
        """The unembedding's column of each token: ``(*tokens.shape, d_model)``."""
        c = self.components
        if c.unembed is None:
            raise HookaxError(f"{WHO}: the unembedding is unknown: Components(unembed=...).")
        kernel = unembed_at(self.weights, c.unembed, WHO).kernel
        return jnp.moveaxis(jnp.take(kernel, jnp.asarray(tokens), axis=-1), 0, -1)

    def logit_attrs(
        self,
        stack: Stack | Any,
        tokens: Any,
        incorrect_tokens: Any = None,
        *,
        pos: Any = None,
        weight: bool = True,
    ) -> Any:
        """Direct logit attribution: each component's contribution to the logit of ``tokens``
        (minus that of ``incorrect_tokens``), through the final norm with its scale frozen:
        ``[component, *stack's other axes but d_model]``. ``tokens`` broadcasts against the
        stack's axes between the components and ``d_model`` (``pos=-1`` and ``tokens`` of shape
        ``(batch,)`` for the answer at the last position)."""
        direction = self.unembed_directions(tokens)
        if incorrect_tokens is not None:
            direction = direction - self.unembed_directions(incorrect_tokens)
        normed = self.apply_ln_to_stack(stack, pos=pos, weight=weight)
        values = normed.values if isinstance(normed, Stack) else normed
        return (values * direction).sum(-1)

    # --- shared ---------------------------------------------------------------------------------

    def _finish(self, values: list[Any], labels: list[str], apply_ln: bool, pos: Any) -> Stack:
        stacked = jnp.stack([_at_pos(v, pos) for v in values]) if values else None
        if stacked is None:
            raise HookaxError(f"{WHO}: no components before that layer.")
        out = Stack(stacked, tuple(labels))
        return self.apply_ln_to_stack(out, pos=pos) if apply_ln else out
