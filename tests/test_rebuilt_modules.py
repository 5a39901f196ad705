"""Modules that a JAX transform rebuilds inside the model keep the path of the module they came
from: NNX layers split and merged inside ``jax.checkpoint`` and ``lax.scan`` (the functional NNX
API, as MaxText's NNX decoder runs its layers), and Equinox layers passed as ``lax.scan`` xs (a
Haliax ``Stacked``-like stack returning a NamedArray-like pytree, and a stack scanned by hand).
Every value is checked against the same layers computed by hand."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

N = 3
D = 4
X = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)


def by_hand(w, b, x, edit=None):
    """Each layer's output ``h + tanh(h @ w[i] + b[i])``; ``edit(i, pre)`` changes the inner
    linear's output of layer ``i``."""
    outs, h = [], x
    for i in range(len(w)):
        o = h @ w[i] + b[i]
        if edit is not None:
            o = edit(i, o)
        h = h + jnp.tanh(o)
        outs.append(h)
    return outs


def _steer(next_fun, args, kwargs, ctx):
    return next_fun(*args, **kwargs) + 1.5


# ---------------------------------------------------------------------------------------------
# NNX: nnx.split -> jax.checkpoint(pure function) -> nnx.merge(...)(x)


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.mlp(x))


def _merged(layer: nnx.Module, x: jax.Array) -> jax.Array:
    graphdef, state = nnx.split(layer)

    def pure(state, x):
        return nnx.merge(graphdef, state)(x)

    return jax.checkpoint(pure)(state, x)


class Unscanned(nnx.Module):
    """MaxText's unscanned NNX decoder: ``layers_0``, ``layers_1``, ... each run merged."""

    def __init__(self) -> None:
        for i in range(N):
            setattr(self, f"layers_{i}", Layer(nnx.Rngs(i)))

    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(N):
            x = _merged(getattr(self, f"layers_{i}"), x)
        return x


class Scanned(nnx.Module):
    """MaxText's scanned NNX decoder: stacked layers split once, merged in a remat'd scan body."""

    def __init__(self) -> None:
        @nnx.split_rngs(splits=N)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Layer:
            return Layer(rngs)

        self.layers = make(nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        graphdef, state = nnx.split(self.layers)

        def body(h, state):
            return nnx.merge(graphdef, state)(h), None

        return jax.lax.scan(jax.checkpoint(body), x, state)[0]


class Model(nnx.Module):
    def __init__(self, decoder: nnx.Module) -> None:
        self.decoder = decoder
        self.head = nnx.Linear(D, 2, rngs=nnx.Rngs(9))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.decoder(x))


def _nnx_weights(model: Model):
    d = model.decoder
    if isinstance(d, Scanned):
        return d.layers.mlp.kernel[...], d.layers.mlp.bias[...]
    layers = [getattr(d, f"layers_{i}") for i in range(N)]
    return [m.mlp.kernel[...] for m in layers], [m.mlp.bias[...] for m in layers]


def _run_nnx(mode, fn, model, x):
    if mode == "eager":
        return fn(model, x)
    return (jax.jit if mode == "jax.jit" else nnx.jit)(fn)(model, x)


NNX_MODES = ["eager", "jax.jit", "nnx.jit"]


@pytest.mark.parametrize("mode", NNX_MODES)
def test_nnx_layers_merged_inside_checkpoint_keep_their_paths(mode):
    model = Model(Unscanned())
    w, b = _nnx_weights(model)
    want = by_hand(w, b, X)

    def f(m, x):
        return hx.capture(m)(x)

    y, acts = _run_nnx(mode, f, model, X)
    assert list(acts) == [
        "",
        "decoder",
        *(k for i in range(N) for k in (f"decoder/layers_{i}", f"decoder/layers_{i}/mlp")),
        "head",
    ]
    for i in range(N):
        np.testing.assert_allclose(acts[f"decoder/layers_{i}"][0], want[i], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(acts[""][0], y)

    def g(m, x):
        with hx.intercept(_steer, where="decoder/layers_1/mlp"):
            return m(x)

    edited = by_hand(w, b, X, lambda i, o: o + 1.5 if i == 1 else o)[-1]
    np.testing.assert_allclose(
        _run_nnx(mode, g, model, X), model.head(edited), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("mode", NNX_MODES)
def test_nnx_layers_merged_in_a_scan_keep_the_stack_path(mode):
    model = Model(Scanned())
    w, b = _nnx_weights(model)
    want = by_hand(w, b, X)

    def f(m, x):
        return hx.capture(m, where=hx.Select(paths=("decoder/layers", "decoder/layers/mlp[1]")))(x)

    _, acts = _run_nnx(mode, f, model, X)
    assert set(acts) == {"decoder/layers", "decoder/layers/mlp[1]"}
    np.testing.assert_allclose(acts["decoder/layers"][0], jnp.stack(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        acts["decoder/layers/mlp[1]"][0], want[0] @ w[1] + b[1], rtol=1e-6, atol=1e-6
    )

    def g(m, x):
        with hx.intercept(_steer, where="decoder/layers/mlp[2]"):
            return m(x)

    edited = by_hand(w, b, X, lambda i, o: o + 1.5 if i == 2 else o)[-1]
    np.testing.assert_allclose(
        _run_nnx(mode, g, model, X), model.head(edited), rtol=1e-5, atol=1e-6
    )


def test_a_merge_outside_the_model_call_is_its_own_root():
    """Split outside, merged inside a jitted function: the merged model is the root (``''``)."""
    model = Model(Unscanned())
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda st, x: hx.capture(lambda x: nnx.merge(graphdef, st)(x), where="head")(x))
    _, acts = f(state, X)
    assert list(acts) == ["head"]


# ---------------------------------------------------------------------------------------------
# Equinox: layers passed as lax.scan xs


@jax.tree_util.register_pytree_with_keys_class
class Named:
    """A NamedArray-like pytree: one array and the names of its axes (static)."""

    def __init__(self, array: jax.Array, axes: tuple[str, ...]) -> None:
        self.array = array
        self.axes = axes

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("array"), self.array),), self.axes

    @classmethod
    def tree_unflatten(cls, axes, children):
        return cls(children[0], axes)


class ELinear(eqx.Module):
    weight: Named
    bias: Named

    def __init__(self, key: jax.Array) -> None:
        self.weight = Named(jax.random.normal(key, (D, D)) / 2, ("embed", "out"))
        self.bias = Named(jnp.linspace(-0.5, 0.5, D), ("out",))

    def __call__(self, x: Named) -> Named:
        return Named(x.array @ self.weight.array + self.bias.array, ("batch", "out"))


class EBlock(eqx.Module):
    mlp: ELinear

    def __call__(self, x: Named) -> Named:
        return Named(x.array + jnp.tanh(self.mlp(x).array), x.axes)


class Stacked(eqx.Module):
    """Haliax's ``Stacked``: one module whose arrays have a leading layer axis, folded by
    ``lax.scan`` with the stacked module as xs."""

    stacked: EBlock

    def fold(self, x: Named) -> Named:
        return jax.lax.scan(lambda h, block: (block(h), None), x, self.stacked)[0]


class Transformer(eqx.Module):
    layers: Stacked

    def __call__(self, x: Named) -> Named:
        return self.layers.fold(x)


class LM(eqx.Module):
    transformer: Transformer
    head: eqx.nn.Linear

    def __init__(self) -> None:
        keys = jax.random.split(jax.random.key(1), N)
        stacked = eqx.filter_vmap(lambda k: EBlock(ELinear(k)))(keys)
        self.transformer = Transformer(Stacked(stacked))
        self.head = eqx.nn.Linear(D, 2, key=jax.random.key(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.transformer(Named(x, ("batch", "embed")))
        return jax.vmap(self.head)(h.array)


def _lm_weights(model: LM):
    mlp = model.transformer.layers.stacked.mlp
    return mlp.weight.array, mlp.bias.array


def _run_eqx(jitted, fn, *args):
    return eqx.filter_jit(fn)(*args) if jitted else fn(*args)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "filter_jit"])
def test_equinox_layers_scanned_as_xs_keep_their_path(jitted):
    model = LM()
    w, b = _lm_weights(model)
    want = by_hand(w, b, X)
    y, acts = _run_eqx(jitted, lambda m, x: hx.capture(m)(x), model, X)
    stack = "transformer/layers/stacked"
    assert sorted(acts) == ["", "head", "transformer", stack, f"{stack}/mlp"]
    np.testing.assert_allclose(acts[""][0], y)  # the root's output only
    np.testing.assert_allclose(acts[stack][0].array, jnp.stack(want), rtol=1e-6, atol=1e-6)
    one = f"{stack}/mlp[1]"
    _, acts = _run_eqx(jitted, lambda m, x: hx.capture(m, where=one)(x), model, X)
    np.testing.assert_allclose(acts[one][0].array, want[0] @ w[1] + b[1], rtol=1e-6, atol=1e-6)

    def steered(m, x):
        def steer(next_fun, args, kwargs, ctx):
            out = next_fun(*args, **kwargs)
            return Named(out.array + 1.5, out.axes)

        with hx.intercept(steer, where=f"{stack}/mlp[2]"):
            return m(x)

    edited = by_hand(w, b, X, lambda i, o: o + 1.5 if i == 2 else o)[-1]
    np.testing.assert_allclose(
        _run_eqx(jitted, steered, model, X), jax.vmap(model.head)(edited), rtol=1e-5, atol=1e-6
    )


class Twin(eqx.Module):
    """Two stacks of the same structure, each scanned by its own module."""

    encoder: Transformer
    decoder: Transformer

    def __init__(self) -> None:
        def stack(seed):
            keys = jax.random.split(jax.random.key(seed), N)
            return Transformer(Stacked(eqx.filter_vmap(lambda k: EBlock(ELinear(k)))(keys)))

        self.encoder, self.decoder = stack(3), stack(4)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.decoder(self.encoder(Named(x, ("batch", "embed")))).array


def test_equinox_stacks_of_one_structure_are_told_apart_by_their_caller():
    model = Twin()
    _, acts = hx.capture(model, where="**/stacked")(X)
    enc, dec = (getattr(model, n).layers.stacked.mlp for n in ("encoder", "decoder"))
    want_enc = by_hand(enc.weight.array, enc.bias.array, X)
    want_dec = by_hand(dec.weight.array, dec.bias.array, want_enc[-1])
    np.testing.assert_allclose(
        acts["encoder/layers/stacked"][0].array, jnp.stack(want_enc), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        acts["decoder/layers/stacked"][0].array, jnp.stack(want_dec), rtol=1e-6, atol=1e-6
    )
