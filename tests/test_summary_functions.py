"""hx.summary and ``hookax summary`` of programs without modules (functions over weights)."""

import json
import textwrap

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import hookax as hx
from hookax._cli.main import main
from hookax._summary import cost
from hookax.examples import llama_functions
from hookax.frameworks._functions import program_of

D, F, V, L = 16, 24, 32, 2


def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def embed(tokens, table):
    return table[tokens]


def unembed(x, table):
    return x @ table.T


def layer(x, lw):
    with jax.named_scope("attention"):
        h = rms(x, lw["ln1"])
        scores = jax.nn.softmax((h @ lw["wq"]) @ (h @ lw["wk"]).swapaxes(-1, -2), axis=-1)
        x = x + (scores @ (h @ lw["wv"])) @ lw["wo"]
    with jax.named_scope("ffn"):
        x = x + jax.nn.silu(rms(x, lw["ln2"]) @ lw["w1"]) @ lw["w2"]
    return x


def forward(weights, tokens):
    x = embed(tokens, weights["embed"])
    for lw in weights["layers"]:
        x = layer(x, lw)
    return unembed(rms(x, weights["norm"]), weights["embed"])


def init(key, stacked=False):
    keys = iter(jax.random.split(key, 64))

    def n(*shape):
        return jax.random.normal(next(keys), shape) * 0.02

    def one():
        return {"ln1": jnp.ones(D), "wq": n(D, D), "wk": n(D, D), "wv": n(D, D), "wo": n(D, D),
                "ln2": jnp.ones(D), "w1": n(D, F), "w2": n(F, D)}  # fmt: skip

    layers = [one() for _ in range(L)]
    if stacked:
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return {"embed": n(V, D), "layers": layers, "norm": jnp.ones(D)}


def size(tree):
    return sum(x.size for x in jax.tree.leaves(tree))


WEIGHTS = init(jax.random.key(0))
TOKENS = jnp.arange(8, dtype=jnp.int32).reshape(1, 8)


@pytest.fixture(scope="module")
def summary():
    return hx.summary(forward, WEIGHTS, TOKENS)


def test_rows_are_the_program_call_sites(summary):
    prog = program_of(forward, (WEIGHTS, TOKENS), {})
    sites = ["/".join(map(str, s.path)) for s in prog.sites()]
    assert [r.key for r in summary.rows] == ["", *sites]
    assert sites[:4] == ["embed", "layer/0", "layer/0/attention", "layer/0/attention/rms"]
    kinds = {r.key: r.type for r in summary.rows}
    assert kinds[""] == "forward" and kinds["layer/1"] == "layer"
    assert kinds["layer/1/ffn"] == "named_scope" and kinds["layer/1/ffn/rms"] == "rms"
    assert [r.depth for r in summary.rows[:5]] == [0, 1, 1, 2, 3]
    assert summary.title == (
        "forward(weights: f32[32,16], 5 x f32[16], 2 x f32[16,24], 2 x f32[24,16], "
        "8 x f32[16,16], i32[1,8])"
    )


def test_parameters_exact_per_layer_and_in_total(summary):
    rows = {r.key: r for r in summary.rows}
    assert summary.totals.params == size(WEIGHTS) == rows[""].params
    assert summary.totals.param_bytes == 4 * size(WEIGHTS)
    for i in range(L):
        assert rows[f"layer/{i}"].params == size(WEIGHTS["layers"][i])
        assert rows[f"layer/{i}/attention/rms"].params == D
        attention = ("ln1", "wq", "wk", "wv", "wo")
        assert rows[f"layer/{i}/attention"].params == sum(
            WEIGHTS["layers"][i][k].size for k in attention
        )
    assert rows["rms"].params == D
    # The embedding, read by embed and by unembed: shown on both, counted once.
    assert rows["embed"].params == rows["unembed"].params == V * D
    assert rows["embed"].shared_with == ("unembed",)
    assert rows["unembed"].shared_with == ("embed",)
    assert summary.totals.shared_params == V * D
    assert "(tied: embed)" in str(summary)


def test_shapes(summary):
    rows = {r.key: r for r in summary.rows}
    assert rows["embed"].inputs == ("i32[1,8]", "f32[32,16]")
    assert rows["embed"].outputs == ("f32[1,8,16]",)
    assert rows["layer/0"].inputs == (
        "f32[1,8,16]",
        "lw: 2 x f32[16], f32[16,24], f32[24,16], 4 x f32[16,16]",  # named by the parameter
    )
    assert rows["layer/0/attention"].inputs == ("f32[1,8,16]",)  # weights left out
    assert rows["layer/0/ffn"].outputs == ("f32[1,8,16]",)
    assert rows[""].outputs == ("f32[1,8,32]",)


def test_flops_match_the_whole_program_and_each_function_alone(summary):
    whole = cost.flops(jax.jit(forward).trace(WEIGHTS, TOKENS))
    assert summary.totals.flops == summary.rows[0].flops == whole
    rows = {r.key: r for r in summary.rows}
    x = jax.ShapeDtypeStruct((1, 8, D), jnp.float32)
    alone = cost.flops(jax.jit(layer).trace(x, WEIGHTS["layers"][0]))
    assert rows["layer/0"].flops == rows["layer/1"].flops == alone
    assert rows["unembed"].flops == cost.flops(jax.jit(unembed).trace(x, WEIGHTS["embed"]))
    parts = rows["layer/0/attention"].flops + rows["layer/0/ffn"].flops
    assert parts == rows["layer/0"].flops
    assert summary.totals.vjp_flops > summary.totals.flops


def test_depth_folds_and_variables_name_the_weights():
    s = hx.summary(forward, WEIGHTS, TOKENS, depth=1, variables=True)
    assert [(r.key, r.folded) for r in s.rows] == [
        ("", 0), ("embed", 0), ("layer/0", 4), ("layer/1", 4), ("rms", 0), ("unembed", 0)
    ]  # fmt: skip
    assert s.totals == hx.summary(forward, WEIGHTS, TOKENS).totals
    rows = {r.key: r for r in s.rows}
    assert rows["rms"].variables == ("norm: f32[16]",)
    assert rows["embed"].variables == ("embed: f32[32,16]",)
    assert hx.Summary.from_json(s.to_json()) == s


def test_abstract_weights_and_spec_inputs_give_the_same_summary(summary):
    abstract = jax.eval_shape(lambda: init(jax.random.key(0)))
    assert hx.summary(forward, WEIGHTS, "i32[1,8]") == summary
    assert hx.summary(forward, abstract, jax.ShapeDtypeStruct((1, 8), jnp.int32)) == summary
    assert hx.summary(jax.jit(forward), abstract, "i32[1,8]").totals == summary.totals


def test_scanned_layers_are_one_row_with_the_layer_count():
    def scanned(weights, tokens):
        x = embed(tokens, weights["embed"])

        def body(x, lw):
            return layer(x, lw), None

        x, _ = jax.lax.scan(body, x, weights["layers"])
        return unembed(rms(x, weights["norm"]), weights["embed"])

    w = init(jax.random.key(1), stacked=True)
    s = hx.summary(scanned, w, "i32[1,8]")
    rows = {r.key: r for r in s.rows}
    assert list(rows) == [
        "", "embed", "layer", "layer/attention", "layer/attention/rms", "layer/ffn",
        "layer/ffn/rms", "rms", "unembed",
    ]  # fmt: skip
    assert rows["layer"].trips == rows["layer/ffn/rms"].trips == L
    assert rows["embed"].trips == 1
    assert rows["layer"].params == size(w["layers"])  # every layer's, as for a scanned stack
    assert rows["layer/attention/rms"].params == L * D
    assert s.totals.params == size(w)
    assert s.totals.flops == cost.flops(jax.jit(scanned).trace(w, jnp.zeros((1, 8), jnp.int32)))
    x = jax.ShapeDtypeStruct((1, 8, D), jnp.float32)
    one = jax.tree.map(lambda a: a[0], w["layers"])
    assert rows["layer"].flops == L * cost.flops(jax.jit(layer).trace(x, one))
    assert "layer  x2" in str(s)


def test_weights_are_the_first_argument_holding_several_arrays():
    def predict(x, segment_ids, weights, scale=1.0):
        return rms(x, weights["g"]) @ weights["w"] * scale + segment_ids[..., None]

    w = {"g": jnp.ones(4), "w": jnp.ones((4, 3))}
    s = hx.summary(predict, "f32[2,4]", "f32[2,1]", w)
    assert s.totals.params == 16  # the image-like float input is an input, not a parameter
    assert s.totals.memory.inputs == 4 * (8 + 2)
    quantized = {"q": jnp.ones((4, 3), jnp.int8), "scale": jnp.ones(3)}

    def dequant(x, weights):
        return x @ (weights["q"].astype(jnp.float32) * weights["scale"])

    q = hx.summary(dequant, "f32[2,4]", quantized)
    assert q.totals.params == 3
    assert q.totals.state == (("other arrays", 12, 12),)


def test_errors_name_the_program():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(hx.HookaxError, match=r"calls the module 'model' \(Linear\) from outside"):
        hx.summary(lambda x: model(x), jnp.ones((1, 2)))
    with pytest.raises(hx.HookaxError, match=r"train=False\): forward calls no module"):
        hx.summary(forward, WEIGHTS, TOKENS, train=False)
    with pytest.raises(hx.HookaxError, match="method='encode' applies to a module"):
        hx.summary(forward, WEIGHTS, TOKENS, method="encode")
    with pytest.raises(hx.HookaxError, match="missing a required argument: 'tokens'"):
        hx.summary(forward, WEIGHTS)


def test_cli_summary_of_the_example(capsys):
    assert main(["summary", "--example", "llama_functions", "--depth", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    s = hx.Summary.from_json(out)
    assert [r.key for r in s.rows] == [
        "", "embed", "forward_layer/0", "forward_layer/1", "rms_norm", "unembed"
    ]  # fmt: skip
    weights = llama_functions.init_weights(jax.random.key(0))
    assert s.totals.params == llama_functions.PARAMS == size(weights)
    assert s.rows[2].params == size(weights["layers"][0])
    assert s.totals.shared_params == weights["embed"].size
    assert json.loads(out)["rows"][1]["shared_with"] == ["unembed"]


def test_cli_summary_of_a_factory_returning_a_program(capsys, tmp_path, monkeypatch):
    (tmp_path / "user_programs.py").write_text(
        textwrap.dedent(
            """
            import jax.numpy as jnp

            def mlp(x, w):
                return jnp.tanh(x @ w["a"]) @ w["b"]

            def forward(weights, x):
                return mlp(x, weights)

            def make():
                return forward, {"a": jnp.ones((4, 8)), "b": jnp.ones((8, 2))}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["summary", "user_programs:make", "--input", "f32[3,4]", "--json"]) == 0
    out, err = capsys.readouterr()
    s = hx.Summary.from_json(out)
    assert [(r.key, r.params) for r in s.rows] == [("", 48), ("mlp", 48)]
    assert s.inputs[-1] == "f32[3,4]"
    assert main(["summary", "user_programs:make"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("hookax: error: forward(weights, x) needs its input x: add --input")
    assert main(["gradflow", "user_programs:make", "--input", "f32[3,4]"]) == 2
    out, err = capsys.readouterr()
    assert "is a program without modules (hookax summary takes it)" in err
