"""hx.harvest in one process: stored rows are hx.capture's values; bad input leaves stores valid."""

import errno
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._harvest import chunks as _harvest_chunks
from hookax._harvest import write as _harvest_write
from hookax._harvest.harvest import read
from tests import harvest_worker as w


def captured(model, batches, name, *, where="layers/*", row_axes=1, mask=None, dtype=None):
    """The rows hx.capture gives for ``name`` over ``batches``, eagerly, masked and cast."""
    out = []
    for x in batches:
        v = np.asarray(hx.capture(model, where=where)(x)[1][name][0])
        v = v.reshape(-1, *v.shape[row_axes:])
        if mask is not None:
            v = v[np.asarray(mask(x)).reshape(-1)]
        out.append(v if dtype is None else v.astype(dtype))
    return np.concatenate(out)


def store_contents(path):
    """Everything a store holds: its description, every array (whole domain), its files."""
    import tensorstore as ts

    meta = json.loads((path / "hookax.json").read_text())
    dirs = [a["dir"] for a in meta["arrays"].values()] + ["_source", "_batch_end"]
    arrays = {}
    for d in dirs:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / d)}}
        arrays[d] = ts.open(spec, open=True).result().read().result()
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*"))
    return meta, arrays, files


def assert_same_store(a, b, files=True):
    """Same description, arrays and (``files``) files. Without ``files``, chunks may differ."""
    meta_a, arrays_a, files_a = store_contents(a)
    meta_b, arrays_b, files_b = store_contents(b)
    assert meta_a == meta_b
    if files:
        assert files_a == files_b
    for d in arrays_a:
        np.testing.assert_array_equal(arrays_a[d], arrays_b[d], err_msg=d)
        assert arrays_a[d].dtype == arrays_b[d].dtype


def test_rows_equal_capture(tmp_path):
    model = w.make_model()
    data = [x[:, 0] for x in w.host_batches(3)]  # (4, WIDTH) batches: one row per example
    h = hx.harvest(model, data, where="layers/*", store=tmp_path / "s", progress=False)
    assert h.names == ("layers/0", "layers/2")
    assert (h.batches, h.rows, h.resumed_at) == (3, 12, 0)
    for name in h.names:
        np.testing.assert_array_equal(h.read(name), captured(model, data, name))
    src = h.source()
    np.testing.assert_array_equal(src[:, 0], np.repeat([0, 1, 2], 4))
    np.testing.assert_array_equal(src[:, 1], np.tile(np.arange(4), 3))
    meta = json.loads((tmp_path / "s" / "hookax.json").read_text())
    assert meta["arrays"]["layers/2"] == {
        "key": "layers/2",
        "call": 0,
        "part": "",
        "shape": [6],
        "dtype": "float32",
        "dir": "layers.2",
    }
    assert (meta["batches"], meta["rows"], meta["complete"]) == (3, 12, True)
    assert meta["model"] == "flax.nnx.helpers.Sequential"


def test_mask_rows_dtype_and_a_function(tmp_path):
    """Tokens as rows (row_axes=2), padding skipped, bfloat16, fn a function over the model."""
    model = w.make_model()
    data = w.host_batches(3)
    h = hx.harvest(
        lambda x: model(x) * 2,
        data,
        where="layers/0",
        store=tmp_path / "s",
        dtype=jnp.bfloat16,
        mask=w.pad_mask,
        row_axes=2,
        overlap=False,
        progress=False,
    )
    want = captured(model, data, "layers/0", row_axes=2, mask=w.pad_mask, dtype=jnp.bfloat16)
    assert h.rows == len(want) < 3 * w.BATCH * w.SEQ
    got = h.read("layers/0")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, want)
    kept = np.argwhere(np.stack([w.pad_mask(x) for x in data]))
    np.testing.assert_array_equal(h.source(), kept)


def test_several_calls_and_tuple_outputs(tmp_path):
    class Pair(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.lin(x), self.lin(x + 1)

    model = Pair()
    data = [jnp.arange(4.0).reshape(2, 2), jnp.ones((2, 2))]
    h = hx.harvest(model, data, store=tmp_path / "s", progress=False)
    assert h.names == (".0", ".1", "lin#0", "lin#1")  # the root's key is ""; .0: a position
    lin = model.lin
    np.testing.assert_array_equal(h.read("lin#1"), np.concatenate([lin(x + 1) for x in data]))
    np.testing.assert_array_equal(h.read(".0"), np.concatenate([lin(x) for x in data]))


def test_resume_appends_and_complete_store_is_kept(tmp_path):
    model = w.make_model()
    data = [x[:, 0] for x in w.host_batches(4)]
    hx.harvest(model, data, where="layers/*", store=tmp_path / "ref", progress=False)
    hx.harvest(model, data[:2], where="layers/*", store=tmp_path / "s", progress=False)
    h = hx.harvest(model, data, where="layers/*", store=tmp_path / "s", progress=False)
    assert (h.resumed_at, h.batches) == (2, 4)
    assert_same_store(tmp_path / "ref", tmp_path / "s")


def test_store_of_other_shapes_is_refused(tmp_path):
    model = w.make_model()
    data = [x[:, 0] for x in w.host_batches(2)]
    hx.harvest(model, data, where="layers/*", store=tmp_path / "s", progress=False)
    before = store_contents(tmp_path / "s")
    other = nnx.Sequential(nnx.Linear(w.WIDTH, 5, rngs=nnx.Rngs(0)))
    with pytest.raises(
        hx.HookaxError,
        match=r"holds another harvest.*array 'layers/0': "
        r"store has float32\[rows,8\], this run float32\[rows,5\].*overwrite=True",
    ):
        hx.harvest(other, data, where="layers/*", store=tmp_path / "s", progress=False)
    with pytest.raises(hx.HookaxError, match=r"dtype.*bfloat16|store has float32"):
        hx.harvest(model, data, where="layers/*", store=tmp_path / "s", dtype=jnp.bfloat16)
    after = store_contents(tmp_path / "s")
    assert before[0] == after[0] and before[2] == after[2]
    h = hx.harvest(other, data, where="layers/*", store=tmp_path / "s", overwrite=True)
    assert h.names == ("layers/0",)


def test_not_a_store_and_rows_that_do_not_line_up(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    model = w.make_model()
    x = w.host_batches(1)[0][:, 0]
    with pytest.raises(hx.HookaxError, match="is a folder that is not a hookax store"):
        hx.harvest(model, [x], where="layers/*", store=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(
        hx.HookaxError,
        match=r"'layers/2' has shape \(4, 6\).*not the batch's rows \(4, 8\).*row_axes=2",
    ):
        hx.harvest(model, [x], where="layers/*", store=tmp_path / "s", row_axes=2)


@pytest.mark.parametrize(
    ("overlap", "chunks"),
    [(True, True), (False, True), (True, False)],
    ids=["thread", "inline", "tensorstore"],
)
def test_failing_writer_leaves_a_valid_store(tmp_path, monkeypatch, overlap, chunks):
    """A full disk at batch 2: a clear error, batches 0-1 committed, a rerun completes it.
    ``chunks``: the chunk files written by hookax (one process); else by TensorStore."""
    model = w.make_model()
    data = [x[:, 0] for x in w.host_batches(5)]
    hx.harvest(model, data, where="layers/*", store=tmp_path / "ref", progress=False)
    if not chunks:
        monkeypatch.setattr(_harvest_chunks, "plain", lambda *a: False)
    seam = (_harvest_chunks, "_pwrite") if chunks else (_harvest_write.Writer, "_write_shard")
    module, attr = seam
    real = getattr(module, attr)
    calls = {"n": 0}
    per_batch = 4 if chunks else 2  # two arrays (one shard each), and _source, _batch_end

    def full_disk(*args):
        calls["n"] += 1
        if calls["n"] > 2 * per_batch:  # batch 2's first write
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(module, attr, full_disk)
    with pytest.raises(
        hx.StoreError,
        match=r"cannot write the store '.*' at batch 2: the disk is full \[OSError: \[Errno 28\] "
        r"No space left on device\]\. The 2 batches committed before are kept\. Fix: free disk "
        r"space, then run again with the same arguments: it resumes at batch 2\.$",
    ):
        hx.harvest(model, data, where="layers/*", store=tmp_path / "s", overlap=overlap)
    stored = read(tmp_path / "s", "layers/2")
    np.testing.assert_array_equal(stored, captured(model, data[:2], "layers/2"))
    monkeypatch.setattr(module, attr, real)
    h = hx.harvest(model, data, where="layers/*", store=tmp_path / "s", progress=False)
    assert h.resumed_at == 2
    assert_same_store(tmp_path / "ref", tmp_path / "s")


def test_sharded_values_written_shard_by_shard(tmp_path):
    """Rows sharded over 2 devices, the last layer's features over 2 more: same rows as capture."""
    h = w.sharded_run(str(tmp_path / "s"), jax.devices()[:4], n=3)
    model = w.make_model()
    data = w.host_batches(3)
    for name in h.names:
        want = captured(model, data, name, row_axes=2, mask=w.pad_mask)
        np.testing.assert_array_equal(h.read(name), want)


def test_cli_harvest(capsys, tmp_path):
    from hookax._cli.main import main

    argv = ["harvest", "--example", "mlp", "--where", "layers/*", "--batches", "3"]
    code = main([*argv, "--dtype", "bf16", "--out", str(tmp_path / "s"), "--no-progress"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:3] == [
        "layers/0  bfloat16[24,256]",
        "layers/1  bfloat16[24,128]",
        "layers/2  bfloat16[24,10]",
    ]
    assert lines[3].startswith(f"wrote {tmp_path / 's'}: 3 batches, 24 rows, ")
    meta = json.loads((tmp_path / "s" / "hookax.json").read_text())
    assert meta["metadata"] == {"cli": {"input": ["f32[8,784]"], "seed": 0}}
    code = main([*argv[:-1], "0", "--out", str(tmp_path / "t")])
    assert code == 2
    assert capsys.readouterr().err == "hookax: error: --batches takes an integer >= 1, got 0\n"


# ---- call sites inside a scan over layers, and inside jax.vmap ----

L, D = 3, 4


class Block(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.Linear(D, D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        h = x + jnp.tanh(self.attn(x))
        return h + self.mlp(h)


class ScannedDecoder(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.layers)


def test_scanned_layers_one_array_per_layer_and_resume(tmp_path, monkeypatch):
    """blocks inside nnx.scan: (L, B, T, D) values stored as L arrays of (B*T, D) rows, each
    equal to that layer's slice of eager hx.capture; the root (not scanned) alongside; resumed
    runs end identical."""
    model = ScannedDecoder(nnx.Rngs(0))
    data = [x[..., :D] for x in w.host_batches(4)]  # (BATCH, SEQ, D)
    where = hx.Select(paths=("layers/mlp", ""))
    run = dict(where=where, row_axes=2, mask=w.pad_mask, progress=False)
    h = hx.harvest(model, data, store=tmp_path / "ref", **run)
    assert h.names == ("", "layers/mlp[0]", "layers/mlp[1]", "layers/mlp[2]")  # call order
    want = [hx.capture(model, where=run["where"])(x)[1] for x in data]  # eager
    keep = [np.asarray(w.pad_mask(x)) for x in data]
    for i in range(L):
        rows = np.concatenate([np.asarray(a["layers/mlp"][0][i])[k] for a, k in zip(want, keep)])
        np.testing.assert_array_equal(h.read(f"layers/mlp[{i}]"), rows)
    root = np.concatenate([np.asarray(a[""][0])[k] for a, k in zip(want, keep)])
    np.testing.assert_array_equal(h.read(""), root)
    meta = json.loads((tmp_path / "ref" / "hookax.json").read_text())
    assert meta["arrays"]["layers/mlp[2]"] == {
        "key": "layers/mlp",
        "call": 0,
        "part": "",
        "layer": [2],
        "shape": [D],
        "dtype": "float32",
        "dir": "layers.mlp_2_",
    }
    hx.harvest(model, data[:2], store=tmp_path / "s", **run)
    resumed = hx.harvest(model, data, store=tmp_path / "s", **run)
    assert resumed.resumed_at == 2
    assert_same_store(tmp_path / "ref", tmp_path / "s")
    # written shard by shard through TensorStore (as with several processes): the same arrays
    monkeypatch.setattr(_harvest_chunks, "plain", lambda *a: False)
    hx.harvest(model, data, store=tmp_path / "ts", **run)
    assert_same_store(tmp_path / "ref", tmp_path / "ts", files=False)
    # no mask and only scanned values: the rows are what follows the scan axis
    h = hx.harvest(model, data[:1], where="layers/attn", store=tmp_path / "u", row_axes=2)
    (attn,) = hx.capture(model, where="layers/attn")(data[0])[1]["layers/attn"]
    np.testing.assert_array_equal(h.read("layers/attn[1]"), np.asarray(attn[1]).reshape(-1, D))


def test_values_inside_vmap_lead_with_the_batch_axis(tmp_path):
    model = w.make_model()
    data = w.host_batches(2)  # (BATCH, SEQ, WIDTH): the model maps one example's (SEQ, WIDTH)
    h = hx.harvest(
        lambda x: jax.vmap(model)(x), data, where="layers/2", store=tmp_path / "s", row_axes=2
    )
    want = np.concatenate([np.asarray(model(x)).reshape(-1, 6) for x in data])
    np.testing.assert_allclose(h.read("layers/2"), want, rtol=1e-6, atol=1e-6)


FACTORY = """
from flax import nnx


class Scaled(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

    def __call__(self, x, *, scale):
        return self.drop(self.lin(x) * scale)


def make():
    return Scaled()
"""


def test_cli_harvest_file_factory_kw_and_eval(capsys, tmp_path):
    """The model options of every command: a file's factory, --kw (each batch), --eval."""
    from hookax._cli.main import main
    from hookax._diagnostics.gradflow import random_inputs

    (tmp_path / "factory.py").write_text(FACTORY)
    out = tmp_path / "s"
    argv = [f"{tmp_path / 'factory.py'}:make", "--input", "f32[2,3]", "--kw", "scale=2.0"]
    argv += ["--eval", "--where", "drop", "--batches", "2", "--out", str(out), "--no-progress"]
    code = main(["harvest", *argv])
    assert (code, capsys.readouterr().err) == (0, "")
    ns = {}
    exec(FACTORY, ns)
    model = ns["make"]()
    specs = (jax.ShapeDtypeStruct((2, 3), jnp.float32),)
    xs = [random_inputs(specs, i)[0] for i in range(2)]
    want = np.concatenate([np.asarray(model.lin(x)) * 2 for x in xs])  # no dropout: --eval
    np.testing.assert_allclose(read(out, "drop"), want, rtol=1e-6, atol=1e-6)
    meta = json.loads((out / "hookax.json").read_text())
    assert meta["metadata"]["cli"] == {
        "input": ["f32[2,3]"],
        "seed": 0,
        "kw": ["scale=2.0"],
        "eval": True,
    }
    assert meta["model"] == "hookax._cli.harvest._Call"


@pytest.mark.parametrize(("width", "rows"), [(64, 256), (3, 1000)])  # O_DIRECT; buffered
def test_chunk_files_appended_and_resumed_over_a_killed_runs_rows(tmp_path, width, rows):
    """Appends of any size; a resumed run cuts off the rows a killed run left after the
    committed ones (in their chunk: later chunks go when the run's finish shrinks the array)."""
    import itertools

    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "a")}}
    keys = {"name": "default", "configuration": {"separator": "."}}
    arr = ts.open(
        {**spec, "metadata": {"chunk_key_encoding": keys}},
        create=True,
        dtype=ts.float32,
        shape=[-(-1000 // rows) * rows, width],
        chunk_layout=ts.ChunkLayout(chunk_shape=[rows, width]),
        fill_value=0,
    ).result()
    rng = np.random.default_rng(0)
    data = rng.normal(size=(1000, width)).astype(np.float32)

    def chunks(base):
        c = _harvest_chunks.Chunks(tmp_path / "a", rows, (width,), np.float32, ".")
        c.resume(base, lambda lo, hi: arr[lo:hi].read().result())
        return c

    c = chunks(0)
    assert c.direct == (width == 64 and bool(_harvest_chunks._O_DIRECT))
    for a, b in itertools.pairwise([0, 5, 300, 301, 512, 600]):
        c.write(data[a:b])
    chunks(600).write(rng.normal(size=(400, width)).astype(np.float32))  # killed: uncommitted
    c = chunks(600)  # the resumed run
    c.write(data[600:610])
    end = (609 // rows + 1) * rows  # the end of the chunk holding the last row
    want = np.concatenate([data[:610], np.zeros((end - 610, width), np.float32)])
    np.testing.assert_array_equal(arr[:end].read().result(), want)
    c.write(data[610:1000])
    np.testing.assert_array_equal(arr[:1000].read().result(), data)


def test_operations_inside_call_sites_are_harvested(tmp_path):
    attn = nnx.MultiHeadAttention(num_heads=2, in_features=4, decode=False, rngs=nnx.Rngs(0))
    data = [jax.random.normal(jax.random.key(i), (3, 5, 4)) for i in range(2)]
    # the probabilities are (groups=1, batch, heads, q, k): rows over (groups, batch)
    h = hx.harvest(attn, data, ops=":softmax", row_axes=2, store=tmp_path / "s", progress=False)
    assert h.names == (":softmax",)
    want = np.concatenate(
        [np.asarray(hx.capture(attn, ops=":softmax")(x)[1][":softmax"][0][0]) for x in data]
    )
    np.testing.assert_allclose(h.read(":softmax"), want, rtol=1e-6, atol=1e-6)
    meta = json.loads((tmp_path / "s" / "hookax.json").read_text())
    assert meta["where"] == "<no call sites> ops=[':softmax']"
