"""hx.summary: call-order rows, exact parameter counts, XLA FLOPs, folding, JSON, abstractness."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._engine import context as _context
from hookax.examples import NAMES, load

F32 = jnp.float32


def _vjp_of(f):
    """Forward and backward of ``f`` w.r.t. every float leaf, pulled back on its own output."""

    def run(*args):
        out, pullback = jax.vjp(f, *args)
        return pullback(out)

    return run


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
    t = on_array.totals
    assert (t.params, t.param_bytes, t.flops, t.shared_params, t.state) == (
        2080,
        8320,
        33_024,
        0,
        (),
    )
    vjp = jax.jit(_vjp_of(lambda m, x: m(x))).lower(lin, x).cost_analysis()
    assert t.vjp_flops == row.vjp_flops == vjp["flops"]
    # A linear layer keeps only its input and kernel for the backward pass: no activations.
    assert t.memory == hx.Memory(inputs=8 * 64 * 4, params=8320, gradients=8320, activations=0)
    assert on_array.title == "Linear(f32[8,64])"


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
    # The whole call forward and forward+backward, then one of each for all four layers.
    assert traces.n == 4 + 4 + 1 + 1
    assert {r.flops for r in s.rows if r.type == "Layer"} == {2 * 2 * 8 * 8 + 2 * 8}
    hx.summary(Stack(nnx.Rngs(0)), jax.ShapeDtypeStruct((3, 8), F32))
    assert traces.n == 10 + 4 + 4 + 1 + 1


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
    assert lines[0] == "MLP(f32[8,784])"
    assert lines[-4] == "Total parameters: 235,146 (918.54 KiB)"
    assert lines[-3].startswith("FLOPs (XLA cost analysis): forward ")
    assert lines[-2].startswith("FLOPs forward+backward (VJP): ")
    assert lines[-1].startswith("Memory of one training step (estimate): ")


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
    # A function of no module is a program without modules: its own call sites are the rows.
    assert [r.key for r in hx.summary(lambda x: x, jnp.ones(2)).rows] == [""]
    with pytest.raises(
        hx.HookaxError, match="supports Flax NNX, Flax Linen and Equinox modules and Haiku t"
    ):
        hx.summary(object(), jnp.ones(2))
    with pytest.raises(hx.HookaxError, match=r"depth=\.\.\.\) takes an int >= 0 or None, got -1"):
        hx.summary(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 2)), depth=-1)


def test_every_example_is_listed():
    assert NAMES == ("cnn", "mlp", "resnet", "transformer", "llama_functions")


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
    assert [r.trips for r in s.rows] == [1, 3, 3]
    # Shapes are one iteration's; FLOPs count all three trips.
    assert s.rows[2].inputs == s.rows[2].outputs == ("f32[2,8]",)
    linear = 2 * 2 * 8 * 8 + 2 * 8
    assert s.rows[2].flops == 3 * linear
    assert s.rows[1].flops == 3 * (linear + 2 * 8)  # and the ReLU
    # XLA's cost analysis counts a loop body once; the total counts every trip (+2: the loop).
    body_once = jax.jit(lambda m, x: m(x)).lower(Scanned(nnx.Rngs(0)), jnp.ones((2, 8), F32))
    assert s.totals.flops == body_once.cost_analysis()["flops"] + 2 * (linear + 2 * 8)
    assert s.totals.flops == s.rows[1].flops + 2
    assert "blocks/lin  x3" in str(s)


class Net(nnx.Module):
    """Parameters, batch statistics and an RNG stream: every kind of NNX state."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.bn(self.lin(x))))


def _tabulate_rows(text):
    """nnx.tabulate's plain table as {path: {column: cell text}} (multi-line cells joined)."""
    lines = [ln for ln in text.splitlines() if ln.startswith(("┃", "│", "├"))]
    header = [c.strip() for c in lines[0].strip("┃").split("┃")]
    rows, block = {}, []
    for ln in [*lines[1:], "├"]:
        if ln.startswith("├") and block:
            cells = [" ".join(" ".join(c).split()) for c in zip(*block, strict=True)]
            if cells[1]:  # not the totals line
                rows[cells[0]] = dict(zip(header, cells, strict=True))
            block = []
        elif ln.startswith("│"):
            block.append([c.strip() for c in ln.strip("│").split("│")])
    return rows


def test_against_nnx_tabulate_counts_bytes_and_flops():
    model = Net(nnx.Rngs(0, dropout=1))
    x = jnp.ones((2, 8), F32)
    text = nnx.tabulate(
        model,
        x,
        compute_flops=True,
        compute_vjp_flops=True,
        console_kwargs={"width": 400, "force_terminal": False, "color_system": None},
    )
    theirs = _tabulate_rows(text)
    s = hx.summary(model, x)
    assert [r.key for r in s.rows] == ["", "lin", "bn", "drop", "out"]
    for row in s.rows:
        t = theirs[row.key]
        assert (str(row.flops), str(row.vjp_flops)) == (t["flops"], t["vjp_flops"]), row.key
        ours = {"Param": f"{row.params:,} ({row.param_bytes} B)"} if row.params else {}
        ours |= {name: f"{n:,} ({b} B)" for name, n, b in row.state}
        for column in ("Param", "BatchStat", "RngState"):
            assert t[column].endswith(ours.get(column, "")), (row.key, column)
            assert bool(t[column].strip()) == (column in ours), (row.key, column)
    assert s.totals.state == (("BatchStat", 32, 128), ("RngState", 2, 12))
    assert (s.totals.params, s.totals.non_trainable) == (244, 34)
    assert "Total Parameters: 278 " in text
    assert "Non-trainable: 34 (140 B): BatchStat 32 (128 B), RngState 2 (12 B)" in str(s)


def test_variables_listed_on_request_and_train_switch():
    model = nnx.eval_shape(lambda: Net(nnx.Rngs(0, dropout=1)))
    s = hx.summary(model, "f32[2,8]", variables=True, depth=1)
    rows = {r.key: r for r in s.rows}
    assert rows["lin"].variables == ("bias: Param f32[16]", "kernel: Param f32[8,16]")
    assert rows["drop"].variables == ("rngs/count: RngCount u32[]", "rngs/key: RngKey key<fry>[]")
    assert hx.summary(model, "f32[2,8]").rows[1].variables == ()
    # Dropout in eval mode does no work; in training mode it draws and masks.
    train = {r.key: r.flops for r in hx.summary(model, "f32[2,8]", train=True).rows}
    evals = {r.key: r.flops for r in hx.summary(model, "f32[2,8]", train=False).rows}
    assert evals["drop"] == 0 and train["drop"] > 0
    assert evals[""] < train[""]
    assert model.drop.deterministic is False  # the summary switched a copy


def test_a_model_that_has_sown_values_is_summarised():
    # sow keeps a tuple of the values sown in an nnx.Intermediate: counted and listed leaf by leaf.
    class Sows(nnx.Module):
        def __init__(self) -> None:
            self.lin = nnx.Linear(3, 4, rngs=nnx.Rngs(0))

        def __call__(self, x: jax.Array) -> jax.Array:
            y = self.lin(x)
            self.sow(nnx.Intermediate, "h", y)
            return y

    model = Sows()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # sow outside nnx.capture
        model(jnp.ones((2, 3)))
        s = hx.summary(model, "f32[2,3]", variables=True)
    assert s.totals.params == 16
    assert s.totals.state == (("Intermediate", 8, 32),)
    assert s.rows[0].variables == ("h: Intermediate (f32[2,4],)",)
    assert "Non-trainable: 8 (32 B): Intermediate 8 (32 B)" in str(s)
    (sown,) = model.h.get_value()  # the model kept its own value: one concrete array
    np.testing.assert_array_equal(sown, model.lin(jnp.ones((2, 3))))


def test_memory_estimate_against_xla_memory_analysis():
    model = load("mlp").MLP((16, 64, 64, 4), rngs=nnx.Rngs(0))
    x = jax.ShapeDtypeStruct((32, 16), F32)
    graphdef, params = nnx.split(model)

    def step(params, x):
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2)  # noqa: E731
        return jax.grad(loss)(params)

    ma = jax.jit(step).lower(params, x).compile().memory_analysis()
    xla = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
    m = hx.summary(model, x).totals.memory
    assert m.activations == 2 * 32 * 64 * (4 + 4 + 1)  # ReLU outputs, their masks, zeros
    assert m.total == pytest.approx(xla, rel=0.1)
    exact = hx.summary(model, x, xla_memory=True).totals.memory
    vjp = jax.jit(_vjp_of(lambda m, x: m(x))).lower(model, x).compile().memory_analysis()
    assert (exact.source, exact.activations) == ("xla", vjp.temp_size_in_bytes)


def test_reuse_pytree_outputs_named_kwargs_and_method():
    class Shared(nnx.Module):
        def __init__(self, rngs):
            lin = nnx.Linear(4, 4, rngs=rngs)
            self.layers = nnx.List([lin, lin])
            self.proj = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x, *, cache, scale=1.0):
            for layer in self.layers:
                x = layer(x)
            return {"logits": self.proj(x) * scale, "cache": (cache["k"] + 1, x)}

        def encode(self, x):
            return self.layers[0](x)

    model = Shared(nnx.Rngs(0))
    cache = {"k": jax.ShapeDtypeStruct((2, 3), F32), "v": None}
    s = hx.summary(model, "f32[2,4]", cache=cache, scale=2.0)
    assert [(r.key, r.same_as, r.params) for r in s.rows] == [
        ("", None, 30),
        ("layers/0", None, 20),
        ("layers/0", "layers/0", 0),
        ("proj", None, 10),
    ]
    assert "(same module as layers/0)" in str(s)
    assert s.totals.params == 30
    assert s.rows[0].inputs == ("f32[2,4]", "cache/k: f32[2,3]", "scale: 2.0")
    assert s.rows[0].outputs == ("cache/0: f32[2,3]", "cache/1: f32[2,4]", "logits: f32[2,2]")
    assert s.title == "Shared(f32[2,4], cache/k: f32[2,3], scale: 2.0)"
    enc = hx.summary(model, "f32[5,4]", method="encode")
    assert [r.key for r in enc.rows] == [":encode", "layers/0"]
    assert enc.title == "Shared.encode(f32[5,4])"


def test_no_inputs_shape_tuples_and_bad_specs_say_how_to_fix():
    lin = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    with pytest.raises(
        hx.HookaxError,
        match=r"cannot call Linear.__call__\(inputs.*missing a "
        r"required argument: 'inputs'.*hx.summary\(model, \"f32\[8,784\]\"\)",
    ):
        hx.summary(lin)
    with pytest.raises(
        hx.HookaxError,
        match=r"a tuple of ints is not an input shape.*"
        r'hx.summary\(model, "f32\[8,4\]"\)',
    ):
        hx.summary(lin, (8, 4))
    with pytest.raises(hx.HookaxError, match="cannot parse input spec 'f32\\[8,x\\]'"):
        hx.summary(lin, "f32[8,x]")
    with pytest.raises(hx.HookaxError, match="has no method 'encode'"):
        hx.summary(lin, "f32[8,4]", method="encode")


def test_vmap_rows_labelled_and_no_work_reads_zero():
    class Head(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.0)

        def __call__(self, x):
            return jax.vmap(self.lin)(self.drop(x, deterministic=True))

    s = hx.summary(Head(nnx.Rngs(0)), "f32[3,8]")
    rows = {r.key: r for r in s.rows}
    assert rows["drop"].flops == 0 and rows["drop"].vjp_flops == 0
    assert rows["lin"].vmapped == (3,) and rows["lin"].inputs == ("f32[8]",)
    assert rows["lin"].flops == 3 * (2 * 8 * 4 + 4)  # every element of the vmap
    assert "lin  (vmap 3)" in str(s)


def test_markdown_and_json_round_trip_keep_everything():
    model = nnx.eval_shape(lambda: Net(nnx.Rngs(0, dropout=1)))
    s = hx.summary(model, "f32[2,8]", variables=True)
    assert hx.Summary.from_json(s.to_json()) == s
    md = s.to_markdown().splitlines()
    assert md[0] == "**Net(f32[2,8])**"
    assert md[2] == "| Call site | Type | Inputs | Outputs | Params | FLOPs | VJP FLOPs |"
    assert md[-5] == "- Total parameters: 244 (976 B)"


def test_linen_nn_scan_rows_once_with_trip_count_and_batch_stats():
    import flax.linen as nn

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.relu(nn.Dense(8)(x)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            scan = nn.scan(
                Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=5
            )
            x, _ = scan()(x, None)
            return nn.BatchNorm(use_running_average=not train)(x)

    s = hx.summary(Stack(), "f32[3,8]")
    assert [(r.key, r.trips) for r in s.rows] == [
        ("", 1),
        ("ScanLayer_0", 5),
        ("ScanLayer_0/Dense_0", 5),
        ("BatchNorm_0", 1),
    ]
    dense = 2 * 3 * 8 * 8 + 3 * 8
    assert s.rows[2].flops == 5 * dense
    assert (s.totals.params, s.totals.state) == (5 * 72 + 16, (("batch_stats", 16, 64),))
    # The train switch reaches Linen's own `train` argument.
    assert hx.summary(Stack(), "f32[3,8]", train=False).rows[-1].flops < s.rows[-1].flops


def test_a_pytree_of_many_leaves_is_one_line():
    """A KV cache of 28 layers (56 arrays) is one cell line, counted by spec, in the title, the
    inputs and the outputs; a pytree of a few leaves keeps one line per leaf."""

    class Step(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

        def __call__(self, x, cache):
            return self.lin(x), [(k * 2, v) for k, v in cache]

    cache = [(jax.ShapeDtypeStruct((2, 3), jnp.float32),) * 2] * 28
    s = hx.summary(Step(), "f32[2,4]", cache)
    assert s.title == "Step(f32[2,4], cache: 56 x f32[2,3])"
    assert s.rows[0].inputs == ("f32[2,4]", "cache: 56 x f32[2,3]")
    assert s.rows[0].outputs == ("f32[2,4], 56 x f32[2,3]",)
    assert len(str(s).splitlines()) < 20
    few = hx.summary(Step(), "f32[2,4]", cache[:1])
    assert few.rows[0].inputs == ("f32[2,4]", "cache/0/0: f32[2,3]", "cache/0/1: f32[2,3]")


def test_a_function_that_calls_the_model():
    """``hx.summary(forward, model, cache, tokens)`` as ``hx.capture`` takes a function: the rows
    are the model's call sites, the same as summarising the model's own call."""
    import equinox as eqx

    class Step(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

        def __call__(self, x, cache):
            return self.lin(x) + cache

    def forward(cache, model, x):
        return model(x, cache) * 2.0

    model = Step()
    s = hx.summary(forward, "f32[2,4]", model, "f32[2,4]")
    direct = hx.summary(model, "f32[2,4]", "f32[2,4]")
    assert s.title == "forward(f32[2,4], f32[2,4])"  # positional arrays bare, as for a model
    assert [(r.key, r.params) for r in s.rows] == [(r.key, r.params) for r in direct.rows]
    assert s.rows[1].flops == direct.rows[1].flops
    assert s.totals.params == direct.totals.params == 20
    # The first row and the totals count the function's own work too (the * 2.0: 8 FLOPs).
    assert s.totals.flops == direct.totals.flops + 8
    em = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    e = hx.summary(lambda m, x: jnp.tanh(m(x)), em, "f32[4]")
    assert e.totals.params == 15 and e.rows[0].outputs == ("f32[3]",)
    with pytest.raises(hx.HookaxError, match="missing a required argument: 'x'"):
        hx.summary(forward, "f32[2,4]", "f32[2,4]")  # the model left out
    with pytest.raises(TypeError, match="not callable") as info:  # a program without modules
        hx.summary(forward, "f32[2,4]", "f32[2,4]", "f32[2,4]")
    assert any("none of its positional arguments is a module" in n for n in info.value.__notes__)
    with pytest.raises(hx.HookaxError, match="cannot call forward"):
        hx.summary(forward, model)


@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_a_private_method_is_the_root_of_its_summary(framework):
    """A private method is no call site, but summarised it is the root: the submodules it
    calls are keyed by their paths in the model (they were each "(model)" before); the same for
    a function that calls it, or calls the submodules itself."""
    x = jnp.ones((1, 2))
    if framework == "nnx":

        class M(nnx.Module):
            def __init__(self):
                self.a = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
                self.b = nnx.Linear(2, 2, rngs=nnx.Rngs(1))

            def _private(self, x):
                return self.b(self.a(x)) * 2

        model = M()
    else:
        import equinox as eqx

        class M(eqx.Module):
            a: eqx.nn.Linear
            b: eqx.nn.Linear

            def __init__(self):
                self.a = eqx.nn.Linear(2, 2, key=jax.random.key(0))
                self.b = eqx.nn.Linear(2, 2, key=jax.random.key(1))

            def _private(self, x):
                return self.b(self.a(x)) * 2

        model, x = M(), jnp.ones((2,))
    s = hx.summary(model, x, method="_private")
    assert [(r.key, r.type, r.method) for r in s.rows] == [
        (":_private", "M", "_private"),
        ("a", "Linear", "__call__"),
        ("b", "Linear", "__call__"),
    ]
    assert s.rows[0].flops == s.totals.flops > s.rows[1].flops + s.rows[2].flops
    # a function that calls it, or the submodules directly: the model is the root all the same
    for fn in (lambda m, x: m._private(x), lambda m, x: m.b(m.a(x)) * 2):
        f = hx.summary(fn, model, x)
        assert [(r.key, r.type) for r in f.rows] == [("", "M"), ("a", "Linear"), ("b", "Linear")]
        assert f.totals.flops == s.totals.flops and f.totals.params == s.totals.params


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
def test_a_second_method_of_a_module_counts_no_parameters_of_its_own(framework):
    """``attn.__call__`` running ``attn.native_forward`` (EasyDeL's layout): the method's row
    says where its parameters are counted instead of repeating them; a module reached only
    through a method counts them on that method's row."""
    x = jnp.ones((1, 8))
    if framework == "nnx":

        class Attn(nnx.Module):
            def __init__(self, rngs):
                self.q = nnx.Linear(8, 8, rngs=rngs)

            def __call__(self, x):
                return self.native_forward(x)

            def native_forward(self, x):
                return jax.nn.softmax(self.q(x))

        class M(nnx.Module):
            def __init__(self, rngs):
                self.attn = Attn(rngs)
                self.other = Attn(rngs)

            def __call__(self, x):
                return self.other.native_forward(self.attn(x))

        model = M(nnx.Rngs(0))
    elif framework == "linen":
        import flax.linen as nn

        class Attn(nn.Module):
            def setup(self):
                self.q = nn.Dense(8)

            def __call__(self, x):
                return self.native_forward(x)

            def native_forward(self, x):
                return jax.nn.softmax(self.q(x))

        class M(nn.Module):
            def setup(self):
                self.attn = Attn()
                self.other = Attn()

            def __call__(self, x):
                return self.other.native_forward(self.attn(x))

        model = M()
    else:
        import equinox as eqx

        class Attn(eqx.Module):
            q: eqx.nn.Linear

            def __init__(self, key):
                self.q = eqx.nn.Linear(8, 8, key=key)

            def __call__(self, x):
                return self.native_forward(x)

            def native_forward(self, x):
                return jax.nn.softmax(self.q(x))

        class M(eqx.Module):
            attn: Attn
            other: Attn

            def __init__(self):
                self.attn, self.other = Attn(jax.random.key(0)), Attn(jax.random.key(1))

            def __call__(self, x):
                return self.other.native_forward(self.attn(x))

        model, x = M(), jnp.ones((8,))
    s = hx.summary(model, x)
    rows = {r.key: r for r in s.rows}
    assert rows["attn"].params == rows["other:native_forward"].params == 72
    assert rows["attn:native_forward"].params == 0
    assert rows["attn:native_forward"].params_in == "attn"
    assert rows["attn"].params_in is rows["other:native_forward"].params_in is None
    assert s.totals.params == 144
    assert sum(r.params for r in s.rows if r.depth == 1) == s.totals.params
    assert "(in attn)" in str(s)


def test_a_model_that_returns_names_beside_arrays():
    """Strings, ints and ``None`` in a model's output are listed; a ``jit`` could not return
    them, so the traced program leaves them out, and FLOPs count only the arrays' work."""
    import equinox as eqx

    class Named(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)

        def __call__(self, x):
            return {"out": self.lin(x), "name": "lin", "step": 3, "aux": None}

    class EqxNamed(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return self.lin(x), ("a", "b")

    plain = hx.summary(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), "f32[2,3]")
    s = hx.summary(Named(nnx.Rngs(0)), "f32[2,3]")
    assert s.rows[0].outputs == ("name: 'lin'", "out: f32[2,4]", "step: 3")
    assert [r.key for r in s.rows] == ["", "lin"]
    assert s.totals.flops == plain.totals.flops
    e = hx.summary(EqxNamed(eqx.nn.Linear(3, 4, key=jax.random.key(0))), "f32[3]")
    assert e.rows[0].outputs == ("0: f32[4]", "1/0: 'a'", "1/1: 'b'")
    assert e.totals.params == 16
