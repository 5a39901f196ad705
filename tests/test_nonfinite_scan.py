"""``hx.find_nonfinite`` names the layer where a non-finite value arose in a Linen ``nn.scan`` +
``nn.remat`` stack whose layers call a call site twice (MaxText's rotary embedding, for queries
and keys), checked against the same layers run one by one."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hookax as hx

D = 8
N = 4
X = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)


class Rotary(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * jnp.cos(jnp.arange(x.shape[-1], dtype=x.dtype))


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        rotary = Rotary(name="rotary_embedding")
        q = rotary(nn.Dense(D, name="query")(x))
        k = rotary(nn.Dense(D, name="key")(x))
        return nn.Dense(D, name="out")(q * k)


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm(name="pre_self_attention_layer_norm")(x)
        x = x + Attention(name="self_attention")(h)
        h = nn.LayerNorm(name="post_norm")(x)
        return x + nn.Dense(D, name="mlp")(h), None


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            nn.remat(Layer),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=N,
        )
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(1, name="head")(x)


def _mlp_outputs_by_hand(params):
    """Each layer's ``mlp`` output, the layers run one by one (no hookax)."""
    outs, x = [], X
    for i in range(N):
        p = jax.tree.map(lambda a, i=i: a[i], params["params"]["layers"])
        (x, _), state = Layer().apply(
            {"params": p}, x, None, capture_intermediates=True, mutable=["intermediates"]
        )
        outs.append(state["intermediates"]["mlp"]["__call__"][0])
    return outs


@pytest.mark.parametrize("jitted", [False, True], ids=["plain", "jitted apply"])
def test_an_inf_in_layer_2_of_a_scanned_remat_stack_is_found_in_layer_2(jitted):
    model = Decoder()
    params = model.init(jax.random.key(0), X)
    kernel = params["params"]["layers"]["mlp"]["kernel"]
    params["params"]["layers"]["mlp"]["kernel"] = kernel.at[2, 0, 0].set(jnp.inf)
    apply = jax.jit(model.apply) if jitted else model.apply

    def loss(p, x):
        return jnp.mean(apply(p, x) ** 2)

    found = hx.find_nonfinite(loss, params, X)
    by_hand = _mlp_outputs_by_hand(params)
    first = next(i for i, o in enumerate(by_hand) if not np.isfinite(o).all())
    assert first == 2
    assert (found.phase, found.key, found.layer) == ("forward", "layers/mlp", 2)
    assert found.count == int((~np.isfinite(by_hand[2])).sum())
    assert found.before == "layers/post_norm[2]"
