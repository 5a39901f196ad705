"""Every step of a decode: a KV-cache decoder sampled in a ``lax.while_loop``, captured with
``while_steps=``, equals the same steps run in a Python loop; a Python loop over a jitted step
captured per step retraces nothing after the first step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx

D, VOCAB, T = 8, 11, 12  # width, vocabulary, cache length


class Attn(nnx.Module):
    """One head over a KV cache ``(batch, T, D)``; writes this token's key and value at ``pos``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.q = nnx.Linear(D, D, rngs=rngs)
        self.k = nnx.Linear(D, D, rngs=rngs)
        self.v = nnx.Linear(D, D, rngs=rngs)
        self.o = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array, ck: jax.Array, cv: jax.Array, pos: jax.Array):
        ck = jax.lax.dynamic_update_index_in_dim(ck, self.k(x), pos, 1)
        cv = jax.lax.dynamic_update_index_in_dim(cv, self.v(x), pos, 1)
        scores = jnp.einsum("bd,btd->bt", self.q(x), ck) / np.sqrt(D).astype(np.float32)
        scores = jnp.where(jnp.arange(T) <= pos, scores, -jnp.inf)
        return self.o(jnp.einsum("bt,btd->bd", jax.nn.softmax(scores, -1), cv)), ck, cv


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn = Attn(rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array, ck: jax.Array, cv: jax.Array, pos: jax.Array):
        a, ck, cv = self.attn(x, ck, cv, pos)
        x = x + a
        return x + jnp.tanh(self.mlp(x)), ck, cv


class Decoder(nnx.Module):
    """Two blocks; ``__call__`` is one decode step: a token in, logits and the new cache out."""

    def __init__(self, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tok: jax.Array, cache: tuple, pos: jax.Array):
        x = self.embed(tok)
        new = []
        for block, (ck, cv) in zip(self.blocks, cache):
            x, ck, cv = block(x, ck, cv, pos)
            new.append((ck, cv))
        return self.head(x), tuple(new)


def init_cache(batch: int) -> tuple:
    return tuple((jnp.zeros((batch, T, D)), jnp.zeros((batch, T, D))) for _ in range(2))


def sample(model: Decoder, tok: jax.Array, n: jax.Array, eos: int = -1):
    """Greedy decoding in a ``lax.while_loop``, the usual way: up to ``n`` tokens, stopping
    early when every sequence produced ``eos``. Returns the tokens ``(batch, T)``."""
    batch = tok.shape[0]

    def cond(c):
        pos, _, _, _, done = c
        return (pos < n) & ~done.all()

    def body(c):
        pos, tok, cache, out, done = c
        logits, cache = model(tok, cache, pos)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        out = jax.lax.dynamic_update_index_in_dim(out, tok, pos, 1)
        return pos + 1, tok, cache, out, done | (tok == eos)

    init = (
        jnp.int32(0),
        tok,
        init_cache(batch),
        jnp.zeros((batch, T), jnp.int32),
        jnp.zeros(batch, bool),
    )
    return jax.lax.while_loop(cond, body, init)[3]


def by_hand(model: Decoder, tok: jax.Array, n: int, eos: int = -1) -> tuple[dict, int]:
    """The same steps in a Python loop, each call site's output recorded by hand."""
    cache = [list(c) for c in init_cache(tok.shape[0])]
    rec: dict[str, list] = {}
    steps = 0
    for pos in range(n):
        x = model.embed(tok)
        for i, block in enumerate(model.blocks):
            attn = block.attn(x, *cache[i], jnp.int32(pos))
            rec.setdefault(f"blocks/{i}/attn", []).append(attn)
            cache[i] = list(attn[1:])
            x = x + attn[0]
            mlp = block.mlp(x)
            rec.setdefault(f"blocks/{i}/mlp", []).append(mlp)
            x = x + jnp.tanh(mlp)
        logits = model.head(x)
        rec.setdefault("head", []).append(logits)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        steps += 1
        if bool((tok == eos).all()):
            break
    stacked = {k: jax.tree.map(lambda *xs: jnp.stack(xs), *v) for k, v in rec.items()}
    return stacked, steps


WHERE = hx.Select(paths=("blocks/*/attn", "blocks/*/mlp", "head"))
PROMPT = jnp.array([1, 4, 7], jnp.int32)


def _check(acts: dict, steps: dict, want: dict, ran: int, bound: int) -> None:
    assert set(acts) == set(want) == set(steps)
    for key, value in want.items():
        (got,) = acts[key]
        assert int(steps[key][0]) == ran
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(value)):
            assert g.shape == (bound, *w.shape[1:])
            np.testing.assert_allclose(g[:ran], w[:ran], rtol=1e-6, atol=1e-6)
            assert bool(jnp.isnan(g[ran:]).all())


@pytest.mark.parametrize("way", ["eager", "jax.jit", "nnx.jit", "capture(jax.jit)"])
def test_every_step_of_a_while_loop_decode_equals_a_python_loop(way, traces):
    model = Decoder()

    def f(model, tok, n):
        traces()
        return sample(model, tok, n)

    forward = {
        "eager": lambda: hx.capture(f, where=WHERE, while_steps=8),
        "jax.jit": lambda: jax.jit(hx.capture(f, where=WHERE, while_steps=8)),
        "nnx.jit": lambda: nnx.jit(hx.capture(f, where=WHERE, while_steps=8)),
        "capture(jax.jit)": lambda: hx.capture(jax.jit(f), where=WHERE, while_steps=8),
    }[way]()
    want, ran = by_hand(model, PROMPT, 6)
    for n in (6, 6):  # the bound n is traced: a second call with the same shapes reuses the trace
        tokens, acts, steps = forward(model, PROMPT, jnp.int32(n))
        _check(acts, steps, want, ran, 8)
    np.testing.assert_array_equal(tokens, sample(model, PROMPT, jnp.int32(6)))
    assert traces.n == (2 if way == "eager" else 1)
    # A different trip count: the same program, fewer rows written
    want4, _ = by_hand(model, PROMPT, 4)
    _, acts, steps = forward(model, PROMPT, jnp.int32(4))
    _check(acts, steps, want4, 4, 8)
    assert traces.n == (3 if way == "eager" else 1)


def test_a_decode_that_stops_early_fills_the_rows_it_did_not_reach():
    model = Decoder(seed=3)
    free, _ = by_hand(model, PROMPT[:1], 8)
    eos = int(jnp.argmax(free["head"][2], -1)[0])  # the token produced at step 2
    want, ran = by_hand(model, PROMPT[:1], 8, eos)
    assert ran < 8
    forward = jax.jit(hx.capture(sample, where=WHERE, while_steps=10), static_argnums=3)
    _, acts, steps = forward(model, PROMPT[:1], jnp.int32(8), eos)
    _check(acts, steps, want, ran, 10)


def test_more_iterations_than_while_steps_raise_eagerly_and_are_dropped_under_jit():
    model = Decoder()
    want, _ = by_hand(model, PROMPT, 6)
    with pytest.raises(hx.HookaxError, match=r"ran 6 iterations; only the first 4.*while_steps=6"):
        hx.capture(sample, where="head", while_steps=4)(model, PROMPT, jnp.int32(6))
    _, acts, steps = jax.jit(hx.capture(sample, where="head", while_steps=4))(
        model, PROMPT, jnp.int32(6)
    )
    assert int(steps["head"][0]) == 6
    np.testing.assert_allclose(acts["head"][0], want["head"][:4], rtol=1e-6)


def test_without_while_steps_the_last_iteration_is_kept():
    model = Decoder()
    want, _ = by_hand(model, PROMPT, 5)
    for forward in (hx.capture(sample, where=WHERE), jax.jit(hx.capture(sample, where=WHERE))):
        _, acts = forward(model, PROMPT, jnp.int32(5))
        for key, value in want.items():
            for g, w in zip(jax.tree.leaves(acts[key][0]), jax.tree.leaves(value)):
                np.testing.assert_allclose(g, w[-1], rtol=1e-6, atol=1e-6)


def test_nested_while_loops_and_a_while_loop_inside_a_scan():
    """A decode per prompt inside ``lax.map`` (a scan), and an inner while over the blocks:
    values stack outer loop first; the inner loop's counts are stacked by the outer one."""
    model = Decoder()
    prompts = jnp.array([[1, 4], [2, 5], [3, 6]], jnp.int32)

    def each(model, prompts, n):
        return jax.lax.map(lambda p: sample(model, p, n), prompts)

    _, acts, steps = hx.capture(each, where="head", while_steps=5)(model, prompts, jnp.int32(4))
    assert acts["head"][0].shape == (3, 5, 2, VOCAB)
    np.testing.assert_array_equal(steps["head"][0], [4, 4, 4])
    for i in range(3):
        want, _ = by_hand(model, prompts[i], 4)
        np.testing.assert_allclose(acts["head"][0][i, :4], want["head"], rtol=1e-6)

    mlp = model.blocks[0].mlp

    def inner_outer(x, n, m):
        def outer(c):
            t, x = c
            x = jax.lax.while_loop(lambda c: c[0] < m, lambda c: (c[0] + 1, mlp(c[1])), (0, x))
            return t + 1, x[1]

        return jax.lax.while_loop(lambda c: c[0] < n, outer, (0, x))[1]

    x = jnp.linspace(-1, 1, D)[None] * 0.1
    _, acts, steps = jax.jit(hx.capture(inner_outer, while_steps=4))(x, 3, 2)
    got = acts[""][0]  # the module called alone is its own root
    assert got.shape == (4, 4, 1, D)
    want = x
    for t in range(3):
        for j in range(2):
            want = mlp(want)
            np.testing.assert_allclose(got[t, j], want, rtol=1e-6)
        assert bool(jnp.isnan(got[t, 2:]).all())
    assert bool(jnp.isnan(got[3]).all())
    np.testing.assert_array_equal(steps[""][0], [2, 2, 2, np.iinfo(np.int32).min])


def test_vmap_over_prompts_gives_each_prompt_its_own_steps():
    """Under ``jax.vmap`` the loop's condition depends on each prompt's tokens: each prompt
    stops at its own step, counts its own iterations, and its rows after that are NaN."""
    model = Decoder(seed=1)
    prompts = jnp.array([[0], [5], [9]], jnp.int32)
    eos = 0  # ends the three prompts after different numbers of steps (checked below)
    forward = hx.capture(jax.vmap(sample, (None, 0, None, None)), where="head", while_steps=9)
    _, acts, steps = forward(model, prompts, jnp.int32(8), eos)
    assert acts["head"][0].shape == (9, 3, 1, VOCAB)  # rows first, as a scan under vmap stacks
    ran = []
    for i in range(3):
        want, n = by_hand(model, prompts[i], 8, eos)
        ran.append(n)
        np.testing.assert_allclose(acts["head"][0][:n, i], want["head"], rtol=1e-6, atol=1e-6)
        assert bool(jnp.isnan(acts["head"][0][n:, i]).all())
    np.testing.assert_array_equal(steps["head"][0], ran)
    assert len(set(ran)) == 3


def test_gradients_through_a_while_loop_still_raise_clearly():
    model = Decoder()

    def loss(model, tok, n):
        return sample(model, tok, n).sum().astype(jnp.float32) + model.head.bias[...].sum()

    with pytest.raises(hx.HookaxError, match=r"while_loop.*reverse mode"):
        hx.value_and_grad(loss, where="head")(model, PROMPT, jnp.int32(3))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_while_steps_must_be_a_positive_int(bad):
    with pytest.raises(hx.HookaxError, match="while_steps"):
        hx.capture(sample, while_steps=bad)


def test_harvest_stores_every_step_of_a_while_loop(tmp_path):
    model = Decoder()
    prompts = [PROMPT, PROMPT[::-1]]
    h = hx.harvest(
        lambda tok, n: sample(model, tok, n),
        [(p, jnp.int32(5)) for p in prompts],
        where="head",
        while_steps=6,
        store=tmp_path / "acts",
    )
    assert h.rows == 6
    for t in range(6):
        got = h.read(f"head[{t}]")
        assert got.shape == (6, VOCAB)
        for b, p in enumerate(prompts):
            rows = got[3 * b : 3 * b + 3]
            if t < 5:
                np.testing.assert_allclose(rows, by_hand(model, p, 5)[0]["head"][t], rtol=1e-6)
            else:
                assert np.isnan(rows).all()  # the loop ran 5 iterations


# ---- a Python decode loop over a jitted step (capture around an already-jitted function) ----


def _step(traces):
    def step(model, tok, cache, pos):
        traces()
        return model(tok, cache, pos)

    return step


@pytest.mark.parametrize("kind", ["jax.jit", "nnx.jit"])
def test_a_python_decode_loop_over_a_jitted_step_traces_once(kind, traces):
    """A new ``hx.capture`` on every token, as a decode loop is written: one trace in all, and
    each step's values equal the same step run by hand."""
    model = Decoder()
    jitted = {"jax.jit": jax.jit, "nnx.jit": nnx.jit}[kind](_step(traces))
    want, _ = by_hand(model, PROMPT, 5)
    tok, cache = PROMPT, init_cache(3)
    for pos in range(5):
        (logits, cache), acts = hx.capture(jitted, where=WHERE)(model, tok, cache, jnp.int32(pos))
        assert set(acts) == set(want)
        for key, value in want.items():
            for g, w in zip(jax.tree.leaves(acts[key][0]), jax.tree.leaves(value)):
                np.testing.assert_allclose(g, w[pos], rtol=1e-6, atol=1e-6)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
    assert traces.n == 1


def test_the_cached_capture_follows_the_context_and_where(traces):
    model = Decoder()
    jitted = jax.jit(_step(traces))
    args = (model, PROMPT, init_cache(3), jnp.int32(0))
    (logits, _), acts = hx.capture(jitted, where="head")(*args)
    assert traces.n == 1
    np.testing.assert_allclose(acts["head"][0], logits, rtol=1e-6)
    with hx.intercept(lambda nf, a, k, c: nf(*a, **k) * 2, where="head"):
        for _ in range(3):
            (edited, _), acts2 = hx.capture(jitted, where="head")(*args)
    assert traces.n == 2  # a new context: traced once, then cached
    np.testing.assert_allclose(edited, logits * 2, rtol=1e-6)
    np.testing.assert_allclose(acts2["head"][0], logits * 2, rtol=1e-6)  # what the caller got
    _, acts3 = hx.capture(jitted, where="blocks/0/mlp")(*args)
    assert traces.n == 3 and set(acts3) == {"blocks/0/mlp"}
    (again, _), _ = hx.capture(jitted, where="head")(*args)
    assert traces.n == 3
    np.testing.assert_allclose(again, logits, rtol=1e-6)
    with pytest.raises(hx.SelectorError, match="blocks/9"):  # a where= that matches nothing
        hx.capture(jitted, where="blocks/9/mlp")(*args)


def test_capture_around_jit_keeps_static_arguments_state_updates_and_static_outputs():
    class Counted(nnx.Module):
        def __init__(self) -> None:
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.calls = nnx.Variable(jnp.int32(0))

        def __call__(self, x, scale):
            self.calls[...] += 1
            return self.lin(x) * scale, "tag"

    m = Counted()
    x = jnp.ones((1, 2))
    step = nnx.jit(lambda m, x, scale: m(x, scale)[0], static_argnums=2)
    for _ in range(3):
        y, acts = hx.capture(step)(m, x, 3.0)
    assert int(m.calls[...]) == 3  # nnx.jit's state updates reach the caller
    want = (m.lin(x) * 3.0, "tag")
    np.testing.assert_allclose(y, want[0], rtol=1e-6)
    np.testing.assert_allclose(acts[""][0][0], want[0], rtol=1e-6)
    assert acts[""][0][1] == "tag"
    plain = jax.jit(lambda x, scale: m.lin(x) * scale, static_argnames="scale")
    y2, acts2 = hx.capture(plain)(x, scale=2.0)
    np.testing.assert_allclose(y2, m.lin(x) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(acts2[""][0], m.lin(x), rtol=1e-6)


def test_capture_around_equinox_filter_jit_traces_once(traces):
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))

    @eqx.filter_jit
    def step(mlp, x):
        traces()
        return mlp(x)

    for i in range(5):
        x = jnp.full((3,), float(i))
        y, acts = hx.capture(step, where="layers/1")(mlp, x)
        h = jax.nn.relu(mlp.layers[0](x))
        np.testing.assert_allclose(acts["layers/1"][0], mlp.layers[1](h), rtol=1e-6)
        np.testing.assert_allclose(y, mlp(x), rtol=1e-6)
    assert traces.n == 1


def test_capture_around_jit_checks_while_steps():
    model = Decoder()
    with pytest.raises(hx.HookaxError, match="ran 5 iterations; only the first 3"):
        hx.capture(jax.jit(sample), where="head", while_steps=3)(model, PROMPT, jnp.int32(5))


@pytest.mark.parametrize("kind", ["jax.jit", "nnx.jit"])
def test_capture_around_jit_keeps_the_order_of_first_calls(kind):
    model = Decoder()
    jitted = {"jax.jit": jax.jit, "nnx.jit": nnx.jit}[kind](sample)
    _, acts, steps = hx.capture(jitted, where=WHERE, while_steps=3)(model, PROMPT, jnp.int32(2))
    order = ["blocks/0/attn", "blocks/0/mlp", "blocks/1/attn", "blocks/1/mlp", "head"]
    assert list(acts) == order and list(steps) == order


def test_a_decode_with_static_bounds_gives_every_steps_value_and_gradient():
    """``fori_loop`` with static bounds is a scan: capture and activation gradients stack every
    step without ``while_steps``; d sum(logits**2) / d logits = 2 * logits at each step."""
    model = Decoder()

    def decode(model, tok):
        def body(pos, c):
            tok, cache, total = c
            logits, cache = model(tok, cache, pos)
            return _greedy_tok(logits), cache, total + (logits**2).sum()

        return jax.lax.fori_loop(0, 4, body, (tok, init_cache(3), jnp.float32(0)))[2]

    _, acts = hx.capture(decode, where="head")(model, PROMPT)
    want, _ = by_hand(model, PROMPT, 4)
    np.testing.assert_allclose(acts["head"][0], want["head"], rtol=1e-6, atol=1e-6)
    _, _, act_grads = jax.jit(hx.value_and_grad(decode, where="head"))(model, PROMPT)
    np.testing.assert_allclose(act_grads["head"][0], 2 * want["head"], rtol=1e-5, atol=1e-5)


def _greedy_tok(logits):
    return jnp.argmax(logits, -1).astype(jnp.int32)
