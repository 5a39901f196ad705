"""The induction example: data, scores on hand-made patterns, and a short training run that
learns a previous-token head in layer 0 and induction heads in layer 1."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hookax as hx
from hookax.examples import induction


def test_repeated_and_periodic_tokens():
    tokens = induction.repeated_tokens(jax.random.key(0), 3, 4, 10)
    assert tokens.shape == (3, 8) and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens[:, :4], tokens[:, 4:])
    cfg = induction.Config(batch=16, half=6, vocab=10)
    tokens, period = induction.periodic_tokens(jax.random.key(1), cfg)
    assert tokens.shape == (16, 12) and set(np.asarray(period)) <= set(range(3, 7))
    for row, p in zip(np.asarray(tokens), np.asarray(period)):
        np.testing.assert_array_equal(row[p:], row[:-p])


def test_scores_read_the_stripes_of_hand_made_patterns():
    half, t = 3, 6
    prev = np.zeros((t, t))
    prev[0, 0] = 1
    prev[np.arange(1, t), np.arange(t - 1)] = 1
    ind = np.full((t, t), 0.0)
    ind[np.arange(t), np.arange(t)] = 1
    ind[np.arange(half, t), np.arange(1, half + 1)] = 0.75
    ind[np.arange(half, t), np.arange(half, t)] = 0.25
    pattern = jnp.asarray(np.stack([[prev, ind]] * 2)[:, None])  # (layer, batch, head, q, k)
    np.testing.assert_allclose(induction.induction_scores(pattern), [[0, 0.75]] * 2)
    # prev: 1 everywhere; ind: query 3 -> key 2 is 0, query 4 -> key 3 and query 5 -> key 4:
    # 0 as well (their weight is on keys 2, 3 and 4, 5)
    np.testing.assert_allclose(induction.prev_token_scores(pattern), [[1, 0]] * 2)


def test_a_few_steps_lower_the_loss_and_the_cache_reloads_the_weights(tmp_path):
    cfg = induction.Config(vocab=16, d_model=16, n_heads=2, half=4, batch=8, steps=20)
    trained = induction.load_or_train(cfg, tmp_path)  # trains, and writes the cache
    again = induction.load_or_train(cfg, tmp_path)  # reads it
    assert len(list(tmp_path.glob("induction-*.npz"))) == 1
    tokens, period = induction.periodic_tokens(jax.random.key(5), cfg)
    np.testing.assert_array_equal(again(tokens), trained(tokens))
    untrained = induction.AttnOnly(cfg, rngs=nnx.Rngs(cfg.seed))
    before = induction.loss_fn(untrained, tokens, period)
    assert induction.loss_fn(trained, tokens, period) < before


def test_training_learns_induction_heads_that_read_the_previous_token_head():
    cfg = induction.Config(vocab=32, d_model=32, n_heads=2, half=8, batch=32, steps=400)
    model, losses = induction.train(cfg)
    assert np.mean(losses[-20:]) < 0.5 < losses[0]
    tokens = induction.repeated_tokens(jax.random.key(9), 32, cfg.half, cfg.vocab)
    pattern = induction.patterns(model, tokens)
    ind, prev = induction.induction_scores(pattern), induction.prev_token_scores(pattern)
    assert float(ind[1].max()) > 0.6 and float(ind[0].max()) < 0.1
    assert float(prev[0].max()) > 0.4 and float(prev[1].max()) < 0.2
    # K-composition: the induction head's key reads the previous-token head
    p, i = int(prev[0].argmax()), int(ind[1].argmax())
    corrupt = induction.corrupted(jax.random.key(7), tokens, cfg.vocab)
    metric = induction.in_context_logprob(tokens)
    parts = induction.components()
    edges = hx.edge_attribution(model, (tokens,), (corrupt,), metric, parts)
    assert (f"L0H{p}", f"L1H{i}.k") in list(edges.top(5))
    keys = [f"L1H{h}.k" for h in range(cfg.n_heads)]
    senders = [f"L0H{h}" for h in range(cfg.n_heads)]
    grid = hx.path_patch(
        model, (tokens,), (corrupt,), metric, parts, senders=senders, receivers=keys
    )
    effect = np.asarray(grid - metric(model(tokens)))
    assert np.unravel_index(effect.argmin(), effect.shape) == (p, i) and effect[p, i] < -0.5
