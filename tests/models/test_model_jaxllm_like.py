"""Every feature on a program without modules: a Llama written the way jax-llm-examples writes
its models (``jaxllm_like.py``: plain functions over a pytree of dataclasses, ``jax.named_scope``
blocks, a Python loop over layers or a ``lax.scan`` over stacked layer weights, a KV cache,
``prefill`` + a jitted ``decode_step`` in a greedy Python loop), each value against the same
program edited by hand (``jaxllm_like.ref_*``: an extra argument or edit written into the code).

Addresses, as hookax names the call sites of a program without modules: the function given to
the API is the root ``''``; every call of a user function is keyed by its name under its
caller (``forward_layer/1/attention_block``), every ``jax.named_scope`` block by its name
(``forward_layer/1/residual/1``: the second ``residual`` block of layer 1); a name called more
than once under one parent gets ``/0``, ``/1``, ...; a function that ``lax.scan`` calls is one
call site with a layer suffix (``forward_layer[1]``); ``.0`` is the first part of a tuple output;
``:in`` a call site's input. A loss function given to the API is the root of its own tree, so
the model's layers are ``forward/forward_layer/i`` there.
"""

from __future__ import annotations

import os
import types
from typing import Any

import jax
import jax.numpy as jnp
import jaxllm_like as jl
import model_checks as mc
import numpy as np
import optax
import pytest

import hookax as hx

NAME = "jax-llm-examples-like (plain functions, named scopes)"
B, SEQ = 2, 6
CFG = jl.CFG
L = CFG.num_layers
PROBS = "attention_block/attention/attention:softmax"  # inside forward_layer/i
HEADS = "attention_block/attention/attention"  # the attention function: [B, heads, T, head_dim]


def close(got: Any, want: Any, tol: float = 1e-5) -> float:
    d = mc.maxdiff(got, want)
    scale = max(1.0, float(np.max(np.abs(np.asarray(want, np.float32)))))
    assert d <= tol * scale, (d, scale)
    return d


@pytest.fixture(scope="module")
def case() -> types.SimpleNamespace:
    """The weights (a layer list and the same layers stacked), a clean and a corrupted batch
    of prompts, each run's arguments, and the clean run's values by hand."""
    weights = jl.init_weights(jax.random.key(0), CFG)
    clean = jax.random.randint(jax.random.key(1), (B, SEQ), 0, CFG.vocab_size)
    corrupt = clean.at[:, 1:3].set(jax.random.randint(jax.random.key(2), (B, 2), 0, CFG.vocab_size))
    seg = jl.segments(clean)
    logits, updates, rec = jl.ref_run(clean, weights, CFG)
    return types.SimpleNamespace(
        weights=weights,
        stacked=jl.stack_layers(weights),
        clean=clean,
        corrupt=corrupt,
        seg=seg,
        clean_args=(clean, seg, weights, CFG),
        corrupt_args=(corrupt, seg, weights, CFG),
        logits=logits,
        updates=updates,
        rec=rec,
    )


def loss_fn(weights: jl.Weights, tokens: jax.Array, seg: jax.Array) -> jax.Array:
    """Next-token cross-entropy of ``forward`` (the root of its call sites: ``forward/...``)."""
    logits, _ = jl.forward(tokens, seg, weights, CFG)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(tokens[:, 1:], CFG.vocab_size), -1))


def scan_loss_fn(weights: jl.Weights, tokens: jax.Array, seg: jax.Array) -> jax.Array:
    logits, _ = jl.forward_scan(tokens, seg, weights, CFG)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(tokens[:, 1:], CFG.vocab_size), -1))


def steering_vector() -> jax.Array:
    return 3.0 * jax.random.normal(jax.random.key(3), (CFG.embed,), jnp.float32)


def steer_layer_1(v: jax.Array) -> Any:
    """The hand edit: ``v`` added to the residual stream after layer 1."""
    return lambda i, h: h + v if i == 1 else h


def test_summary_counts_every_weight_once(case: types.SimpleNamespace) -> None:
    """``hx.summary(forward, ...)``: the total parameter count equals the weight pytree's size
    (the integer tokens and segment ids are inputs, not parameters), for the layer list and the
    stacked layers alike; the rows name the functions and named scopes as they nest."""
    n = jl.n_params(case.weights)
    s = hx.summary(jl.forward, *case.clean_args)
    assert s.totals.params == n, (s.totals.params, n)
    keys = {r.key for r in s.rows}
    want = {
        "",
        *(f"forward_layer/{i}" for i in range(L)),
        "forward_layer/0/attention_block",
        "forward_layer/0/attention_block/attention/attention",
        "forward_layer/2/ffn/ffn_block",
        "forward_layer/2/residual/1",
    }
    assert want <= keys, sorted(want - keys)
    scanned = hx.summary(jl.forward_scan, case.clean, case.seg, case.stacked, CFG)
    assert scanned.totals.params == n, (scanned.totals.params, n)
    assert "forward_layer" in {r.key for r in scanned.rows}
    mc.record(NAME, "summary params", f"exact ({n:,})")


def test_capture_every_layer_its_input_and_named_scopes(case: types.SimpleNamespace) -> None:
    """Under ``jax.jit``: each ``forward_layer/i`` returns ``(residual, (keys, values))`` equal
    to the hand-run's; ``forward_layer/1:in`` begins with the residual entering layer 1; the
    second ``residual`` scope's output is the layer's residual; the ``rope`` scope's output is
    ``(q, k)`` rotated (two values used after the block, in computation order)."""
    where = ["forward_layer/*", "forward_layer/1:in", "forward_layer/1/residual/1",
             "forward_layer/1/attention_block/rope"]  # fmt: skip
    (logits, _), acts = jax.jit(hx.capture(jl.forward, where=where))(*case.clean_args)
    d = close(logits, case.logits)
    for i in range(L):
        ((h, (k, v)),) = acts[f"forward_layer/{i}"]
        d = max(d, close(h, case.rec.hs[i]), close(k, case.updates[i][0]))
        d = max(d, close(v, case.updates[i][1]))
    (inp,) = acts["forward_layer/1:in"]
    close(inp[0] if isinstance(inp, tuple) else inp, case.rec.ins[1])
    (resid,) = acts["forward_layer/1/residual/1"]
    close(resid, case.rec.hs[1])
    ((q, k),) = acts["forward_layer/1/attention_block/rope"]

    @jax.jit
    def rotated(tokens: jax.Array, weights: jl.Weights, h: jax.Array) -> Any:
        layer = weights.layers[1]
        _, sin, cos = jl.ref_embed_and_positions(tokens, case.seg, weights, CFG, None)
        attn_in = jl.rms_norm(h, layer.attn_pre_gamma, CFG.norm_eps)
        return jl.ref_attention_inputs(attn_in, case.seg, layer, sin, cos, CFG, None, None)[:2]

    q_ref, k_ref = rotated(case.clean, case.weights, case.rec.ins[1])
    close(q, q_ref)
    close(k, k_ref)
    mc.record(NAME, "capture every layer (Python loop), :in, named scopes", f"{d:.1e}")


def test_capture_a_scanned_stack_and_one_layer(case: types.SimpleNamespace) -> None:
    """``forward_scan``: ``forward_layer`` (every layer, stacked on a leading axis) and
    ``forward_layer[1]`` (layer 1 alone) equal the layer-by-layer hand run."""
    fn = hx.capture(jl.forward_scan, where=["forward_layer", "forward_layer[1]"])
    (logits, _), acts = jax.jit(fn)(case.clean, case.seg, case.stacked, CFG)
    close(logits, case.logits)
    ((hs, (ks, vs)),) = acts["forward_layer"]
    assert hs.shape == (L, B, SEQ, CFG.embed), hs.shape
    d = max(close(hs[i], case.rec.hs[i]) for i in range(L))
    d = max(d, *(close(ks[i], case.updates[i][0]) for i in range(L)))
    d = max(d, *(close(vs[i], case.updates[i][1]) for i in range(L)))
    ((one, _),) = acts["forward_layer[1]"]
    d1 = close(one, case.rec.hs[1])
    mc.record(NAME, "capture scanned stack / one layer", f"{d:.1e} / {d1:.1e}")


def test_attention_probabilities_by_ops(case: types.SimpleNamespace) -> None:
    """The ``softmax`` inside ``attention`` of every layer (``ops=`` glob over the Python loop;
    one stacked address in the scan) equals the probabilities the hand run appends."""
    ops = f"forward_layer/*/{PROBS}"
    _, vals = jax.jit(hx.capture(jl.forward, ops=ops))(*case.clean_args)
    d = max(close(vals[f"forward_layer/{i}/{PROBS}"][0], case.rec.probs[i]) for i in range(L))
    _, svals = jax.jit(hx.capture(jl.forward_scan, ops=f"forward_layer/{PROBS}"))(
        case.clean, case.seg, case.stacked, CFG
    )
    (stacked,) = svals[f"forward_layer/{PROBS}"]
    want = jnp.stack(case.rec.probs)
    close(jnp.reshape(stacked, want.shape), want)
    mc.record(NAME, f"attention probabilities ops={ops!r}", f"{d:.1e}")


@pytest.fixture(scope="module")
def grads(case: types.SimpleNamespace) -> types.SimpleNamespace:
    """``loss_fn``'s value and weight gradients (``jax.value_and_grad``), and its gradient with
    respect to each layer's residual output by hand (a zero added there, differentiated)."""
    value, weights = jax.jit(jax.value_and_grad(loss_fn))(case.weights, case.clean, case.seg)

    def ce(logits: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(case.clean[:, 1:], CFG.vocab_size), -1))

    ref_value, layers = jl.ref_layer_grads(ce, case.weights, CFG, case.clean)
    close(ref_value, value)
    return types.SimpleNamespace(value=value, weights=weights, layers=layers)


def test_activation_gradients(case: types.SimpleNamespace, grads: types.SimpleNamespace) -> None:
    """``hx.value_and_grad`` of a loss calling ``forward``: d loss / d (each layer's residual)
    equals the gradient with respect to a zero added to that layer's output by hand; the value
    and the weights' gradient equal ``jax.value_and_grad``'s."""
    val, weight_grads, act_grads = hx.value_and_grad(loss_fn, where="forward/forward_layer/*")(
        case.weights, case.clean, case.seg
    )
    d = max(
        close(act_grads[f"forward/forward_layer/{i}"][0][0], grads.layers[i], 1e-4)
        for i in range(L)
    )
    close(val, grads.value)
    for g, p in zip(jax.tree.leaves(weight_grads), jax.tree.leaves(grads.weights), strict=True):
        close(g, p)
    mc.record(NAME, "activation gradients (hx.value_and_grad)", f"{d:.1e}")


def test_steering_forward_with_a_hook(case: types.SimpleNamespace) -> None:
    """A forward hook on ``forward_layer/1`` adding a vector to its residual output, under
    ``jax.jit`` of ``hx.program(forward)`` (traced before the hook existed), equals the forward
    with that addition written in; after the block the jitted forward is the plain one again."""
    v = steering_vector()
    ref = jax.jit(lambda args: jl.ref_forward(*args, edit=steer_layer_1(v))[0])
    want = ref(case.clean_args)
    assert mc.maxdiff(want, case.logits) > 1e-2  # the edit changes the output
    jitted = jax.jit(hx.program(jl.forward))
    close(jitted(*case.clean_args)[0], case.logits)  # traced before the hook exists

    def hook(_: Any, args: Any, out: Any) -> Any:
        return out[0] + v, out[1]

    with hx.hooks(where="forward_layer/1", forward=hook):
        got, _ = jitted(*case.clean_args)
    d = close(got, want)
    close(jitted(*case.clean_args)[0], case.logits)
    mc.record(NAME, "steering (hx.hooks) forward", f"{d:.1e}")


def test_steering_inside_the_models_own_decode_loop(
    case: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``generate`` (``prefill``'s ``jax.jit(forward)`` with the cache donated, then the jitted
    ``decode_step`` in a Python loop) with layer 1's residual steered in every call by an
    interceptor gives the tokens of the loop steered by hand (``ref_generate``); before and
    after the block it gives the plain tokens (``decode_step``'s plain trace is not reused
    inside the block, nor the steered one after it). The codebase's ``forward`` is made
    hookable once, where it is defined (``module.forward = hx.program(module.forward)``), as
    the docs show: its own ``prefill`` and ``decode_step`` then call it."""
    monkeypatch.setattr(jl, "forward", hx.program(jl.forward))
    v = steering_vector()
    steps = 4
    plain = jl.generate(case.clean, case.weights, CFG, steps)
    want = jl.ref_generate(case.clean, case.weights, CFG, steps, steer_layer_1(v))
    assert not np.array_equal(want, plain)  # steering changes the generated tokens

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        return out[0] + v, out[1]

    # prefill's and decode_step's traces each have forward_layer/1 below their own root
    with hx.intercept(interceptor, where="**/forward_layer/1"):
        got = jl.generate(case.clean, case.weights, CFG, steps)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(jl.generate(case.clean, case.weights, CFG, steps), plain)
    mc.record(NAME, "steered greedy generation (hx.intercept)", "tokens equal")


@pytest.fixture(scope="module")
def layer_grid(case: types.SimpleNamespace) -> np.ndarray:
    return np.asarray(jl.ref_layer_grid(case.weights, CFG, case.clean, case.corrupt))


def test_patch_grid_layers_by_positions(
    case: types.SimpleNamespace, layer_grid: np.ndarray
) -> None:
    """``hx.patch_grid`` over each layer's residual (``forward_layer/*.0``; the scanned stack's
    ``forward_layer[0:3].0``) by position equals the grid patched by hand."""
    grid = hx.patch_grid(
        jl.forward, case.clean_args, case.corrupt_args, jl.metric, where="forward_layer/*.0"
    )
    assert np.shape(grid) == (L, SEQ)
    d = close(grid, layer_grid, 1e-4)
    scanned = hx.patch_grid(
        jl.forward_scan,
        (case.clean, case.seg, case.stacked, CFG),
        (case.corrupt, case.seg, case.stacked, CFG),
        jl.metric,
        where=f"forward_layer[0:{L}].0",
    )
    d = max(d, close(scanned, layer_grid, 1e-4))
    mc.record(NAME, "patch_grid layers x positions (loop, scan)", f"{d:.1e}")


def test_patch_grid_heads(case: types.SimpleNamespace) -> None:
    """``hx.patch_grid`` over each head of ``attention``'s output (``[B, heads, T, head_dim]``:
    ``heads=1``, positions on ``axis=2``) equals patching that head by hand before the
    projection: ``[layer, head, position]``."""
    grid = hx.patch_grid(
        jl.forward,
        case.clean_args,
        case.corrupt_args,
        jl.metric,
        where=f"forward_layer/*/{HEADS}",
        heads=1,
        axis=2,
    )
    ref = np.asarray(jl.ref_head_grid(case.weights, CFG, case.clean, case.corrupt))
    assert np.shape(grid) == ref.shape == (L, CFG.q_heads, SEQ)
    d = close(grid, ref, 1e-4)
    mc.record(NAME, "patch_grid heads", f"{d:.1e}")


def test_attribution_patch(case: types.SimpleNamespace) -> None:
    """``hx.attribution_patch`` over each layer's residual equals gradient x (clean - corrupted)
    computed by hand (a zero added to each layer's output, differentiated at the corrupted
    run), summed over the batch and the embedding."""
    est = hx.attribution_patch(
        jl.forward, case.clean_args, case.corrupt_args, jl.metric, where="forward_layer/*.0"
    )
    ref = np.asarray(jl.ref_attribution(case.weights, CFG, case.clean, case.corrupt))
    assert np.shape(est) == ref.shape == (L, SEQ)
    d = close(est, ref, 1e-4)
    mc.record(NAME, "attribution_patch", f"{d:.1e}")


def test_stats_in_a_jitted_optax_step(
    case: types.SimpleNamespace, grads: types.SimpleNamespace
) -> None:
    """``hx.value_grad_and_stats`` inside a jitted optax step: the loss and the weights'
    gradients equal ``jax.value_and_grad``'s; each layer's residual norm and its gradient's
    norm equal the hand run's (the gradient: a zero added to the layer's output,
    differentiated); the update is applied."""
    opt = optax.adam(1e-3)
    where = "forward/forward_layer/*/residual/1"

    @jax.jit
    def step(weights: jl.Weights, state: Any, tokens: jax.Array, seg: jax.Array) -> Any:
        loss, g, stats = hx.value_grad_and_stats(loss_fn, where=where, stats=("norm",))(
            weights, tokens, seg
        )
        updates, state = opt.update(g, state, weights)
        return optax.apply_updates(weights, updates), state, loss, g, stats

    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and ints
        new, _, loss, g, stats = step(case.weights, opt.init(case.weights), case.clean, case.seg)
    close(loss, grads.value)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads.weights), strict=True):
        close(a, b)
    assert mc.maxdiff(new.lm_head, case.weights.lm_head) > 0
    for i in range(L):
        s = stats[f"forward/forward_layer/{i}/residual/1"]
        close(s["act"]["norm"], jnp.linalg.norm(case.rec.hs[i]))
        close(s["grad"]["norm"], jnp.linalg.norm(grads.layers[i]), 1e-4)
    mc.record(NAME, "value_grad_and_stats in a jitted optax step", "equal")


def test_find_nonfinite_names_the_function_and_the_layer(case: types.SimpleNamespace) -> None:
    """A NaN written into layer 2's down projection: ``hx.find_nonfinite`` finds nothing on the
    clean weights and, on the poisoned ones, the first non-finite output in layer 2's
    ``down_proj`` (every call site), or ``forward_layer/2`` (the layers only; layer 1 just before
    it finite); in the scan, the stack with layer index 2. The hand run agrees: the residual
    after layer 2 is the first one with a NaN."""
    bad = jl.poisoned(case.weights, layer=2)
    _, _, rec = jl.ref_run(case.clean, bad, CFG)
    first = next(i for i, h in enumerate(rec.hs) if not bool(jnp.all(jnp.isfinite(h))))
    assert first == 2
    assert hx.find_nonfinite(loss_fn, case.weights, case.clean, case.seg) is None
    nf = hx.find_nonfinite(loss_fn, bad, case.clean, case.seg)
    assert nf is not None and nf.phase == "forward", nf
    assert nf.key.startswith("forward/forward_layer/2/ffn/ffn_block/down_proj"), str(nf)
    nf = hx.find_nonfinite(loss_fn, bad, case.clean, case.seg, where="forward/forward_layer/*")
    assert nf is not None and nf.key == "forward/forward_layer/2", str(nf)
    assert nf.before == "forward/forward_layer/1", str(nf)
    nf = hx.find_nonfinite(scan_loss_fn, jl.stack_layers(bad), case.clean, case.seg,
                           where="forward_scan/forward_layer")  # fmt: skip
    assert nf is not None and nf.key == "forward_scan/forward_layer" and nf.layer == 2, str(nf)
    mc.record(NAME, "find_nonfinite (NaN in layer 2)", f"names {nf.label}")


def test_harvest_one_layer(case: types.SimpleNamespace, tmp_path: Any) -> None:
    """``hx.harvest`` of layer 1's residual (its second ``residual`` scope) over two batches,
    one row per token: the rows read back equal the hand runs' residuals, batch by batch."""
    key = "forward_layer/1/residual/1"
    batches = [case.clean_args, case.corrupt_args]
    h = hx.harvest(jl.forward, batches, where=key, store=os.fspath(tmp_path / "acts"),
                   row_axes=2, progress=False)  # fmt: skip
    got = np.asarray(h.read(key))
    want = np.concatenate(
        [np.asarray(jl.ref_run(t, case.weights, CFG)[2].hs[1]) for t in (case.clean, case.corrupt)]
    ).reshape(-1, CFG.embed)
    d = close(got, want)
    mc.record(NAME, f"harvest {key!r}", f"{d:.1e}")
