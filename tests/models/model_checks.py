"""Checks of every feature on a third-party codebase's model, each against a hookax-free reference.

A codebase's test module describes its model as a :class:`Case` and calls these checks. The
reference is the model's forward written out by hand from the codebase's own modules (an
unrolled stack), with the edit of each check written into that code: ``ref(args, edit)`` runs
``args`` and calls ``edit(i, x)`` on the residual stream after layer ``i``; ``ref_heads(args,
edit)`` does the same to the per-head attention output entering each layer's output projection.

Each check records its largest difference against the reference with :func:`record`; with
``HOOKAX_MODELS_REPORT=path`` set, the records are appended to that file as JSON lines (the table
of ``docs/models.md`` is made from them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hookax as hx

Edit = Callable[[int, jax.Array], jax.Array]


def maxdiff(a: Any, b: Any) -> float:
    """The largest absolute difference between two arrays (float32)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def record(codebase: str, feature: str, diff: float | str) -> None:
    """Note a check's result for the report (see the module's docstring)."""
    path = os.environ.get("HOOKAX_MODELS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"codebase": codebase, "feature": feature, "diff": diff}) + "\n")


@dataclasses.dataclass
class Case:
    """A codebase's model, as the checks use it.

    Attributes:
      name: the codebase (and variant) for the report.
      fn: the forward, ``fn(*args) -> logits [batch, seq, vocab]`` (a module or a function).
      clean: ``fn``'s arguments of the clean run; ``corrupt``: of the corrupted run.
      n_layers: the number of decoder layers.
      layers: the ``where=`` of every layer (each its own key, or a scanned stack's one key).
      layer_values: ``acts`` (of ``hx.capture(fn, where=layers)``) -> the residual stream after
        each layer, a list.
      layer_part: the target naming the residual inside a layer's output for patching
        (``"layer_*.1"``: the second entry of a ``(cache, x)`` tuple).
      one_layer: the key of one layer (index 1), a scanned stack's ``"...[1]"``.
      ref: the hookax-free forward: ``ref(args, edit) -> (logits, [residual after each layer])``.
      probs_ops: the ``ops=`` of the attention probabilities; ``probs_ref(args)``: theirs by
        hand, one ``[batch, heads, q, k]`` array per layer; ``probs_values(vals)``: the captured
        values in that layout.
      heads_where / heads_ops: the per-head attention output as a patch target, ``head_axis`` its
        head axis; ``ref_heads(args, edit) -> (logits, [per-head value per layer])`` edits it.
      steer: ``(where, hook)``: a forward hook adding ``v`` to layer 1's residual, made by
        ``steer(v)``.
      n_params: the parameter count by hand; ``summary_args``: ``hx.summary``'s arguments.
      loss_args: ``(loss_fn, args)`` of a training loss whose first argument is differentiated;
        ``poison(args)``: those args with an Inf written into layer 2's weights;
        ``nonfinite_layer(nf)``: the layer ``hx.find_nonfinite``'s answer names.
    """

    name: str
    fn: Callable[..., Any]
    clean: tuple[Any, ...]
    corrupt: tuple[Any, ...]
    n_layers: int
    layers: Any
    layer_values: Callable[[dict[str, Any]], list[jax.Array]]
    layer_part: str
    one_layer: str
    ref: Callable[[tuple[Any, ...], Edit | None], tuple[jax.Array, list[jax.Array]]]
    d_model: int
    steer: Callable[[jax.Array], tuple[str, Callable[..., Any]]]
    n_params: int
    summary_args: tuple[Any, ...]
    probs_ops: str | None = None
    probs_ref: Callable[[tuple[Any, ...]], list[jax.Array]] | None = None
    probs_values: Callable[[dict[str, Any]], list[jax.Array]] | None = None
    heads_where: Any = None
    heads_ops: Any = None
    head_axis: int = 2
    n_heads: int = 0
    ref_heads: Callable[..., tuple[jax.Array, list[jax.Array]]] | None = None
    loss_args: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
    poison: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None
    nonfinite_layer: Callable[[Any], int | None] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def metric(logits: jax.Array) -> jax.Array:
    """A logit difference at the last position of the first example."""
    return logits[0, -1, 1] - logits[0, -1, 2]


def _weights(case: Case) -> jax.Array:
    logits = jax.eval_shape(case.fn, *case.clean)
    return jax.random.normal(jax.random.key(7), logits.shape, jnp.float32)


def check_summary(case: Case) -> None:
    s = hx.summary(*case.summary_args)
    assert s.totals.params == case.n_params, (s.totals.params, case.n_params)
    record(case.name, "summary params", f"exact ({case.n_params:,})")


def check_capture(case: Case) -> None:
    logits, acts = jax.jit(hx.capture(case.fn, where=case.layers))(*case.clean)
    ref_logits, ref_hs = jax.jit(lambda *a: case.ref(a, None))(*case.clean)
    got = case.layer_values(acts)
    assert len(got) == case.n_layers == len(ref_hs)
    d = max(maxdiff(g, r) for g, r in zip(got, ref_hs, strict=True))
    d = max(d, maxdiff(logits, ref_logits))
    assert d < 1e-4, d
    _, one = hx.capture(case.fn, where=case.one_layer)(*case.clean)
    (only,) = one.values()
    leaves = [x for x in jax.tree.leaves(only) if x.shape[-1] == case.d_model]
    d1 = maxdiff(leaves[-1], ref_hs[1])
    assert d1 < 1e-4, d1
    record(case.name, "capture every layer / one layer", f"{d:.1e} / {d1:.1e}")


def check_probs(case: Case) -> None:
    assert case.probs_ops and case.probs_ref and case.probs_values
    _, vals = jax.jit(hx.capture(case.fn, ops=case.probs_ops))(*case.clean)
    got = case.probs_values(vals)
    ref = jax.jit(lambda *a: case.probs_ref(a))(*case.clean)
    assert len(got) == case.n_layers == len(ref)
    d = max(maxdiff(g, r) for g, r in zip(got, ref, strict=True))
    assert d < 1e-5, d
    record(case.name, f"attention probabilities ops={case.probs_ops!r}", f"{d:.1e}")


def _perturbed_ref(case: Case, w: jax.Array) -> Callable[..., jax.Array]:
    def loss(eps: list[jax.Array], *args: Any) -> jax.Array:
        logits, _ = case.ref(args, lambda i, x: x + eps[i])
        return jnp.sum(logits * w)

    return loss


def check_grads(case: Case) -> None:
    w = _weights(case)

    def loss(*args: Any) -> jax.Array:
        return jnp.sum(case.fn(*args) * w)

    val, _, act_grads = hx.value_and_grad(loss, where=case.layers)(*case.clean)
    got = case.layer_values(act_grads)
    _, hs = case.ref(case.clean, None)
    eps = [jnp.zeros_like(h) for h in hs]
    ref_val, ref = jax.value_and_grad(_perturbed_ref(case, w))(eps, *case.clean)
    d = max(maxdiff(g, r) for g, r in zip(got, ref, strict=True))
    scale = max(float(jnp.max(jnp.abs(r))) for r in ref)
    assert d <= 1e-4 * max(1.0, scale), (d, scale)
    assert abs(float(val) - float(ref_val)) <= 1e-4 * max(1.0, abs(float(ref_val)))
    record(case.name, "activation gradients (hx.value_and_grad)", f"{d:.1e}")


def steering_vector(case: Case) -> jax.Array:
    return 3.0 * jax.random.normal(jax.random.key(3), (case.d_model,), jnp.float32)


def check_steering(case: Case) -> None:
    v = steering_vector(case)
    where, hook = case.steer(v)
    with hx.hooks(where=where, forward=hook):
        got = case.fn(*case.clean)
    ref, _ = case.ref(case.clean, lambda i, x: x + v if i == 1 else x)
    plain = case.fn(*case.clean)
    assert maxdiff(plain, ref) > 1e-2  # the edit changes the output
    d = maxdiff(got, ref)
    assert d < 1e-4, d
    record(case.name, "steering (hx.hooks) forward", f"{d:.1e}")


def _grid_ref(case: Case) -> np.ndarray:
    _, clean_hs = jax.jit(lambda *a: case.ref(a, None))(*case.clean)
    seq = clean_hs[0].shape[1]

    @jax.jit
    def one(layer: jax.Array, pos: jax.Array, *args: Any) -> jax.Array:
        def edit(i: int, x: jax.Array) -> jax.Array:
            hit = (jnp.arange(seq) == pos)[None, :, None] & (layer == i)
            return jnp.where(hit, clean_hs[i], x)

        return metric(case.ref(args, edit)[0])

    return np.array(
        [
            [one(jnp.int32(i), jnp.int32(p), *case.corrupt) for p in range(seq)]
            for i in range(case.n_layers)
        ]
    )


def check_patch_grid_layers(case: Case) -> None:
    grid = hx.patch_grid(case.fn, case.clean, case.corrupt, metric, where=case.layer_part)
    ref = _grid_ref(case)
    d = maxdiff(grid, ref)
    assert d < 1e-4 * max(1.0, float(np.max(np.abs(ref)))), d
    record(case.name, "patch_grid layers x positions", f"{d:.1e}")


def check_attribution(case: Case) -> None:
    est = hx.attribution_patch(case.fn, case.clean, case.corrupt, metric, where=case.layer_part)
    _, clean_hs = case.ref(case.clean, None)
    _, corrupt_hs = case.ref(case.corrupt, None)

    def m(eps: list[jax.Array], *args: Any) -> jax.Array:
        return metric(case.ref(args, lambda i, x: x + eps[i])[0])

    g = jax.grad(m)([jnp.zeros_like(h) for h in corrupt_hs], *case.corrupt)
    ref = np.stack(
        [
            jnp.sum((c - k) * gi, axis=tuple(a for a in range(c.ndim) if a != 1))
            for c, k, gi in zip(clean_hs, corrupt_hs, g, strict=True)
        ]
    )
    d = maxdiff(est, ref)
    assert d < 1e-4 * max(1.0, float(np.max(np.abs(ref)))), d
    record(case.name, "attribution_patch", f"{d:.1e}")


def check_patch_grid_heads(case: Case) -> None:
    assert case.ref_heads is not None
    grid = hx.patch_grid(
        case.fn,
        case.clean,
        case.corrupt,
        metric,
        where=case.heads_where,
        ops=case.heads_ops,
        heads=case.head_axis,
    )
    _, clean_h = jax.jit(lambda *a: case.ref_heads(a, None))(*case.clean)
    seq = clean_h[0].shape[1]
    ax = case.head_axis

    @jax.jit
    def one(layer: jax.Array, head: jax.Array, pos: jax.Array, *args: Any) -> jax.Array:
        def edit(i: int, h: jax.Array) -> jax.Array:
            shape = [1] * h.ndim
            shape[1], shape[ax] = seq, h.shape[ax]
            pos_hit = (jnp.arange(seq) == pos).reshape(
                [seq if a == 1 else 1 for a in range(h.ndim)]
            )
            head_hit = (jnp.arange(h.shape[ax]) == head).reshape(
                [h.shape[ax] if a == ax else 1 for a in range(h.ndim)]
            )
            return jnp.where(pos_hit & head_hit & (layer == i), clean_h[i], h)

        return metric(case.ref_heads(args, edit)[0])

    ref = np.array(
        [
            [
                [one(jnp.int32(i), jnp.int32(h), jnp.int32(p), *case.corrupt) for p in range(seq)]
                for h in range(case.n_heads)
            ]
            for i in range(case.n_layers)
        ]
    )
    d = maxdiff(grid, ref)
    assert d < 1e-4 * max(1.0, float(np.max(np.abs(ref)))), d
    record(case.name, "patch_grid heads", f"{d:.1e}")


def check_stats_train_step(case: Case) -> None:
    """``hx.value_grad_and_stats`` inside a jitted optax step: the step's loss, gradients and
    update equal the plain step's; the statistics equal the reference's norms."""
    assert case.loss_args is not None
    loss_fn, args = case.loss_args
    # A model (NNX) is differentiated by its parameters, as nnx.value_and_grad does.
    params_of = case.extra.get("params_of", lambda p: p)
    value_and_grad = case.extra.get("value_and_grad", jax.value_and_grad)
    opt = optax.adam(1e-3)
    state = opt.init(params_of(args[0]))

    @jax.jit
    def step(model: Any, state: Any, *rest: Any) -> Any:
        loss, grads, stats = hx.value_grad_and_stats(
            loss_fn, where=case.extra.get("stats_where", case.layers), stats=("norm",)
        )(model, *rest)
        updates, state = opt.update(grads, state, params_of(model))
        return optax.apply_updates(params_of(model), updates), state, loss, stats

    @jax.jit
    def plain(model: Any, state: Any, *rest: Any) -> Any:
        loss, grads = value_and_grad(loss_fn)(model, *rest)
        updates, state = opt.update(grads, state, params_of(model))
        return optax.apply_updates(params_of(model), updates), state, loss

    with jax.numpy_dtype_promotion("standard"):  # optax's updates mix Python floats and ints
        new, _, loss, stats = step(args[0], state, *args[1:])
        new_ref, _, loss_ref = plain(args[0], state, *args[1:])
    d = max(
        maxdiff(a, b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new_ref), strict=True)
    )
    d = max(d, maxdiff(loss, loss_ref))
    norms = case.extra["stats_norms"](stats)
    ref_norms = case.extra["stats_ref"]()
    dn = maxdiff(norms, ref_norms) / max(1.0, float(np.max(np.abs(ref_norms))))
    assert d < 1e-5 and dn < 1e-5, (d, dn)
    record(case.name, "value_grad_and_stats in a jitted optax step", f"{max(d, dn):.1e}")


def check_nonfinite(case: Case) -> None:
    assert case.loss_args and case.poison and case.nonfinite_layer
    loss_fn, args = case.loss_args
    assert hx.find_nonfinite(loss_fn, *args) is None
    bad = case.poison(args)
    # The reference: the first layer whose residual is not finite, by hand.
    _, hs = case.ref(case.extra.get("poison_ref_args", lambda b: b)(bad), None)
    first = next(i for i, h in enumerate(hs) if not bool(jnp.all(jnp.isfinite(h))))
    nf = hx.find_nonfinite(loss_fn, *bad)
    assert nf is not None and nf.phase == "forward", nf
    assert case.nonfinite_layer(nf) == first == 2, (str(nf), first)
    record(case.name, "find_nonfinite (Inf in layer 2)", f"names layer 2 ({nf.label})")


def check_profile(case: Case) -> None:
    assert case.loss_args is not None
    loss_fn, args = case.loss_args
    grad = case.extra.get("grad", jax.grad)
    prof = hx.profile(grad(loss_fn), *args, runs=2, warmup=1)
    own = sum(r.forward_ms + r.backward_ms for r in prof.rows)
    total = own + prof.other_ms + prof.idle_ms
    assert abs(total - prof.step_ms) <= 1e-3 * max(1.0, prof.step_ms), (total, prof.step_ms)
    keys = [r.key for r in prof.rows]
    assert len(keys) > case.n_layers, keys
    record(case.name, "profile", f"rows add up ({len(keys)} rows)")


def harvest_and_read(
    case: Case, fn: Callable[..., Any], batches: Sequence[tuple[Any, ...]], where: str, name: str
) -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="hookax-models-"), "acts")
    hx.harvest(fn, batches, where=where, store=path, row_axes=2, progress=False)
    refs = []
    for b in batches:
        _, hs = case.ref(case.extra["batch_args"](b), None)
        refs.append(np.asarray(hs[1]).reshape(-1, case.d_model))
    ref = np.concatenate(refs)
    store = hx.open_store(path)
    assert name in store.names, (name, store.names)
    reader = hx.StoreReader(path, name, batch_size=ref.shape[0], seed=0, epochs=1)
    (got,) = [np.asarray(b) for b in reader]
    order = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731
    d = maxdiff(order(got), order(ref))
    assert d < 1e-4, d
    record(case.name, f"harvest {name!r} + StoreReader", f"{d:.1e}")


class Checks:
    """The features every codebase is checked for, one test each; a module's ``TestX(Checks)``
    class runs them on that module's ``case`` fixture (and overrides one to mark or extend it)."""

    def test_summary_parameter_count(self, case: Case) -> None:
        check_summary(case)

    def test_capture_every_layer(self, case: Case) -> None:
        check_capture(case)

    def test_attention_probabilities_by_ops(self, case: Case) -> None:
        check_probs(case)

    def test_activation_gradients(self, case: Case) -> None:
        check_grads(case)

    def test_steering_forward(self, case: Case) -> None:
        check_steering(case)

    def test_patch_grid_layers_by_positions(self, case: Case) -> None:
        check_patch_grid_layers(case)

    def test_patch_grid_heads(self, case: Case) -> None:
        check_patch_grid_heads(case)

    def test_attribution_patch(self, case: Case) -> None:
        check_attribution(case)

    def test_stats_in_an_optax_train_step(self, case: Case) -> None:
        check_stats_train_step(case)

    def test_find_nonfinite_names_the_layer(self, case: Case) -> None:
        check_nonfinite(case)

    def test_profile_rows_add_up(self, case: Case) -> None:
        check_profile(case)


def nnx_wrappers() -> tuple[type, type]:
    """Two NNX modules that write an edit into a model's code: around a submodule, editing its
    output (``EditOutput``) or its first argument (``EditInput``). Swapped into a copy of the
    model (``nnx.merge`` of its split state) for a reference run."""
    from flax import nnx

    class EditOutput(nnx.Module):
        def __init__(self, inner: Any, fn: Callable[[Any], Any]) -> None:
            self.inner, self.fn = inner, fn

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.fn(self.inner(*args, **kwargs))

    class EditInput(nnx.Module):
        def __init__(self, inner: Any, fn: Callable[[Any], Any]) -> None:
            self.inner, self.fn = inner, fn

        def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
            return self.inner(self.fn(x), *args, **kwargs)

    return EditOutput, EditInput
