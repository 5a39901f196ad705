"""One tiny GPT (pre-LayerNorm, learned positions, biases everywhere) written in each framework
with the same weights, and its forward by hand with every intermediate value.

``nnx``: an ``nnx.List`` of blocks whose attention is four ``nnx.Linear``; ``mha``: the same with
``nnx.MultiHeadAttention``; ``scanned``: the blocks stacked and run under ``nnx.scan`` (one call
site per module, values stacked by layer); ``linen``: ``nn.Dense`` layers in ``setup``;
``equinox``: ``eqx.nn.Linear`` applied with ``jax.vmap`` (Equinox's idiom). ``hand`` is the
reference every view is compared with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

L, H, DH, D, M, V, T, B = 2, 2, 4, 8, 16, 11, 5, 2
EPS = 1e-5


def _weights() -> dict[str, Any]:
    ks = iter(jax.random.split(jax.random.key(3), 40))

    def r(*shape: int, s: float = 0.5) -> jax.Array:
        return s * jax.random.normal(next(ks), shape)

    w: dict[str, Any] = {"W_E": r(V, D, s=1.0), "W_pos": r(T, D), "W_U": r(D, V), "b_U": r(V)}
    w["ln_f"] = (1.0 + r(D, s=0.2), r(D, s=0.2))
    for name, shape in [
        ("ln1", None),
        ("ln2", None),
        ("W_Q", (D, H * DH)),
        ("W_K", (D, H * DH)),
        ("W_V", (D, H * DH)),
        ("b_Q", (H * DH,)),
        ("b_K", (H * DH,)),
        ("b_V", (H * DH,)),
        ("W_O", (H * DH, D)),
        ("b_O", (D,)),
        ("W_in", (D, M)),
        ("b_in", (M,)),
        ("W_out", (M, D)),
        ("b_out", (D,)),
    ]:
        if shape is None:
            w[name] = (1.0 + r(L, D, s=0.2), r(L, D, s=0.2))
        else:
            w[name] = r(L, *shape)
    return w


WEIGHTS = _weights()
TOKENS = jnp.array([[1, 4, 7, 2, 9], [3, 3, 10, 0, 5]])
CORRUPT = TOKENS.at[:, 1].set(jnp.array([6, 8]))


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + EPS) * g + b


def _keep(name: str, layer: int, value: jax.Array) -> jax.Array:
    return value


def hand(tokens: jax.Array, w: dict[str, Any] = WEIGHTS, edit: Any = _keep) -> dict[str, Any]:
    """The forward by hand: every value a residual view is built from, per layer.
    ``edit(name, layer, value)`` rewrites each named value as it is computed (a hand patch)."""
    out: dict[str, Any] = {"embed": w["W_E"][tokens], "pos_embed": w["W_pos"][: tokens.shape[1]]}
    x = out["embed"] + out["pos_embed"]
    keys = ("resid_pre", "attn_out", "mlp_out", "z", "pattern", "q", "k", "v", "resid_mid")
    acc: dict[str, list[Any]] = {k: [] for k in keys}
    causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
    for layer in range(L):
        x = edit("resid_pre", layer, x)
        acc["resid_pre"].append(x)
        h = layer_norm(x, w["ln1"][0][layer], w["ln1"][1][layer])
        q, k, v = (
            edit(
                n.lower(),
                layer,
                (h @ w[f"W_{n}"][layer] + w[f"b_{n}"][layer]).reshape(*h.shape[:2], H, DH),
            )
            for n in "QKV"
        )
        scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(jnp.float32(DH))
        pattern = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), -1)
        pattern = edit("pattern", layer, pattern)
        z = edit("z", layer, jnp.einsum("bhqk,bkhe->bqhe", pattern, v))
        attn = z.reshape(*z.shape[:2], H * DH) @ w["W_O"][layer] + w["b_O"][layer]
        attn = edit("attn_out", layer, attn)
        x = x + attn
        acc["resid_mid"].append(x)
        h = layer_norm(x, w["ln2"][0][layer], w["ln2"][1][layer])
        mlp = jax.nn.gelu(h @ w["W_in"][layer] + w["b_in"][layer]) @ w["W_out"][layer]
        mlp = edit("mlp_out", layer, mlp + w["b_out"][layer])
        x = x + mlp
        for name, val in [("attn_out", attn), ("mlp_out", mlp), ("z", z), ("pattern", pattern)]:
            acc[name].append(val)
        for name, val in [("q", q), ("k", k), ("v", v)]:
            acc[name].append(val)
    out.update({k: jnp.stack(v) for k, v in acc.items()})
    out["resid_final"] = x
    mu = x.mean(-1, keepdims=True)
    out["scale"] = jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + EPS)
    out["logits"] = layer_norm(x, *w["ln_f"]) @ w["W_U"] + w["b_U"]
    return out


# --- NNX ----------------------------------------------------------------------------------------


def _linear(din: int, dout: int, kernel: Any, bias: Any) -> nnx.Linear:
    lin = nnx.Linear(din, dout, rngs=nnx.Rngs(0))
    lin.kernel.set_value(kernel)
    lin.bias.set_value(bias)
    return lin


def _norm(g: Any, b: Any) -> nnx.LayerNorm:
    ln = nnx.LayerNorm(D, epsilon=EPS, rngs=nnx.Rngs(0))
    ln.scale.set_value(g)
    ln.bias.set_value(b)
    return ln


def causal_attention(q: Any, k: Any, v: Any) -> Any:
    """``(b, t, h, e)`` queries, keys and values -> ``z`` of the same layout, causal."""
    t = q.shape[1]
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    mask = jnp.tril(jnp.ones((t, t), bool))
    pattern = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), -1)
    return jnp.einsum("bhqk,bkhe->bqhe", pattern, v)


class Attn(nnx.Module):
    def __init__(self, layer: int, w: dict[str, Any]) -> None:
        self.q, self.k, self.v = (
            _linear(D, H * DH, w[f"W_{n}"][layer], w[f"b_{n}"][layer]) for n in "QKV"
        )
        self.out = _linear(H * DH, D, w["W_O"][layer], w["b_O"][layer])

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (f(x).reshape(*x.shape[:2], H, DH) for f in (self.q, self.k, self.v))
        z = causal_attention(q, k, v)
        return self.out(z.reshape(*x.shape[:2], H * DH))


class MLPBlock(nnx.Module):
    def __init__(self, layer: int, w: dict[str, Any]) -> None:
        self.fc_in = _linear(D, M, w["W_in"][layer], w["b_in"][layer])
        self.fc_out = _linear(M, D, w["W_out"][layer], w["b_out"][layer])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(jax.nn.gelu(self.fc_in(x)))


class MHA(nnx.Module):
    """``nnx.MultiHeadAttention`` with a causal mask, the same weights as :class:`Attn`."""

    def __init__(self, layer: int, w: dict[str, Any]) -> None:
        self.attn = nnx.MultiHeadAttention(
            H, D, qkv_features=H * DH, decode=False, rngs=nnx.Rngs(0)
        )
        for name, n in [("query", "Q"), ("key", "K"), ("value", "V")]:
            lin = getattr(self.attn, name)
            lin.kernel.set_value(w[f"W_{n}"][layer].reshape(D, H, DH))
            lin.bias.set_value(w[f"b_{n}"][layer].reshape(H, DH))
        self.attn.out.kernel.set_value(w["W_O"][layer].reshape(H, DH, D))
        self.attn.out.bias.set_value(w["b_O"][layer])

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        return self.attn(x, mask=mask)


class NBlock(nnx.Module):
    def __init__(self, layer: int, w: dict[str, Any], mha: bool = False) -> None:
        self.ln1 = _norm(w["ln1"][0][layer], w["ln1"][1][layer])
        self.attn = MHA(layer, w).attn if mha else Attn(layer, w)
        self.mha = mha
        self.ln2 = _norm(w["ln2"][0][layer], w["ln2"][1][layer])
        self.mlp = MLPBlock(layer, w)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.ln1(x)
        if self.mha:
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            x = x + self.attn(h, mask=mask)
        else:
            x = x + self.attn(h)
        return x + self.mlp(self.ln2(x))


class NGPT(nnx.Module):
    def __init__(self, w: dict[str, Any] = WEIGHTS, mha: bool = False) -> None:
        self.embed = nnx.Embed(V, D, rngs=nnx.Rngs(0))
        self.embed.embedding.set_value(w["W_E"])
        self.pos_embed = nnx.Embed(T, D, rngs=nnx.Rngs(0))
        self.pos_embed.embedding.set_value(w["W_pos"])
        self.blocks = nnx.List([NBlock(i, w, mha) for i in range(L)])
        self.ln_f = _norm(*w["ln_f"])
        self.unembed = _linear(D, V, w["W_U"], w["b_U"])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


class ScannedGPT(nnx.Module):
    """The blocks (with ``nnx.MultiHeadAttention``) stacked on a leading axis and run under
    ``nnx.scan``."""

    def __init__(self, w: dict[str, Any] = WEIGHTS) -> None:
        plain = NGPT(w, mha=True)
        self.embed, self.pos_embed, self.ln_f, self.unembed = (
            plain.embed,
            plain.pos_embed,
            plain.ln_f,
            plain.unembed,
        )
        states = [nnx.state(b) for b in plain.blocks]
        graphdef = nnx.graphdef(plain.blocks[0])
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        self.blocks = nnx.merge(graphdef, stacked)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, block: NBlock) -> jax.Array:
            return block(x)

        return self.unembed(self.ln_f(body(x, self.blocks)))


# --- Linen --------------------------------------------------------------------------------------


class LAttn(nn.Module):
    def setup(self) -> None:
        self.q, self.k, self.v = nn.Dense(H * DH), nn.Dense(H * DH), nn.Dense(H * DH)
        self.out = nn.Dense(D)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (f(x).reshape(*x.shape[:2], H, DH) for f in (self.q, self.k, self.v))
        return self.out(causal_attention(q, k, v).reshape(*x.shape[:2], H * DH))


class LMLP(nn.Module):
    def setup(self) -> None:
        self.fc_in, self.fc_out = nn.Dense(M), nn.Dense(D)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(jax.nn.gelu(self.fc_in(x)))


class LBlock(nn.Module):
    def setup(self) -> None:
        self.ln1, self.ln2 = nn.LayerNorm(epsilon=EPS), nn.LayerNorm(epsilon=EPS)
        self.attn, self.mlp = LAttn(), LMLP()

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LGPT(nn.Module):
    def setup(self) -> None:
        self.embed, self.pos_embed = nn.Embed(V, D), nn.Embed(T, D)
        self.blocks = [LBlock() for _ in range(L)]
        self.ln_f, self.unembed = nn.LayerNorm(epsilon=EPS), nn.Dense(V)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


def linen_variables(w: dict[str, Any] = WEIGHTS) -> dict[str, Any]:
    def dense(k: Any, b: Any) -> dict[str, Any]:
        return {"kernel": k, "bias": b}

    def norm(g: Any, b: Any) -> dict[str, Any]:
        return {"scale": g, "bias": b}

    p: dict[str, Any] = {
        "embed": {"embedding": w["W_E"]},
        "pos_embed": {"embedding": w["W_pos"]},
        "ln_f": norm(*w["ln_f"]),
        "unembed": dense(w["W_U"], w["b_U"]),
    }
    for i in range(L):
        p[f"blocks_{i}"] = {
            "ln1": norm(w["ln1"][0][i], w["ln1"][1][i]),
            "ln2": norm(w["ln2"][0][i], w["ln2"][1][i]),
            "attn": {n.lower(): dense(w[f"W_{n}"][i], w[f"b_{n}"][i]) for n in "QKV"}
            | {"out": dense(w["W_O"][i], w["b_O"][i])},
            "mlp": {
                "fc_in": dense(w["W_in"][i], w["b_in"][i]),
                "fc_out": dense(w["W_out"][i], w["b_out"][i]),
            },
        }
    return {"params": p}


# --- Equinox ------------------------------------------------------------------------------------


def _elinear(kernel: Any, bias: Any) -> eqx.nn.Linear:
    lin = eqx.nn.Linear(kernel.shape[0], kernel.shape[1], key=jax.random.key(0))
    return eqx.tree_at(lambda m: (m.weight, m.bias), lin, (kernel.T, bias))


def _enorm(g: Any, b: Any) -> eqx.nn.LayerNorm:
    ln = eqx.nn.LayerNorm(D, eps=EPS)
    return eqx.tree_at(lambda m: (m.weight, m.bias), ln, (g, b))


def per_token(f: Any, x: jax.Array) -> jax.Array:
    """``f`` of one vector applied over ``(batch, position)``: Equinox's idiom."""
    return jax.vmap(jax.vmap(f))(x)


class EAttn(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    out: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (per_token(f, x).reshape(*x.shape[:2], H, DH) for f in (self.q, self.k, self.v))
        return per_token(self.out, causal_attention(q, k, v).reshape(*x.shape[:2], H * DH))


class EMLP(eqx.Module):
    fc_in: eqx.nn.Linear
    fc_out: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return per_token(self.fc_out, jax.nn.gelu(per_token(self.fc_in, x)))


class EBlock(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: EAttn
    ln2: eqx.nn.LayerNorm
    mlp: EMLP

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(per_token(self.ln1, x))
        return x + self.mlp(per_token(self.ln2, x))


class EGPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos_embed: eqx.nn.Embedding
    blocks: list[EBlock]
    ln_f: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, w: dict[str, Any] = WEIGHTS) -> None:
        self.embed = eqx.nn.Embedding(weight=w["W_E"])
        self.pos_embed = eqx.nn.Embedding(weight=w["W_pos"])
        self.blocks = [
            EBlock(
                _enorm(w["ln1"][0][i], w["ln1"][1][i]),
                EAttn(*(_elinear(w[f"W_{n}"][i], w[f"b_{n}"][i]) for n in "QKVO")),
                _enorm(w["ln2"][0][i], w["ln2"][1][i]),
                EMLP(_elinear(w["W_in"][i], w["b_in"][i]), _elinear(w["W_out"][i], w["b_out"][i])),
            )
            for i in range(L)
        ]
        self.ln_f = _enorm(*w["ln_f"])
        self.unembed = _elinear(w["W_U"], w["b_U"])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = per_token(self.embed, tokens) + jax.vmap(self.pos_embed)(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return per_token(self.unembed, per_token(self.ln_f, x))


@dataclasses.dataclass
class GPT:
    """One framework's model: ``fn(*pre, tokens)`` runs it; ``weights`` is what a residual view
    reads kernels from (the model, or Linen's variables); ``blocks`` its blocks' path glob."""

    name: str
    fn: Any
    pre: tuple[Any, ...]
    weights: Any
    blocks: str

    def args(self, tokens: jax.Array) -> tuple[Any, ...]:
        return (*self.pre, tokens)


def make(name: str) -> GPT:
    if name == "nnx":
        m = NGPT()
        return GPT(name, m, (), m, "blocks/*")
    if name == "mha":
        m = NGPT(mha=True)
        return GPT(name, m, (), m, "blocks/*")
    if name == "scanned":
        s = ScannedGPT()
        return GPT(name, s, (), s, "blocks")
    if name == "linen":
        variables = linen_variables()
        return GPT(name, LGPT().apply, (variables,), variables, "blocks_*")
    e = EGPT()
    return GPT(name, e, (), e, "blocks/*")


FRAMEWORKS = ["nnx", "mha", "scanned", "linen", "equinox"]
