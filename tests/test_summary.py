"""hx.summary: call-order rows, exact parameter counts, XLA FLOPs, folding, JSON, abstractness."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import hookax as hx
from hookax import _context
from hookax.examples import NAMES, load

F32 = jnp.float32


def _abstract(name):
    ex = load(name)
    return nnx.eval_shape(lambda: ex.make_model(nnx.Rngs(0))), ex.example_inputs()


def test_linear_flops_match_formula_and_xla_eager_and_abstract():
    lin = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    x = jnp.ones((8, 64), F32)
    on_array = hx.summary(lin, x)
    on_spec = hx.summary(lin, jax.ShapeDtypeStruct((8, 64), F32))
    assert on_array == on_spec
    (row,) = on_array.rows
    assert row.flops == 2 * 64 * 32 * 8 + 32 * 8 == 33_024
    xla = jax.jit(lambda m, x: m(x)).lower(lin, x).compile().cost_analysis()
    assert row.flops == xla["flops"]
    assert (row.key, row.type, row.inputs, row.outputs) == (
        "",
        "Linear",
        ("f32[8,64]",),
        ("f32[8,32]",),
    )
    assert (row.params, row.param_bytes) == (64 * 32 + 32, (64 * 32 + 32) * 4)
    assert on_array.totals == hx.SummaryTotals(2080, 8320, 33_024, 0)


@pytest.mark.parametrize(
    ("name", "params"),
    [("mlp", 235_146), ("cnn", 25_578), ("resnet", 78_042), ("transformer", 115_520)],
)
def test_example_parameter_counts_exact(name, params):
    model, inputs = _abstract(name)
    s = hx.summary(model, *inputs)
    assert s.totals.params == params == load(name).PARAMS
    assert s.rows[0].params == params
    assert s.totals.param_bytes == 4 * params
    assert s.totals.flops == s.rows[0].flops > 0


def test_concrete_and_abstract_models_agree():
    mlp = load("mlp")
    concrete = mlp.MLP((32, 16, 4), rngs=nnx.Rngs(0))
    s = hx.summary(concrete, jnp.zeros((8, 32), F32))
    abstract = nnx.eval_shape(lambda: mlp.MLP((32, 16, 4), rngs=nnx.Rngs(0)))
    assert s == hx.summary(abstract, jax.ShapeDtypeStruct((8, 32), F32))
    assert [r.key for r in s.rows] == ["", "layers/0", "layers/1"]
    assert [r.outputs for r in s.rows] == [("f32[8,4]",), ("f32[8,16]",), ("f32[8,4]",)]
    assert [r.flops for r in s.rows[1:]] == [2 * 8 * 32 * 16 + 8 * 16, 2 * 8 * 16 * 4 + 8 * 4]
    # The model's count is its layers' plus the ReLU (one max per element).
    assert s.rows[0].flops == sum(r.flops for r in s.rows[1:]) + 8 * 16
    assert s.totals.params == 32 * 16 + 16 + 16 * 4 + 4


def test_cnn_rows():
    model, inputs = _abstract("cnn")
    s = hx.summary(model, *inputs)
    assert [r.key for r in s.rows] == ["", "conv1", "conv2", "head"]
    assert [r.params for r in s.rows] == [25_578, 448, 4_640, 20_490]
    assert s.rows[1].outputs == ("f32[8,32,32,16]",)
    assert s.rows[2].inputs == ("f32[8,16,16,16]",)
    assert sum(r.flops for r in s.rows[1:]) < s.rows[0].flops


def test_tied_weights_counted_once_and_marked():
    model, inputs = _abstract("transformer")
    s = hx.summary(model, *inputs)
    rows = {r.key: r for r in s.rows}
    vocab_d = 256 * 64
    assert rows["embed"].params == rows["lm_head"].params == vocab_d
    assert rows["embed"].shared_with == ("lm_head",)
    assert rows["lm_head"].shared_with == ("embed",)
    assert not rows["layers/0"].shared
    assert s.totals.shared_params == vocab_d
    top = [r for r in s.rows if r.depth == 1]
    assert sum(r.params for r in top) == s.totals.params + vocab_d  # rows each count the tie
    text = str(s)
    assert "(tied: lm_head)" in text and "(tied: embed)" in text
    assert "of which tied/shared: 16,384, counted once" in text


def test_rows_in_call_order_with_method_keys():
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 4, rngs=rngs)
            self.proj = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, t):
            return self.embed.attend(self.proj(self.embed(t)))

    s = hx.summary(Tied(nnx.Rngs(0)), jax.ShapeDtypeStruct((2, 3), jnp.int32))
    assert [r.key for r in s.rows] == ["", "embed", "proj", "embed:attend"]
    assert [r.depth for r in s.rows] == [0, 1, 1, 1]
    assert s.rows[3].outputs == ("f32[2,3,10]",)
    assert s.rows[3].flops == 2 * 2 * 3 * 4 * 10
    assert s.totals.params == 40 + 20


def test_depth_folds_into_parent_rows():
    model, inputs = _abstract("transformer")
    full = hx.summary(model, *inputs)
    one = hx.summary(model, *inputs, depth=1)
    assert [r.key for r in one.rows] == ["", "embed", "layers/0", "layers/1", "norm", "lm_head"]
    by_key = {r.key: r for r in full.rows}
    for r in one.rows:  # parameters and FLOPs already include the folded rows
        assert (r.params, r.flops) == (by_key[r.key].params, by_key[r.key].flops)
    assert [r.folded for r in one.rows] == [0, 0, 11, 11, 0, 0]
    assert [r.depth for r in full.rows if r.key.startswith("layers/0")] == [
        1,
        2,
        2,
        3,
        3,
        3,
        3,
        2,
        2,
        3,
        3,
        3,
    ]
    (root,) = hx.summary(model, *inputs, depth=0).rows
    assert root.folded == len(full.rows) - 1
    assert one.totals == full.totals
    assert "[+11 folded]" in str(one)


def test_identical_call_sites_share_one_lowering(traces):
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            traces()
            return self.lin(x)

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Layer(rngs) for _ in range(4)])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    s = hx.summary(Stack(nnx.Rngs(0)), jax.ShapeDtypeStruct((2, 8), F32))
    assert traces.n == 4 + 1  # the traced call, then one lowering for all four layers
    assert {r.flops for r in s.rows if r.type == "Layer"} == {2 * 2 * 8 * 8 + 2 * 8}
    hx.summary(Stack(nnx.Rngs(0)), jax.ShapeDtypeStruct((3, 8), F32))
    assert traces.n == 5 + 4 + 1


def test_json_round_trip():
    model, inputs = _abstract("resnet")
    s = hx.summary(model, *inputs, depth=2)
    back = hx.Summary.from_json(s.to_json())
    assert back == s
    assert str(back) == str(s)
    assert back.rows[1].path == ("stem",)


def test_table_ends_with_totals_written_in_full():
    model, inputs = _abstract("mlp")
    lines = str(hx.summary(model, *inputs)).splitlines()
    assert lines[-3] == "Total parameters: 235,146"
    assert lines[-2] == "Parameter bytes: 940,584 (918.54 KiB)"
    assert lines[-1].startswith("FLOPs (XLA cost analysis): ")


def test_nothing_weights_sized_is_allocated():
    # 10 billion parameters (40 GB in float32): only possible abstractly.
    big = nnx.eval_shape(lambda: nnx.Linear(100_000, 100_000, rngs=nnx.Rngs(0)))
    s = hx.summary(big, jax.ShapeDtypeStruct((4, 100_000), F32))
    assert s.totals.params == 10_000_100_000
    # XLA reports FLOPs as a float: exact to its precision.
    assert s.totals.flops == pytest.approx(2 * 4 * 100_000 * 100_000 + 4 * 100_000, rel=1e-6)
    assert "10,000,100,000" in str(s)


def test_rejected_input_propagates_with_the_call_site_named():
    model, _ = _abstract("mlp")
    with pytest.raises(TypeError, match="dot_general") as info:
        hx.summary(model, jax.ShapeDtypeStruct((8, 10), F32))
    notes = info.value.__notes__
    assert (
        "hookax.summary: call site 'layers/0' (Linear.__call__) rejected its input f32[8,10]"
        in notes
    )
    assert _context.active_entries() == ()
    assert _context.call_stack() == []


def test_bad_arguments():
    with pytest.raises(
        hx.HookaxError, match="supports Flax NNX, Flax Linen and Equinox modules; got function"
    ):
        hx.summary(lambda x: x, jnp.ones(2))
    with pytest.raises(hx.HookaxError, match=r"depth=\.\.\.\) takes an int >= 0 or None, got -1"):
        hx.summary(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 2)), depth=-1)


def test_every_example_is_listed():
    assert NAMES == ("cnn", "mlp", "resnet", "transformer")


def test_call_sites_inside_nnx_scan_keep_their_paths():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return jax.nn.relu(self.lin(x))

    class Scanned(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, block):
                return block(x)

            return body(x, self.blocks)

    s = hx.summary(Scanned(nnx.Rngs(0)), jax.ShapeDtypeStruct((2, 8), F32))
    assert [r.key for r in s.rows] == ["", "blocks", "blocks/lin"]
    assert [r.params for r in s.rows] == [3 * 72, 3 * 72, 3 * 72]  # stacked parameters
    # Rows inside the scan are one iteration: shapes and FLOPs of one layer.
    assert s.rows[2].inputs == s.rows[2].outputs == ("f32[2,8]",)
    assert s.rows[2].flops == 2 * 2 * 8 * 8 + 2 * 8
    # XLA's cost analysis counts a loop body once (a known limit of its count, kept as is).
    assert s.totals.flops == s.rows[1].flops + 2
