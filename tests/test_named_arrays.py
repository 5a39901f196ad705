"""Call sites that return a NamedArray-like pytree (one array and its axis names, as Haliax's
``NamedArray``, whose ``.shape`` is a dict) are patching targets like the array they hold:
values in, the names kept out; captured values keep their names. Every value is checked against
the same layers computed by hand."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hookax as hx

D, T = 4, 5


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass
class Named:
    """Like ``haliax.NamedArray``: ``.array``, ``.axes`` (names, its static data), ``.shape``
    a dict name -> size, and a check that the names fit the array (Haliax's
    ``__post_init__``)."""

    array: jax.Array
    axes: tuple[str, ...]

    def __post_init__(self):
        if isinstance(self.array, jax.Array) and jnp.ndim(self.array) != len(self.axes):
            raise ValueError(f"axes {self.axes} do not fit an array of shape {self.array.shape}")

    @property
    def shape(self):
        return dict(zip(self.axes, self.array.shape, strict=True))

    @property
    def dtype(self):
        return self.array.dtype

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("array"), self.array),), self.axes

    @classmethod
    def tree_unflatten(cls, axes, children):
        return cls(children[0], axes)


class Linear(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, x: Named) -> Named:
        return Named(x.array @ self.w + self.b, x.axes)


class Net(eqx.Module):
    a: Linear
    b: Linear

    def __init__(self):
        k1, k2 = jax.random.split(jax.random.key(0))
        self.a = Linear(jax.random.normal(k1, (D, D)) / 2, jnp.linspace(-0.5, 0.5, D))
        self.b = Linear(jax.random.normal(k2, (D, D)) / 2, jnp.zeros(D))

    def __call__(self, x: Named) -> Named:
        return self.b(Named(jnp.tanh(self.a(x).array), x.axes))


AXES = ("batch", "position", "embed")
CLEAN = Named(jnp.linspace(-1.0, 1.0, T * D).reshape(1, T, D), AXES)
CORRUPT = Named(CLEAN.array + 1.0, AXES)


def metric(y):
    return y.array[0, -1].sum()


def _after_a(net, h):
    return jnp.tanh(h) @ net.b.w + net.b.b


def _a(net, x):
    return x.array @ net.a.w + net.a.b


def _run(jitted, fn, *args):
    return eqx.filter_jit(fn)(*args) if jitted else fn(*args)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "filter_jit"])
def test_capture_keeps_the_names(jitted):
    net = Net()
    _, acts = _run(jitted, lambda m, x: hx.capture(m, where="a")(x), net, CLEAN)
    assert isinstance(acts["a"][0], Named) and acts["a"][0].axes == AXES
    np.testing.assert_allclose(acts["a"][0].array, _a(net, CLEAN), rtol=1e-6)


def test_patch_grid_and_attribution():
    net = Net()
    ha, hc = _a(net, CORRUPT), _a(net, CLEAN)
    want = [metric(Named(_after_a(net, ha.at[:, p].set(hc[:, p])), AXES)) for p in range(T)]
    grid = hx.patch_grid(net, (CLEAN,), (CORRUPT,), metric, where="a")
    np.testing.assert_allclose(grid[0], want, rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda h: metric(Named(_after_a(net, h), AXES)))(ha)
    est = hx.attribution_patch(net, (CLEAN,), (CORRUPT,), metric, where="a")
    np.testing.assert_allclose(est[0], ((hc - ha) * g).sum(axis=(0, 2)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "filter_jit"])
def test_patching_a_named_output(jitted):
    net = Net()
    _, acts = hx.capture(net, where="a")(CLEAN)
    ha, hc = _a(net, CORRUPT), _a(net, CLEAN)

    def run(m, x, value):
        with hx.patching({"a": value}, positions=2):
            return m(x)

    y = _run(jitted, run, net, CORRUPT, acts["a"][0])
    assert isinstance(y, Named) and y.axes == AXES
    np.testing.assert_allclose(y.array, _after_a(net, ha.at[:, 2].set(hc[:, 2])), rtol=1e-6)


N = 3


class Block(eqx.Module):
    lin: Linear

    def __call__(self, x: Named) -> Named:
        return Named(x.array + jnp.tanh(self.lin(x).array), x.axes)


class Stack(eqx.Module):
    """Haliax's ``Stacked``: the layers' arrays stacked, folded by ``lax.scan`` with the stacked
    module as xs."""

    blocks: Block

    def __init__(self):
        keys = jax.random.split(jax.random.key(3), N)
        self.blocks = eqx.filter_vmap(
            lambda k: Block(Linear(jax.random.normal(k, (D, D)) / 2, jnp.full(D, 0.1)))
        )(keys)

    def __call__(self, x: Named) -> Named:
        return jax.lax.scan(lambda h, blk: (blk(h), None), x, self.blocks)[0]


def _stack_by_hand(stack, x):
    """Each layer's ``lin`` output, and its gradient of ``sum(output of the stack)``."""
    w, b = stack.blocks.lin.w, stack.blocks.lin.b

    def run(deltas):
        h, outs = x, []
        for i in range(N):
            o = h @ w[i] + b[i] + deltas[i]
            outs.append(o)
            h = h + jnp.tanh(o)
        return h.sum(), outs

    grads, outs = jax.grad(run, has_aux=True)(jnp.zeros((N, *x.shape)))
    return jnp.stack(outs), grads


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "filter_jit"])
def test_values_and_gradients_stacked_by_a_scan_carry_the_layer_axis(jitted):
    stack = Stack()
    x = Named(CLEAN.array[0], ("position", "embed"))
    want, want_grads = _stack_by_hand(stack, x.array)

    def run(m, x):
        _, acts = hx.capture(m, where="blocks/lin")(x)
        _, one = hx.capture(m, where="blocks/lin[1]")(x)
        _, _, grads = hx.value_and_grad(lambda m, x: m(x).array.sum(), where="blocks/lin")(m, x)
        return {**acts, **one}, grads

    acts, grads = _run(jitted, run, stack, x)
    for got, ref in ((acts["blocks/lin"][0], want), (grads["blocks/lin"][0], want_grads)):
        assert got.axes == ("layers", "position", "embed")
        assert got.shape == {"layers": N, "position": T, "embed": D}
        np.testing.assert_allclose(got.array, ref, rtol=1e-5, atol=1e-6)
    one = acts["blocks/lin[1]"][0]
    assert one.axes == ("position", "embed")
    np.testing.assert_allclose(one.array, want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "filter_jit"])
def test_a_list_naming_the_stack_and_one_layer_returns_both(jitted):
    """``where=["blocks/lin", "blocks/lin[1]"]``: the stacked value and layer 1 of it, each under
    the key asked for (one pattern picking the whole call site does not hide the other)."""
    stack = Stack()
    x = Named(CLEAN.array[0], ("position", "embed"))
    want, _ = _stack_by_hand(stack, x.array)
    _, acts = _run(
        jitted, lambda m, x: hx.capture(m, where=["blocks/lin", "blocks/lin[1]"])(x), stack, x
    )
    assert list(acts) == ["blocks/lin", "blocks/lin[1]"]
    np.testing.assert_allclose(acts["blocks/lin"][0].array, want, rtol=1e-5, atol=1e-6)
    one = acts["blocks/lin[1]"][0]
    assert one.axes == ("position", "embed")
    np.testing.assert_allclose(one.array, want[1], rtol=1e-5, atol=1e-6)


class WithCache(eqx.Module):
    """A block returning ``(NamedArray, cache)``, as decoder layers with a KV cache do."""

    lin: Linear

    def __call__(self, x: Named) -> tuple[Named, jax.Array]:
        y = self.lin(x)
        return Named(jnp.tanh(y.array), x.axes), y.array.sum(-1)


class CacheNet(eqx.Module):
    block: WithCache

    def __call__(self, x: Named) -> Named:
        return self.block(x)[0]


def test_a_named_array_inside_a_tuple_is_named_by_its_position(tmp_path):
    """In a tuple, the NamedArray is one part (``"block.0"``, not ``"block.0.array"``): the
    name a harvest stores and a patching target takes, its axis names kept."""
    net = CacheNet(WithCache(Net().a))
    h = net.block.lin(CLEAN).array
    store = hx.harvest(net, [(CLEAN,), (CORRUPT,)], where="block", store=tmp_path / "a")
    assert set(store.names) == {"block.0", "block.1"}
    rows = [jnp.tanh(net.block.lin(x).array) for x in (CLEAN, CORRUPT)]
    np.testing.assert_allclose(store.read("block.0"), np.concatenate(rows), rtol=1e-6)

    value = jnp.full((1, T, D), 0.5)
    with hx.patching({"block.0": value}, positions=2):
        y = net(CLEAN)
    assert isinstance(y, Named) and y.axes == AXES
    np.testing.assert_allclose(y.array, jnp.tanh(h).at[:, 2].set(0.5), rtol=1e-6)
    with pytest.raises(hx.PatchError, match=r"'block\.0'"), hx.patching({"block.0.array": value}):
        net(CLEAN)


@pytest.mark.parametrize("jitted", [False, True])
@pytest.mark.parametrize("axis_name", [None, "examples"])
def test_names_fit_the_array_of_a_value_captured_under_vmap(jitted, axis_name):
    """A NamedArray made inside ``jax.vmap`` comes out with the batch axis in front, and its
    names gain it (the vmap's ``axis_name``, else ``"batch"``): ``Named`` refuses names that do
    not fit its array, as Haliax's own operations do."""
    net = Net()
    xs = jnp.linspace(-1.0, 1.0, 3 * T * D).reshape(3, T, D)

    def forward(net, xs):
        per = lambda a: net(Named(a, ("position", "embed"))).array  # noqa: E731
        return jax.vmap(per, axis_name=axis_name)(xs)

    _, acts = _run(jitted, hx.capture(forward, where="a"), net, xs)
    _, _, grads = _run(
        jitted, hx.value_and_grad(lambda n, x: forward(n, x).sum(), where="a"), net, xs
    )
    want = (axis_name or "batch", "position", "embed")
    for value in (acts["a"][0], grads["a"][0]):
        assert value.axes == want and value.array.shape == (3, T, D)
    np.testing.assert_allclose(acts["a"][0].array, xs @ net.a.w + net.a.b, rtol=1e-6)
    # d sum(b(tanh(h))) / dh = (1 - tanh(h)^2) * (row sums of b.w)
    h = xs @ net.a.w + net.a.b
    np.testing.assert_allclose(
        grads["a"][0].array, (1 - jnp.tanh(h) ** 2) * net.b.w.sum(1), rtol=1e-5
    )
