"""The hookax command line: summaries, gradflow PNGs, and one-line errors with exit code 2."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hookax as hx
from hookax._cli.main import main


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """An importable module of model factories, as a user would have."""
    (tmp_path / "user_models.py").write_text(
        textwrap.dedent(
            """
            import jax.numpy as jnp
            from flax import nnx

            class Pair(nnx.Module):
                def __init__(self, rngs):
                    self.a = nnx.Linear(64, 32, rngs=rngs)
                    self.b = nnx.Linear(16, 32, rngs=rngs)

                def __call__(self, x, y):
                    return self.a(x) + self.b(y.astype(jnp.float32))

            class Keyed(nnx.Module):
                def __init__(self, rngs):
                    self.lin = nnx.Linear(8, 8, rngs=rngs)
                    self.drop = nnx.Dropout(0.5, rngs=rngs)

                def __call__(self, x, *, cache, rng=None, scale=1, train=True, mask=None):
                    y = self.drop(self.lin(x) * scale, deterministic=not train)
                    return y + cache["k"], cache["v"]

            class Free(nnx.Module):
                def __init__(self):
                    self.act = nnx.Dropout(0.0)

                def __call__(self, x):
                    return self.act(x, deterministic=True) * 2.0

            class Sharded(nnx.Module):
                # It carries its mesh and shards its activations by the mesh in context, as
                # EasyDeL's and MaxText's models do.

                def __init__(self, rngs):
                    import jax
                    import numpy as np

                    self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
                    self.lin = nnx.Linear(64, 32, rngs=rngs)

                def __call__(self, x):
                    import jax

                    spec = jax.sharding.PartitionSpec(None, "x")
                    return jax.lax.with_sharding_constraint(self.lin(x), spec)

            CALLS = []

            def sharded():
                return Sharded(nnx.Rngs(0))

            def linear():
                return nnx.Linear(64, 32, rngs=nnx.Rngs(0))

            def pair():
                return Pair(nnx.Rngs(0))

            def keyed():
                return Keyed(nnx.Rngs(0))

            def free():
                return Free()

            def not_a_model():
                return 3

            def broken():
                CALLS.append("broken")
                raise RuntimeError("no weights here")

            def counted():
                CALLS.append("counted")
                return nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_models"
    sys.modules.pop("user_models", None)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("name", "total"),
    [
        ("mlp", "235,146"),
        ("cnn", "25,578"),
        ("resnet", "78,042"),
        ("transformer", "115,520"),
        ("llama_functions", "115,520"),
    ],
)
def test_summary_of_each_example(capsys, name, total):
    code, out, err = _run(capsys, "summary", "--example", name, "--depth", "1")
    assert (code, err) == (0, "")
    assert f"\nTotal parameters: {total} (" in out


def test_summary_json_and_depth(capsys):
    code, out, _ = _run(capsys, "summary", "--example", "transformer", "--depth", "1", "--json")
    assert code == 0
    s = hx.Summary.from_json(out)
    assert [r.key for r in s.rows] == ["", "embed", "layers/0", "layers/1", "norm", "lm_head"]
    assert (s.totals.params, s.totals.shared_params) == (115_520, 16_384)
    assert json.loads(out)["rows"][1]["shared_with"] == ["lm_head"]


def test_summary_of_a_factory(capsys, factories):
    code, out, err = _run(
        capsys, "summary", f"{factories}:linear", "--input", "f32[8,64]", "--json"
    )
    assert (code, err) == (0, "")
    (row,) = hx.Summary.from_json(out).rows
    assert (row.inputs, row.outputs, row.params, row.flops) == (
        ("f32[8,64]",),
        ("f32[8,32]",),
        2080,
        33_024,
    )


def test_summary_of_a_model_that_carries_its_mesh(capsys, factories):
    """The model runs inside its own ``mesh`` (its code needs one in context), left after the
    command; a sharding annotation costs no FLOPs (XLA counts -1 for each)."""
    import jax.numpy as jnp

    code, out, err = _run(
        capsys, "summary", f"{factories}:sharded", "--input", "f32[8,64]", "--json"
    )
    assert (code, err) == (0, "")
    rows = hx.Summary.from_json(out).rows
    assert [(r.key, r.params, r.flops) for r in rows] == [("", 2080, 33_024), ("lin", 2080, 33_024)]
    model = sys.modules[factories].sharded()
    with pytest.raises(RuntimeError, match="non-empty mesh"):
        model(jnp.ones((8, 64)))  # no mesh in context once the command has ended


def test_summary_of_a_factory_with_two_inputs(capsys, factories):
    argv = ["summary", f"{factories}:pair", "--input", "f32[4,64]", "--input", "bf16[4,16]"]
    code, out, _ = _run(capsys, *argv, "--json")
    assert code == 0
    s = hx.Summary.from_json(out)
    assert [r.key for r in s.rows] == ["", "a", "b"]
    assert s.rows[0].inputs == ("f32[4,64]", "bf16[4,16]")
    assert s.totals.params == 64 * 32 + 32 + 16 * 32 + 32


def _image(path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def test_gradflow_png(capsys, tmp_path):
    out_png = tmp_path / "gradflow.png"
    code, out, err = _run(capsys, "gradflow", "--example", "mlp", "--out", str(out_png))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "d loss / d (layer output), 2-norm:"
    assert [line.split()[0] for line in lines[1:4]] == ["layers/0", "layers/1", "layers/2"]
    assert lines[4] == "d loss / d (parameters), mean and max of |g|:"
    assert lines[-1] == f"wrote {out_png} (3 call sites, 3 with parameters)"
    img = _image(out_png)
    assert img.shape == (840, 600, 4)  # 6 x 8.4 inches at 100 dpi, RGBA: two panels
    rgb = img[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05  # not blank
    assert len(np.unique(np.round(rgb * 255).astype(np.int32), axis=0)) > 16


def test_gradflow_figure_labels_range_and_markers():
    from hookax._diagnostics.gradflow import OUTPUT_LABEL, PARAM_LABEL, GradFlow, plot_grad_flow

    flow = GradFlow(
        {"a": 0.17, "b": 0.49, "c": 0.0, "d": float("nan")},
        {"a": (1e-4, 3e-3), "b": (2e-2, 0.5)},
    )
    fig = plot_grad_flow(flow, title="t")
    top, bottom = fig.axes
    assert top.get_ylabel() == "‖∂loss/∂(layer output)‖₂ (log)" == OUTPUT_LABEL + " (log)"
    assert bottom.get_ylabel() == PARAM_LABEL + " (log)"
    assert bottom.get_xlabel() == "layer (call order)"
    assert top.get_yscale() == bottom.get_yscale() == "log"
    assert top.get_ylim() == (0.1, 1.0)  # whole decades around 0.17 and 0.49: nothing cropped
    assert bottom.get_ylim() == (1e-5, 1.0)
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert labels == ["‖grad‖₂", "‖grad‖₂ = 0", "‖grad‖₂ not finite"]
    assert [t.get_text() for t in bottom.get_legend().get_texts()] == ["mean", "max"]
    # Parameter-free models: one panel.
    assert len(plot_grad_flow(GradFlow({"a": 1.0}, {})).axes) == 1


def test_gradflow_of_a_factory(capsys, tmp_path, factories):
    out_png = tmp_path / "g.png"
    argv = ["gradflow", f"{factories}:pair", "--input", "f32[4,64]", "--input", "f32[4,16]"]
    code, out, err = _run(capsys, *argv, "--out", str(out_png), "--where", "b")
    assert (code, err) == (0, "")
    assert [line.split()[0] for line in out.splitlines()[1:2]] == ["b"]
    assert _image(out_png).shape[2] == 4


def test_gradflow_of_a_parameter_free_model(capsys, tmp_path, factories):
    out_png = tmp_path / "free.png"
    code, out, err = _run(
        capsys, "gradflow", f"{factories}:free", "--input", "f32[2,3]", "--out", str(out_png)
    )
    assert (code, err) == (0, "")
    assert out.splitlines()[1].split()[0] == "act"
    assert out.splitlines()[-1] == f"wrote {out_png} (1 call site, 0 with parameters)"


def test_gradflow_checks_out_before_any_work(capsys, tmp_path, factories):
    missing = tmp_path / "no" / "such" / "dir.png"
    msg = _error(
        capsys, "gradflow", f"{factories}:counted", "--input", "f32[1,4]", "--out", str(missing)
    )
    assert msg == f"cannot write {str(missing)!r}: no such directory"
    assert _error(capsys, "gradflow", "--example", "mlp", "--out", str(tmp_path)) == (
        f"cannot write {str(tmp_path)!r}: is a directory"
    )
    assert factories not in sys.modules  # the factory was not even imported
    msg = _error(
        capsys,
        "gradflow",
        "--example",
        "mlp",
        "--where",
        "layerz/*",
        "--out",
        str(tmp_path / "x.png"),
    )
    assert msg.startswith("--where 'layerz/*' matched no call site; those that ran include ")


def test_gradflow_of_a_scanned_model_has_one_point_per_layer():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hookax._diagnostics.gradflow import grad_flow, mean_square_loss, plot_grad_flow
    from tests.models import Scanned

    model = Scanned()
    x = jax.random.normal(jax.random.key(1), (2, 3), jnp.float32)
    flow = grad_flow(model, x)
    assert list(flow.outputs) == [
        *(k for i in range(4) for k in (f"blocks[{i}]", f"blocks[{i}]/lin")),
        "head",
    ]
    assert list(flow.params) == [*(f"blocks[{i}]/lin" for i in range(4)), "head"]

    # The same gradients, by hand: the scan unrolled, a zero probe added at each output.
    _, state = nnx.split(model.blocks)
    kernel, bias = state["lin"]["kernel"][...], state["lin"]["bias"][...]

    def loss(probes, params):
        k, b, hk, hb = params
        h = x
        for i in range(4):
            lin = h @ k[i] + b[i] + probes["lin"][i]
            h = jnp.tanh(lin) + probes["block"][i]
        return jnp.mean(jnp.square(h @ hk + hb + probes["head"]))

    probes = {"lin": jnp.zeros((4, 2, 3)), "block": jnp.zeros((4, 2, 3)), "head": jnp.zeros((2, 2))}
    params = (kernel, bias, model.head.kernel[...], model.head.bias[...])
    g_probe, g_param = jax.grad(loss, argnums=(0, 1))(probes, params)
    for i in range(4):
        np.testing.assert_allclose(
            flow.outputs[f"blocks[{i}]"], float(jnp.linalg.norm(g_probe["block"][i])), rtol=1e-5
        )
        np.testing.assert_allclose(
            flow.outputs[f"blocks[{i}]/lin"], float(jnp.linalg.norm(g_probe["lin"][i])), rtol=1e-5
        )
        layer = jnp.concatenate([g_param[0][i].ravel(), g_param[1][i].ravel()])
        np.testing.assert_allclose(
            flow.params[f"blocks[{i}]/lin"],
            (float(jnp.abs(layer).mean()), float(jnp.abs(layer).max())),
            rtol=1e-5,
        )
    np.testing.assert_allclose(flow.outputs["head"], float(jnp.linalg.norm(g_probe["head"])))
    assert float(mean_square_loss(model, x)) == pytest.approx(float(loss(probes, params)))
    fig = plot_grad_flow(flow)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[:3] == ["blocks[0]", "blocks[0]/lin", "blocks[1]"]


def test_scanned_layer_labels_interleave_layers():
    import jax.numpy as jnp

    from hookax._diagnostics.gradflow import _NNX, _Layout
    from tests.models import Scanned

    layout = _Layout.of(_NNX, Scanned(), (jnp.ones((2, 3), jnp.float32),), {})
    assert layout.scanned == {"blocks": ("blocks", 4), "blocks/lin": ("blocks", 4)}
    stacked = (jnp.ones((4, 2)),)
    items = [("head", jnp.ones(2)), ("blocks/lin", stacked), ("blocks", stacked)]
    labels = [label for label, _ in layout.labelled(items)]
    assert labels[:3] == ["blocks[0]", "blocks[0]/lin", "blocks[1]"]
    assert labels[-2:] == ["blocks[3]/lin", "head"]


def _error(capsys, *argv):
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line
    assert err.startswith("hookax: error: ")
    return err.removeprefix("hookax: error: ").strip()


@pytest.mark.parametrize("command", ["summary", "gradflow"])
def test_unknown_example_lists_the_valid_ones(capsys, command):
    msg = _error(capsys, command, "--example", "vgg")
    assert msg == (
        "unknown example 'vgg'; choose one of: cnn, mlp, resnet, transformer, llama_functions"
    )


def test_factory_that_does_not_import(capsys):
    msg = _error(capsys, "summary", "no_such_pkg.models:make", "--input", "f32[2]")
    assert (
        msg == "cannot import factory 'no_such_pkg.models:make': "
        "ModuleNotFoundError: No module named 'no_such_pkg'"
    )


def test_factory_errors(capsys, factories):
    assert _error(capsys, "summary", "user_models", "--input", "f32[2]") == (
        "a factory looks like 'package.module:function' or 'path/to/file.py:function', "
        "got 'user_models'"
    )
    assert _error(capsys, "summary", f"{factories}:missing", "--input", "f32[2]") == (
        "cannot import factory 'user_models:missing': user_models has no 'missing'"
    )
    assert _error(capsys, "summary", f"{factories}:not_a_model", "--input", "f32[2]") == (
        "'user_models:not_a_model' returned int, not a Flax NNX, Flax Linen or Equinox module, "
        "a Haiku transform (hk.transform(forward)), nor a function with its arguments (forward, "
        "weights)"
    )
    assert _error(capsys, "summary", f"{factories}:broken", "--input", "f32[2]") == (
        "factory 'user_models:broken' raised RuntimeError: no weights here"
    )
    assert sys.modules[factories].CALLS == ["broken"]  # called once, not retried
    assert _error(capsys, "summary", f"{factories}:linear") == (
        'a factory needs its input: add --input "f32[8,224,224,3]" (or --input '
        "pkg.module:function returning it)"
    )


@pytest.mark.parametrize("spec", ["f32[8,x]", "float[8]", "f32(8,2)", "q8[1]"])
def test_input_spec_that_does_not_parse(capsys, spec):
    msg = _error(capsys, "summary", "--example", "mlp", "--input", spec)
    assert msg.startswith(
        f"cannot parse input spec {spec!r}: expected DTYPE[DIM,...] like f32[8,224,224,3]"
    )


def test_input_that_does_not_fit_names_the_call_site(capsys):
    msg = _error(capsys, "summary", "--example", "mlp", "--input", "f32[8,10]")
    assert msg.startswith(
        "input f32[8,10] does not fit the model: call site 'layers/0' (Linear.__call__) "
        "rejected its input f32[8,10]: TypeError: dot_general requires contracting dimensions"
    )


def test_gradflow_input_that_does_not_fit(capsys, factories):
    msg = _error(
        capsys, "gradflow", f"{factories}:pair", "--input", "f32[4,64]", "--input", "f32[4,3]"
    )
    assert msg.startswith(
        "input f32[4,64], f32[4,3] does not fit the model: "
        "call site 'b' (Linear.__call__) rejected its input f32[4,3]: TypeError"
    )


def test_command_line_mistakes(capsys):
    assert _error(capsys, "summary").startswith("give either a factory")
    assert _error(capsys, "summary", "a:b", "--example", "mlp").startswith("give either a factory")
    assert _error(capsys, "summary", "--example", "mlp", "--depth", "-1") == (
        "--depth takes an integer >= 0, got -1"
    )
    assert "invalid choice: 'frobnicate'" in _error(capsys, "frobnicate")
    assert "--depth: invalid int value: 'two'" in _error(capsys, "summary", "--depth", "two")


def test_python_dash_m_hookax_and_lazy_imports():
    done = subprocess.run(
        [sys.executable, "-m", "hookax", "summary", "--example", "mlp", "--depth", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Total parameters: 235,146" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "hookax", "summary", "--example", "vgg"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    code = (
        "import sys, hookax, hookax._cli.main, hookax.examples; "
        "names = ('flax', 'rich', 'matplotlib', 'equinox', 'haiku'); "
        "print(sorted(m for m in names if m in sys.modules))"
    )
    lazy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert lazy.stdout.strip() == "[]"


def test_a_closed_pipe_exits_quietly(capsys, monkeypatch, tmp_path):
    """`hookax summary ... | head -1`: the reader has gone; no traceback, exit code 0."""

    class ClosedPipe:
        def __init__(self):
            self.fd = os.open(tmp_path / "sink", os.O_WRONLY | os.O_CREAT)

        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return self.fd

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["summary", "--example", "mlp", "--depth", "0"]) == 0
    assert capsys.readouterr().err == ""


def test_layer_grad_norms_are_activation_gradient_norms():
    import jax.numpy as jnp
    from flax import nnx

    from hookax._diagnostics.gradflow import layer_grad_norms, mean_square_loss

    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs))
    x = jnp.arange(6.0).reshape(2, 3)
    norms = layer_grad_norms(model, x, loss_fn=mean_square_loss)
    assert list(norms) == ["layers/0", "layers/1"]
    y = model(x)
    g_out = 2 * y / y.size  # d mean(y**2) / d y
    g_hidden = g_out @ model.layers[1].kernel[...].T
    np.testing.assert_allclose(norms["layers/1"], float(jnp.linalg.norm(g_out)), rtol=1e-5)
    np.testing.assert_allclose(norms["layers/0"], float(jnp.linalg.norm(g_hidden)), rtol=1e-5)


MODELS_PY = """
import equinox as eqx
import flax.linen as nn
import jax
from flax import nnx


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dropout(0.5, deterministic=not train)(x)


def make():
    return nnx.Linear(8, 4, rngs=nnx.Rngs(0))


def linen():
    return LinenNet()


def equinox():
    return eqx.nn.MLP(8, 2, 16, 1, key=jax.random.key(0))


class Pair(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 4, rngs=rngs)
        self.b = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.b(self.a(x))

    def first(self, x):
        return self.a(x)


def pair():
    return Pair(nnx.Rngs(0))
"""


@pytest.fixture
def in_cwd(tmp_path, monkeypatch):
    """A file of factories in the current directory, which is not on sys.path."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "mymodels.py").write_text(MODELS_PY)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder))])
    yield folder
    sys.modules.pop("mymodels", None)


def _summary_json(capsys, *argv):
    code, out, err = _run(capsys, "summary", *argv, "--format", "json")
    assert (code, err) == (0, ""), err
    return hx.Summary.from_json(out)


def test_factories_from_the_current_directory_and_by_file(capsys, in_cwd):
    s = _summary_json(capsys, "mymodels:make", "--input", "f32[2,8]", "--variables")
    assert s.totals.params == 36
    assert s.rows[0].variables == ("bias: Param f32[4]", "kernel: Param f32[8,4]")
    sys.modules.pop("mymodels")
    s = _summary_json(capsys, "./mymodels.py:make", "--input", "f32[2,8]")
    assert s.title == "Linear(f32[2,8])"
    s = _summary_json(capsys, str(in_cwd / "mymodels.py") + ":make", "--input", "f32[2,8]")
    assert s.totals.params == 36
    assert _error(capsys, "summary", "./nope.py:make", "--input", "f32[2]") == (
        "cannot import factory: no file './nope.py'"
    )


def test_linen_and_equinox_factories(capsys, in_cwd):
    s = _summary_json(capsys, "mymodels:linen", "--input", "f32[2,4]")
    assert [r.key for r in s.rows] == ["", "Dense_0", "BatchNorm_0", "Dropout_0"]
    assert s.totals.params == 4 * 8 + 8 + 2 * 8
    assert s.totals.state == (("batch_stats", 16, 64),)
    train = {r.key: r.flops for r in s.rows}
    evals = {
        r.key: r.flops
        for r in _summary_json(capsys, "mymodels:linen", "--input", "f32[2,4]", "--eval").rows
    }
    assert evals["Dropout_0"] == 0 < train["Dropout_0"]
    s = _summary_json(capsys, "mymodels:equinox", "--input", "f32[8]")
    assert s.totals.params == 8 * 16 + 16 + 16 * 2 + 2
    assert s.rows[0].type == "MLP"
    s = _summary_json(capsys, "mymodels:pair", "--input", "f32[3,4]", "--method", "first")
    assert (s.title, [r.key for r in s.rows]) == ("Pair.first(f32[3,4])", [":first", "a"])
    assert _error(capsys, "summary", "mymodels:pair", "--input", "f32[3,4]", "--method", "x") == (
        "--method 'x': Pair has no public method 'x'; its methods: __call__, first"
    )


def test_keyword_arguments(capsys, factories):
    argv = [
        f"{factories}:keyed",
        "--input",
        "f32[2,8]",
        "--kw",
        "cache.k=f32[2,8]",
        "--kw",
        "cache.v=i32[3]",
        "--kw",
        "rng=key(0)",
        "--kw",
        "scale=3",
        "--kw",
        "train=False",
        "--kw",
        "mask=none",
    ]
    s = _summary_json(capsys, *argv)
    assert s.rows[0].inputs == (
        "f32[2,8]",
        "cache/k: f32[2,8]",
        "cache/v: i32[3]",
        "rng: key<fry>[]",
        "scale: 3",
        "train: False",
    )
    assert s.rows[0].outputs == ("0: f32[2,8]", "1: i32[3]")
    assert {r.key: r.flops for r in s.rows}["drop"] == 0  # train=False reached the model
    assert _error(capsys, "summary", f"{factories}:keyed", "--kw", "cache") == (
        "--kw takes NAME=VALUE, got 'cache'"
    )
    assert _error(capsys, "summary", f"{factories}:keyed", "--kw", "x=f32[").startswith(
        "--kw x: cannot parse input spec 'f32['"
    )
    assert _error(capsys, "summary", f"{factories}:keyed", "--kw", "x=hello") == (
        "cannot parse --kw x=hello: expected a spec like f32[1,8], an int, a float, "
        "true/false, none or key(SEED)"
    )
    assert _error(capsys, "summary", f"{factories}:keyed", "--input", "f32[2,8]") == (
        "Keyed.__call__(x, *, cache, rng=None, scale=1, train=True, mask=None) needs cache: add "
        "--kw cache=VALUE"
    )


def test_gradflow_of_equinox_and_linen_factories(capsys, in_cwd):
    code, out, err = _run(
        capsys,
        "gradflow",
        "mymodels:equinox",
        "--input",
        "f32[8]",
        "--out",
        str(in_cwd / "eqx.png"),
    )
    assert (code, err) == (0, "")
    assert [line.split()[0] for line in out.splitlines()[1:3]] == ["layers/0", "layers/1"]
    assert out.splitlines()[-1] == f"wrote {in_cwd / 'eqx.png'} (2 call sites, 2 with parameters)"
    code, out, err = _run(
        capsys,
        "gradflow",
        "mymodels:linen",
        "--input",
        "f32[2,4]",
        "--kw",
        "train=false",
        "--out",
        str(in_cwd / "l.png"),
    )
    assert (code, err) == (0, "")
    assert [line.split()[0] for line in out.splitlines()[1:4]] == [
        "Dense_0",
        "BatchNorm_0",
        "Dropout_0",
    ]
    assert out.splitlines()[-1] == f"wrote {in_cwd / 'l.png'} (3 call sites, 2 with parameters)"
    assert _error(capsys, "gradflow", "mymodels:linen", "--input", "f32[2,4]", "--eval") == (
        "--eval: a Linen model has no mode to switch ('mymodels:linen' is a LinenNet); pass its "
        "own argument instead, e.g. --kw deterministic=true"
    )


def test_formats_version_and_64_bit_warning(capsys, factories):
    code, out, err = _run(
        capsys, "summary", f"{factories}:linear", "--input", "f32[8,64]", "--format", "markdown"
    )
    assert code == 0 and out.splitlines()[0] == "**Linear(f32[8,64])**"
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"hookax {hx.__version__}\n"
    code, out, err = _run(capsys, "summary", f"{factories}:linear", "--input", "f64[8,64]")
    assert code == 0
    assert err == (
        "hookax: warning: input f64[8,64] asks for 64-bit values but JAX runs without x64, "
        "so it is traced as 32-bit; set JAX_ENABLE_X64=1 to keep 64 bits\n"
    )
    assert _error(capsys, "summary", "--example", "mlp", "--format", "yaml").startswith(
        "argument --format: invalid choice: 'yaml'"
    )


def test_ops_lists_addresses_and_rejects_a_where_that_matches_nothing(capsys):
    assert main(["ops", "--example", "transformer", "--where", "layers/0/attn"]) == 0
    out = capsys.readouterr().out
    assert "layers/0/attn:dot_general" in out and "transformer.py" in out
    args = ["ops", "--example", "transformer", "--where", "layers/0/mlp", "--format", "json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["key"] == "layers/0/mlp" for r in rows)
    assert main(["ops", "--example", "transformer", "--where", "layers/9"]) == 2
    assert "matched no call site" in capsys.readouterr().err


def test_grad_flow_of_a_bound_linen_module_equals_hand_gradients():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from hookax._diagnostics.gradflow import grad_flow

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(3)(x)  # Dense_0 (named in creation order)
            return nn.Dense(2)(jnp.tanh(h))

    model, x = Net(), jnp.array([[1.0, -2.0], [0.5, 3.0]])
    variables = model.init(jax.random.key(0), x)
    flow = grad_flow(model.bind(variables), x)
    p = variables["params"]
    w0, b0 = p["Dense_0"]["kernel"], p["Dense_0"]["bias"]
    w1, b1 = p["Dense_1"]["kernel"], p["Dense_1"]["bias"]

    def loss(y0, w0=w0, b0=b0, w1=w1, b1=b1):  # y0: Dense_0's output
        y1 = jnp.tanh(y0) @ w1 + b1
        return jnp.mean(jnp.square(y1))

    y0 = x @ w0 + b0
    y1 = jnp.tanh(y0) @ w1 + b1
    g0 = jax.grad(loss)(y0)
    g1 = 2 * y1 / y1.size  # d mean(y1^2) / d y1
    assert list(flow.outputs) == ["Dense_0", "Dense_1"]
    np.testing.assert_allclose(flow.outputs["Dense_0"], float(jnp.linalg.norm(g0)), rtol=1e-5)
    np.testing.assert_allclose(flow.outputs["Dense_1"], float(jnp.linalg.norm(g1)), rtol=1e-5)
    gw = jax.grad(lambda w1, b1: loss(y0, w1=w1, b1=b1), argnums=(0, 1))(w1, b1)
    flat = jnp.abs(jnp.concatenate([gw[0].ravel(), gw[1].ravel()]))
    np.testing.assert_allclose(flow.params["Dense_1"][0], float(flat.mean()), rtol=1e-5)
    np.testing.assert_allclose(flow.params["Dense_1"][1], float(flat.max()), rtol=1e-5)
    with pytest.raises(hx.HookaxError, match=r"needs its variables\. Fix: bind them"):
        grad_flow(model, x)
