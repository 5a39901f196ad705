"""The residual stream of a transformer, seen through captured values: ``hx.Components`` names
a model's parts by call-site path, ``hx.ResidualStream`` builds TransformerLens'
``ActivationCache`` views from a capture of them.

Nothing here knows an architecture. The stream is what the components' call sites carried: a
block's input is its ``resid_pre``, the attention and MLP outputs are what each block adds, the
final norm's input is the last ``resid_post``. Per-head results split the attention's output
projection by heads from its own kernel (the projection's input times each head's rows of the
kernel); the final norm is applied to a stack linearly, with the scale it used in the forward
read from its own input and output, or recomputed for each entry (the logit lens). What the
named embeddings do not explain of the first block's input is a component of its own,
``"embed_rest"`` (a positional embedding added inline), so the views add up. Unrolled layers
(``"blocks/*"``) and a scanned stack (``"blocks"``, values stacked by layer) give the same
views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._engine.select import glob_to_regex, split_method
from .._patching.cache import stack_layers
from .._util.errors import HookaxError
from . import norm as _norm
from .components import Components, as_tuple
from .stack import Stack
from .weights import Norm, linear_at, norm_at, unembed_at

__all__ = ["Components", "ResidualStream"]

WHO = "hx.ResidualStream"


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


def _known(x: Any) -> bool:
    """Whether ``x``'s values are known now (not traced by a transform)."""
    return not isinstance(x, jax.core.Tracer)


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
    projection's bias). ``"embed_rest"`` follows the embeddings: what they do not explain of
    the first block's input (a positional embedding added inline, not by a module call; see
    ``Components.embed_rest``).
    """

    def __init__(self, acts: Mapping[str, tuple[Any, ...]], components: Components, weights: Any):
        c = self.components = components
        self.weights = weights
        acts = {k: _first(v) if k.endswith(":in") else v for k, v in acts.items()}
        self.acts = acts
        self.attn = stack_layers(acts, c.attn)
        self.n_layers = int(self.attn.shape[0])
        self.mlp = None if c.mlp is None else stack_layers(acts, c.mlp)
        self.embeds = [(k, _get(acts, k)) for k in as_tuple(c.embed)]
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
        self.rest = self._embed_rest()

    def _embed_rest(self) -> Any:
        """The first block's input less the named embeddings, where the views carry it."""
        c = self.components
        if c.blocks is None or not self.embeds:
            return None
        if c.embed_rest is False and not _known(self.pre):
            return None
        rest = self.pre[0] - self._embed_sum()
        if c.embed_rest is True or not _known(rest):
            return rest
        gap = float(jnp.abs(rest).max())
        if gap <= 1e-6 * float(jnp.abs(self.pre[0]).max()):
            return None
        if c.embed_rest is False:
            keys = ", ".join(repr(k) for k, _ in self.embeds)
            raise HookaxError(
                f"{WHO}: the embeddings {keys} do not make up the input of {c.blocks!r}'s first "
                f"block (it differs from their sum by up to {gap:.3g}: a positional embedding "
                f"added inline?), so the decompositions would not add up. Fix: name the "
                f"missing embedding in Components(embed=...), or leave embed_rest=None to "
                f"carry it as 'embed_rest'."
            )
        return rest

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
        frozen_ln: bool = False,
        pos: Any = None,
    ) -> Stack:
        """The stream before each block up to ``layer`` (``None``: every block and the final
        stream, ``"final_post"``), as TransformerLens' ``accumulated_resid``: ``[layer + 1,
        ...]``; ``incl_mid`` adds the stream after each attention.

        ``apply_ln`` applies the final norm to each entry with that entry's own statistics, as
        the model would to that stream (the logit lens; TransformerLens 3.9's ``apply_ln=True``),
        the norm's weight and bias included. ``frozen_ln`` applies it linearly instead, with the
        scale of the forward's final stream frozen, as `apply_ln_to_stack`."""
        if apply_ln and frozen_ln:
            raise HookaxError(
                f"{WHO}: apply_ln=True recomputes the final norm for each entry, frozen_ln=True "
                f"freezes the forward's scale; give one of them."
            )
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
        if not apply_ln:
            return self._finish(values, labels, frozen_ln, pos)
        out = self._finish(values, labels, False, pos)
        path = self.components.final_norm or ""
        return Stack(_norm.recomputed(self._final_norm(), out.values, path, WHO), out.labels)

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
        TransformerLens' ``decompose_resid``; the components add up to ``resid_pre(layer)``
        (``"embed_rest"`` follows the embeddings where they do not make up the stream's start).
        ``apply_ln`` applies the final norm with the forward's scale frozen, as
        `apply_ln_to_stack`."""
        if mode not in ("all", "attn", "mlp"):
            raise HookaxError(f"{WHO}: mode= takes 'all', 'attn' or 'mlp', got {mode!r}.")
        top = self._layer(layer)
        values, labels = self._embed_parts() if incl_embeds else ([], [])
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
        embeddings (and ``"embed_rest"``) and ``"bias"`` (the attention outputs' parts outside
        their heads: the output projections' biases), as TransformerLens'
        ``get_full_resid_decomposition`` with ``expand_neurons=False``; the components add up
        to ``resid_pre(layer)``."""
        top = self._layer(layer)
        res = self.head_results()[:top]
        values = list(res.reshape(-1, *res.shape[2:]))
        labels = [f"L{i}H{h}" for i in range(top) for h in range(res.shape[1])]
        if self.mlp is not None:
            values += list(self.mlp[:top])
            labels += [f"{i}_mlp_out" for i in range(top)]
        parts, names = self._embed_parts()
        values += parts
        labels += names
        values.append((self.attn[:top] - res.sum(1)).sum(0))
        labels.append("bias")
        return self._finish(values, labels, apply_ln, pos)

    def _embed_parts(self) -> tuple[list[Any], list[str]]:
        """The named embeddings and ``"embed_rest"`` (where carried), at the stream's shape."""
        values = [jnp.broadcast_to(v, self.final.shape) for _, v in self.embeds]
        labels = [key for key, _ in self.embeds]
        if self.rest is not None:
            values.append(self.rest)
            labels.append("embed_rest")
        return values, labels

    # --- the final norm and the unembedding ---------------------------------------------------

    def _final_norm(self) -> Norm:
        c = self.components
        if c.final_norm is None:
            raise HookaxError(f"{WHO}: the final norm is unknown: Components(final_norm='ln_f').")
        norm = norm_at(self.weights, c.final_norm, WHO, c.norm_kind)
        return norm if c.norm_eps is None else dataclasses.replace(norm, eps=c.norm_eps)

    def norm_scale(self) -> Any:
        """The final norm's scale in the forward (``sqrt(var + eps)`` of a LayerNorm, the RMS
        of an RMSNorm), per position: ``(..., position, 1)``. Read from the norm's own input
        and output, so its epsilon convention does not matter."""
        norm = self._final_norm()
        return _norm.forward_scale(
            norm, self.final, _get(self.acts, f"{self.components.final_norm}")
        )

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
        scale = _at_pos(self.norm_scale(), pos)
        values = _norm.frozen(self._final_norm(), values, scale, weight=weight)
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
