"""Every feature on a Llama written the way Levanter writes it (``levanter_like.py``: Equinox
modules returning NamedArray-like pytrees, the layers scanned as ``lax.scan`` xs), against the
same layers run one by one with each edit written into the code.

The registry's Levanter and Haliax releases do not import on the supported JAX, so the
structure is tested on this model (no third-party dependency: it runs with the slow tests and
in ``nox -s models``).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import levanter_like as ll
import model_checks as mc
import numpy as np
import optax  # noqa: F401  (the train step's optimizer, in model_checks)
import pytest

import hookax as hx

pytestmark = pytest.mark.slow
NAME = "Levanter-like (Equinox, scanned, NamedArray)"
B, SEQ = 2, 6
STACK = "transformer/stacked"


@pytest.fixture(scope="module")
def case() -> mc.Case:
    model = ll.make(jax.random.key(0))
    clean_ids = jax.random.randint(jax.random.key(1), (B, SEQ), 0, ll.V)
    corrupt_ids = clean_ids.at[:, 1:3].set(jax.random.randint(jax.random.key(2), (B, 2), 0, ll.V))

    def loss_fn(model: Any, ids: jax.Array) -> jax.Array:
        logits = ll.logits(model, ids)
        return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1, :] * jax.nn.one_hot(ids[:, 1:], ll.V))

    def poison(args: tuple[Any, ...]) -> tuple[Any, ...]:
        model, ids = args
        w = model.transformer.stacked.mlp.down_proj.weight
        return (
            eqx.tree_at(
                lambda m: m.transformer.stacked.mlp.down_proj.weight,
                model,
                w.at[2, 0, 0].set(jnp.inf),
            ),
            ids,
        )

    def steer(v: jax.Array) -> tuple[str, Any]:
        return STACK + "[1]", lambda module, args, out: ll.Named(out.array + v, out.axes)

    def stats_ref() -> np.ndarray:
        return np.array([jnp.linalg.norm(h) for h in ll.unrolled(model, clean_ids)[1]])

    return mc.Case(
        name=NAME,
        fn=ll.logits,
        clean=(model, clean_ids),
        corrupt=(model, corrupt_ids),
        n_layers=ll.LAYERS,
        layers=STACK,
        layer_values=lambda acts: list(acts[STACK][0].array),
        layer_part=STACK + "[0:3]",  # the NamedArray itself: its array patched
        one_layer=STACK + "[1]",
        ref=lambda args, edit: ll.unrolled(*args, edit=edit)[:2],
        d_model=ll.D,
        steer=steer,
        n_params=sum(p.size for p in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))),
        summary_args=(model, clean_ids),
        probs_ops=STACK + "/self_attn:softmax",
        probs_ref=lambda args: ll.unrolled(*args)[3],
        probs_values=lambda vals: list(vals[STACK + "/self_attn:softmax"][0]),
        heads_ops=STACK + "/self_attn[0:3]:transpose",
        head_axis=2,
        n_heads=ll.HEADS,
        ref_heads=lambda args, edit: (lambda r: (r[0], r[2]))(ll.unrolled(*args, head_edit=edit)),
        loss_args=(loss_fn, (model, clean_ids)),
        poison=poison,
        nonfinite_layer=lambda nf: nf.layer if isinstance(nf.layer, int) else None,
        extra={
            "stats_where": STACK,
            "stats_norms": lambda s: np.asarray(s[STACK]["act"]["norm"]),
            "stats_ref": stats_ref,
            "params_of": lambda m: eqx.filter(m, eqx.is_inexact_array),
            "value_and_grad": eqx.filter_value_and_grad,
            "grad": eqx.filter_grad,
            "batch_args": lambda b: b,
        },
    )


class TestLevanterLike(mc.Checks):
    """The features every codebase is checked for (``model_checks.Checks``), on this case."""


def test_captured_stack_names_its_layer_axis(case: mc.Case) -> None:
    """A NamedArray stacked by the scan over layers gains the layer axis in front; one layer
    taken from it has the layer's own axes."""
    _, acts = hx.capture(case.fn, where=[STACK, STACK + "[1]"])(*case.clean)
    (stack,) = acts[STACK]
    assert stack.shape == {"layers": ll.LAYERS, "batch": B, "position": SEQ, "embed": ll.D}
    (one,) = acts[STACK + "[1]"]
    assert one.shape == {"batch": B, "position": SEQ, "embed": ll.D}
    np.testing.assert_array_equal(one.array, stack.array[1])
    want = ll.unrolled(*case.clean)[1][1]
    np.testing.assert_allclose(one.array, want, rtol=1e-5, atol=1e-5)


def test_harvest_one_layer_read_back(case: mc.Case) -> None:
    model = case.clean[0]
    batches = [(model, case.clean[1]), (model, case.corrupt[1])]
    mc.harvest_and_read(case, ll.logits, batches, where=case.one_layer, name=case.one_layer)
