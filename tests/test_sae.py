"""The SAE path: token files into harvest, the shuffled store reader, splice-back evaluation."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._harvest import harvest as _harvest_mod

# ---- a store whose rows say which row they are ----

ROWS_PER_BATCH, BATCHES, D = 4, 10, 3


class Ident(nnx.Module):
    """Two call sites: ``a`` returns its input, ``b`` twice it (exact in float32)."""

    def __init__(self):
        self.a = nnx.Linear(D, D, use_bias=False, rngs=nnx.Rngs(0))
        self.a.kernel[...] = jnp.eye(D)
        self.b = nnx.Linear(D, D, use_bias=False, rngs=nnx.Rngs(0))
        self.b.kernel[...] = 2 * jnp.eye(D)

    def __call__(self, x):
        return self.b(self.a(x))


def _data():
    r = np.arange(ROWS_PER_BATCH * BATCHES, dtype=np.float32)
    return [
        jnp.asarray(np.repeat(r[i : i + ROWS_PER_BATCH, None], D, 1))
        for i in range(0, len(r), ROWS_PER_BATCH)
    ]


def _store(path, monkeypatch, batches_per_chunk=1):
    monkeypatch.setattr(_harvest_mod, "BATCHES_PER_CHUNK", batches_per_chunk)
    hx.harvest(Ident(), _data(), where=hx.Select(paths=("a", "b")), store=path, progress=False)
    return path


@pytest.fixture
def store(tmp_path, monkeypatch):
    return _store(tmp_path / "s", monkeypatch)  # chunks of 4 rows: 10 blocks


def _ids(batch):
    return np.asarray(batch)[:, 0].astype(int)


def test_open_store(store):
    s = hx.open_store(store)
    assert s.names == ("a", "b") and s.rows == 40 and s.complete
    assert s.shapes == {"a": (3,), "b": (3,)} and s.chunk_rows("a") == 4
    np.testing.assert_array_equal(s.read("a", 5, 7)[:, 0], [5, 6])
    with pytest.raises(hx.HookaxError, match="holds no 'c'; it holds 'a', 'b'"):
        s.read("c")
    with pytest.raises(hx.HookaxError, match="is not a hookax harvest store"):
        hx.open_store(store / "a")


@pytest.mark.parametrize("window_rows", [1, 8, 12, 1000])
def test_every_row_once_per_epoch_in_a_seeded_order(store, window_rows):
    r = hx.StoreReader(
        store, "a", 6, seed=3, epochs=2, window_rows=window_rows, drop_remainder=False
    )
    batches = [_ids(b) for b in r]
    assert [len(b) for b in batches] == [6] * 6 + [4] + [6] * 6 + [4]
    first, second = np.concatenate(batches[:7]), np.concatenate(batches[7:])
    assert sorted(first) == list(range(40)) and sorted(second) == list(range(40))
    assert (first != second).any() and (first != np.arange(40)).any()  # shuffled, per epoch
    np.testing.assert_array_equal(first, np.concatenate([r.rows_of(i) for i in range(7)]))
    again = [
        _ids(b)
        for b in hx.StoreReader(
            store, "a", 6, seed=3, epochs=2, window_rows=window_rows, drop_remainder=False
        )
    ]
    assert all((x == y).all() for x, y in zip(batches, again, strict=True))
    other = hx.StoreReader(store, "a", 6, seed=4, epochs=1, window_rows=window_rows)
    assert (np.concatenate([_ids(b) for b in other]) != first[:36]).any()


def test_window_mixes_blocks(store):
    """A batch draws from the whole window: with a window of 3 blocks (12 rows), batch 0's rows
    come from more than one block of 4."""
    r = hx.StoreReader(store, "a", 6, seed=0, window_rows=12)
    assert len({int(i) // 4 for i in _ids(next(r))}) > 1


def test_drop_remainder_and_len(store):
    r = hx.StoreReader(store, "a", 6, seed=0, epochs=2)
    assert r.steps_per_epoch == 6 and len(r) == 12
    assert all(b.shape == (6, 3) for b in r)
    with pytest.raises(TypeError, match="no length"):
        len(hx.StoreReader(store, "a", 6))


def test_names_stay_aligned(store):
    r = hx.StoreReader(store, ["a", "b"], 8, seed=1, window_rows=8, epochs=1)
    for batch in r:
        assert set(batch) == {"a", "b"}
        np.testing.assert_array_equal(np.asarray(batch["b"]), 2 * np.asarray(batch["a"]))


@pytest.mark.parametrize("at", [0, 2, 6, 9])  # start, mid-epoch, the epoch's end, mid-epoch 2
def test_resume_from_saved_state(store, at):
    args = dict(seed=5, epochs=2, window_rows=8)
    want = [_ids(b) for b in hx.StoreReader(store, "a", 6, **args)]
    r = hx.StoreReader(store, "a", 6, **args)
    for _ in range(at):
        next(r)
    state = json.loads(json.dumps(r.get_state()))  # saved with a checkpoint
    r.close()
    fresh = hx.StoreReader(store, "a", 6, **args)
    fresh.set_state(state)
    assert fresh.epoch == at // 6 and len(fresh) == 12 - at
    rest = [_ids(b) for b in fresh]
    assert all((x == y).all() for x, y in zip(rest, want[at:], strict=True))
    with pytest.raises(hx.HookaxError, match=r"seed=5 \(this reader: 6\)"):
        hx.StoreReader(store, "a", 6, seed=6, window_rows=8).set_state(state)


def test_sharded_batches(store):
    mesh = jax.make_mesh((len(jax.devices()),), ("rows",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    n = len(jax.devices())
    plain = hx.StoreReader(store, ["a", "b"], n, seed=0, epochs=1)
    sharded = hx.StoreReader(store, ["a", "b"], n, seed=0, epochs=1, sharding=sharding)
    for p, s in zip(plain, sharded, strict=True):
        assert s["a"].sharding == sharding and s["b"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(s["a"]), np.asarray(p["a"]))


def test_chunking_does_not_change_the_order(tmp_path, monkeypatch):
    """A store written one batch a chunk (as several processes write it) and one of 64 batches
    a chunk read the same with the same block_rows."""
    small = _store(tmp_path / "small", monkeypatch, 1)
    big = _store(tmp_path / "big", monkeypatch, 64)
    a = [_ids(b) for b in hx.StoreReader(small, "a", 5, epochs=1, block_rows=8, window_rows=16)]
    b = [_ids(b) for b in hx.StoreReader(big, "a", 5, epochs=1, block_rows=8, window_rows=16)]
    assert all((x == y).all() for x, y in zip(a, b, strict=True))


def test_reader_errors(store):
    with pytest.raises(hx.HookaxError, match=r"holds no \['c'\]; it holds 'a', 'b'"):
        hx.StoreReader(store, ["a", "c"], 4)
    with pytest.raises(hx.HookaxError, match=r"batch_size=41 but the store .* holds 40 rows"):
        hx.StoreReader(store, "a", 41)
    meta = json.loads((store / "hookax.json").read_text())
    (store / "hookax.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(hx.HookaxError, match="is being written, or its harvest was interrupted"):
        hx.StoreReader(store, "a", 4)


def test_missing_grain(store, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "grain", None)
    with pytest.raises(ModuleNotFoundError, match=r'Install it with: pip install .*\[data\]"'):
        hx.StoreReader(store, "a", 4)


# ---- token files into harvest ----

VOCAB, SEQ = 17, 6


class Tiny(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(VOCAB, 8, rngs=rngs)
        self.mlp = nnx.Linear(8, 8, rngs=rngs)
        self.head = nnx.Linear(8, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        return self.head(jnp.tanh(self.mlp(self.embed(tokens))))


SEQS = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 1], [3]]


def _write(path, kind):
    if kind == "npy":  # whole rows
        rows = [[1, 2], [7, 8], [9, 10], [3, 4]]
        np.save(path, np.array(rows))
        return rows
    if kind == "npz":  # padded rows and their lengths
        tokens = np.zeros((4, 9), np.int64)
        for i, s in enumerate(SEQS):
            tokens[i, : len(s)] = s
        np.savez(path, tokens=tokens, lengths=[len(s) for s in SEQS])
    else:
        path.write_text(
            "".join(json.dumps(s if i % 2 else {"tokens": s}) + "\n" for i, s in enumerate(SEQS))
        )
    return SEQS


@pytest.mark.parametrize("kind", ["npy", "npz", "jsonl"])
def test_harvest_from_token_files_equals_capture(tmp_path, kind):
    path = tmp_path / f"t.{kind}"
    seqs = _write(path, kind)
    model = Tiny()
    batches = list(hx.token_batches(path, batch_size=2, seq_len=SEQ))
    pieces = [s[i : i + SEQ] for s in seqs for i in range(0, len(s), SEQ)]
    assert sum(int(m.sum()) for _, m in batches) == sum(map(len, seqs))
    h = hx.harvest(
        lambda tokens, mask: model(tokens),
        batches,
        where="mlp",
        row_axes=2,
        mask=lambda tokens, mask: mask,
        store=tmp_path / "s",
        progress=False,
    )
    want = np.concatenate(
        [
            np.asarray(hx.capture(model, where="mlp")(jnp.asarray([p]))[1]["mlp"][0])[0]
            for p in pieces
        ]
    )
    np.testing.assert_allclose(h.read("mlp"), want, rtol=1e-6, atol=1e-6)


def test_token_file_errors(tmp_path):
    (tmp_path / "t.txt").write_text("1 2")
    with pytest.raises(hx.HookaxError, match=r"suffix '.txt'; token files are .npy, .npz, .jsonl"):
        next(hx.token_batches(tmp_path / "t.txt", batch_size=2))
    (tmp_path / "t.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(hx.HookaxError, match="line 1 is an object without 'tokens'"):
        next(hx.token_batches(tmp_path / "t.jsonl", batch_size=2))
    np.save(tmp_path / "f.npy", np.ones((2, 3)))
    with pytest.raises(hx.HookaxError, match="float64 values, not integer token ids"):
        next(hx.token_batches(tmp_path / "f.npy", batch_size=2))


def test_cli_harvest_tokens(tmp_path, capsys):
    from hookax._cli.main import main

    tokens = np.random.default_rng(0).integers(1, 256, size=(5, 16))
    np.save(tmp_path / "t.npy", tokens)
    argv = [
        "harvest",
        "--example",
        "transformer",
        "--where",
        "layers/0/mlp",
        "--tokens",
        str(tmp_path / "t.npy"),
        "--batch-size",
        "2",
        "--out",
        str(tmp_path / "s"),
        "--no-progress",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith("layers/0/mlp  float32[80,64]")
    from hookax.examples import transformer

    model = transformer.make_model(nnx.Rngs(0))
    want = np.asarray(
        hx.capture(model, where="layers/0/mlp")(jnp.asarray(tokens))[1]["layers/0/mlp"][0]
    )
    np.testing.assert_allclose(
        hx.open_store(tmp_path / "s").read("layers/0/mlp"),
        want.reshape(80, 64),
        rtol=2e-5,
        atol=2e-5,
    )
    bad = [a if a != str(tmp_path / "t.npy") else str(tmp_path / "none.npy") for a in argv]
    assert main(bad) == 2
    assert "hookax: error: --tokens: token file" in capsys.readouterr().err


LINEN_FACTORY = """
import flax.linen as nn

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="out")(nn.relu(nn.Dense(4, name="hidden")(x)))

def make():
    return MLP()
"""


def test_cli_harvest_linen(tmp_path, capsys):
    import flax.linen as nn  # noqa: F401

    from hookax._cli.main import main
    from hookax._diagnostics.gradflow import random_inputs

    (tmp_path / "f.py").write_text(LINEN_FACTORY)
    argv = [
        "harvest",
        f"{tmp_path / 'f.py'}:make",
        "--input",
        "f32[3,5]",
        "--where",
        "hidden",
        "--batches",
        "2",
        "--out",
        str(tmp_path / "s"),
        "--no-progress",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    ns: dict = {}
    exec(LINEN_FACTORY, ns)
    spec = (jax.ShapeDtypeStruct((3, 5), jnp.float32),)
    model = ns["make"]()
    variables = model.init(jax.random.key(0), *random_inputs(spec, 0))
    xs = [random_inputs(spec, i)[0] for i in range(2)]
    want = np.concatenate(
        [
            np.asarray(
                hx.capture(lambda x: model.apply(variables, x), where="hidden")(x)[1]["hidden"][0]
            )
            for x in xs
        ]
    )
    np.testing.assert_allclose(hx.open_store(tmp_path / "s").read("hidden"), want, rtol=1e-6)


# ---- splice-back evaluation ----


def _lm_loss(model, batch):
    tokens, mask = batch
    logits = model(tokens)[:, :-1]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    m = mask[:, 1:].astype(jnp.float32)
    return (nll * m).sum(), m.sum()


@pytest.fixture
def lm_batches(tmp_path):
    np.save(tmp_path / "t.npy", np.random.default_rng(0).integers(0, VOCAB, size=(6, SEQ)))
    return list(hx.token_batches(tmp_path / "t.npy", batch_size=2))


def test_splice_identity_recovers_all_and_zeros_nothing(lm_batches):
    model = Tiny()
    ident = hx.splice_eval(_lm_loss, model, lm_batches, where="mlp", replace=lambda y: y)
    assert ident.recovered == 1.0 and ident.spliced_loss == ident.loss and ident.batches == 3
    zero = hx.splice_eval(_lm_loss, model, lm_batches, where="mlp", replace=jnp.zeros_like)
    assert zero.recovered == 0.0 and zero.zero_loss == zero.spliced_loss != zero.loss
    half = hx.splice_eval(_lm_loss, model, lm_batches, where="mlp", replace=lambda y: 0.5 * y)
    assert half.recovered not in (0.0, 1.0)
    # the losses by hand: the model's own, and the mlp's output zeroed
    total = sum(float(_lm_loss(model, b)[0]) for b in lm_batches)
    count = sum(float(_lm_loss(model, b)[1]) for b in lm_batches)
    np.testing.assert_allclose(ident.loss, total / count, rtol=1e-6)

    def zeroed(tokens):
        return model.head(jnp.tanh(0 * model.mlp(model.embed(tokens))))

    z = [_lm_loss(zeroed, b) for b in lm_batches]
    np.testing.assert_allclose(zero.zero_loss, sum(float(a) for a, _ in z) / count, rtol=1e-6)


def test_splice_where_matching_nothing(lm_batches):
    with pytest.raises(
        hx.SelectorError, match="where='nope'\\) matched no call site; those that ran include 'mlp'"
    ):
        hx.splice_eval(_lm_loss, Tiny(), lm_batches, where="nope", replace=lambda y: y)


def test_sharded_batches_gathered_on_the_host(store):
    """The path for shardings over several processes (every process gathers the batch on the
    host and places its part), taken here on one process's devices."""
    mesh = jax.make_mesh((len(jax.devices()),), ("rows",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    n = len(jax.devices())
    plain = hx.StoreReader(store, "a", n, seed=0, epochs=1)
    host = hx.StoreReader(store, "a", n, seed=0, epochs=1, sharding=sharding)
    host._on_device = False
    for p, s in zip(plain, host, strict=True):
        assert s.sharding == sharding
        np.testing.assert_array_equal(np.asarray(s), np.asarray(p))


EQX_FACTORY = """
import equinox as eqx
import jax

class M(eqx.Module):
    embed: eqx.nn.Embedding
    lin: eqx.nn.Linear

    def __init__(self):
        k1, k2 = jax.random.split(jax.random.key(0))
        self.embed = eqx.nn.Embedding(32, 4, key=k1)
        self.lin = eqx.nn.Linear(4, 3, key=k2)

    def __call__(self, tokens):
        return jax.vmap(jax.vmap(self.lin))(jax.vmap(jax.vmap(self.embed))(tokens))

def make():
    return M()
"""


def test_cli_harvest_tokens_equinox_jsonl(tmp_path, capsys):
    from hookax._cli.main import main

    (tmp_path / "f.py").write_text(EQX_FACTORY)
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(s) + "\n" for s in seqs))
    argv = [
        "harvest",
        f"{tmp_path / 'f.py'}:make",
        "--tokens",
        str(tmp_path / "t.jsonl"),
        "--batch-size",
        "2",
        "--seq-len",
        "4",
        "--where",
        "lin",
        "--out",
        str(tmp_path / "s"),
        "--no-progress",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    ns: dict = {}
    exec(EQX_FACTORY, ns)
    model = ns["make"]()
    pieces = [[1, 2, 3], [4, 5, 6, 7], [8], [9]]
    want = np.concatenate(
        [
            np.asarray(hx.capture(model, where="lin")(jnp.asarray([p]))[1]["lin"][0])[0]
            for p in pieces
        ]
    )
    s = hx.open_store(tmp_path / "s")
    np.testing.assert_allclose(s.read("lin"), want, rtol=1e-6, atol=1e-6)
    assert s.metadata["metadata"]["cli"]["tokens"] == "t.jsonl"


def _linen_and_equinox():
    import equinox as eqx
    import flax.linen as nn

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1, name="out")(jnp.tanh(nn.Dense(4, name="hidden")(x)))

    lin = LinenMLP()
    variables = lin.init(jax.random.key(0), jnp.ones((1, 3)))

    class EqxMLP(eqx.Module):
        hidden: eqx.nn.Linear
        out: eqx.nn.Linear

        def __init__(self):
            k1, k2 = jax.random.split(jax.random.key(0))
            self.hidden, self.out = eqx.nn.Linear(3, 4, key=k1), eqx.nn.Linear(4, 1, key=k2)

        def __call__(self, x):
            return jax.vmap(self.out)(jnp.tanh(jax.vmap(self.hidden)(x)))

    return [
        (variables, lambda v, x: ((lin.apply(v, x) - 1.0) ** 2).mean()),
        (EqxMLP(), lambda m, x: ((m(x) - 1.0) ** 2).mean()),
    ]


@pytest.mark.parametrize("case", [0, 1], ids=["linen", "equinox"])
def test_splice_on_linen_and_equinox(case):
    model, loss = _linen_and_equinox()[case]
    xs = [jnp.full((5, 3), 0.5 * i + 0.1) for i in range(3)]
    ident = hx.splice_eval(loss, model, xs, where="hidden", replace=lambda y: y)
    zero = hx.splice_eval(loss, model, xs, where="hidden", replace=jnp.zeros_like)
    assert (ident.recovered, zero.recovered) == (1.0, 0.0)
    np.testing.assert_allclose(ident.loss, np.mean([float(loss(model, x)) for x in xs]), rtol=1e-6)


def test_gathers_compile_once_per_window_shape(store):
    """Batches across a window's end split it anywhere; the gathers compile per window shape,
    not per split."""
    from hookax._harvest import reader as _reader

    r = hx.StoreReader(store, "a", 7, seed=2, epochs=4, window_rows=16)  # windows 16, 16, 8
    next(r)
    take, take2 = _reader._TAKE._cache_size(), _reader._TAKE2._cache_size() if _reader._TAKE2 else 0
    batches = [_ids(b) for b in r]
    assert len(batches) == 4 * 5 - 1
    assert _reader._TAKE._cache_size() - take <= 2  # 16-row and 8-row windows
    assert _reader._TAKE2._cache_size() - take2 <= 3  # (16, 16), (16, 8), (8, 16)
