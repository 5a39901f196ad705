"""hx.profile: device time per call site, forward and backward, from jax.profiler."""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import hookax as hx
from hookax._diagnostics import xplane
from hookax._diagnostics.scopes import Place, SiteLog, place
from tests import models

W = 128  # wide enough that the matrix products, not the gaps between operations, fill a step


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(W, W, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(W, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.head(x)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(W, W, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.lin(x))


class Stack(models.Stack):
    """3 blocks stacked and run with ``nnx.scan``, then a head."""

    def __init__(self, n: int = 3) -> None:
        super().__init__(Block, n, W, 4)


def loss(model: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(model(x) ** 2)


X = jnp.ones((64, W))


def own(row: hx.ProfileRow) -> float:
    return row.forward_ms + row.backward_ms


def check_adds_up(p: hx.Profile) -> None:
    """Own times + other + idle = step; operations fill at least 80% of the step."""
    total = sum(own(r) for r in p.rows) + p.other_ms + p.idle_ms
    assert total == pytest.approx(p.step_ms, rel=1e-9)
    assert sum(own(r) for r in p.rows) + p.other_ms >= 0.8 * p.step_ms
    # the root's total is every call site's own time
    assert p.rows[0].total_ms == pytest.approx(sum(own(r) for r in p.rows), rel=1e-9)


@pytest.mark.parametrize("jit", ["jax.jit", "nnx.jit"])
def test_rows_are_the_call_sites_and_add_up_to_the_step(jit: str) -> None:
    model = Net(nnx.Rngs(0))
    grad = lambda m, x: nnx.grad(loss)(m, x)  # noqa: E731
    step = jax.jit(grad) if jit == "jax.jit" else nnx.jit(grad)
    p = hx.profile(step, model, X, runs=3, warmup=1)
    assert [(r.key, r.type, r.depth) for r in p.rows] == [
        ("", "Net", 0),
        ("layers/0", "Linear", 1),
        ("layers/1", "Linear", 1),
        ("head", "Linear", 1),
    ]
    for r in p.rows[1:]:  # a matrix product forward, two backward
        assert r.forward_ms > 0 and r.backward_ms > 0, r
        assert r.total_ms == pytest.approx(own(r))
    assert 2 <= p.runs <= 3
    check_adds_up(p)


def test_a_train_step_that_updates_in_place_is_timed_whole_and_changes_nothing() -> None:
    import optax

    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def train(model: Net, opt: nnx.Optimizer, x: jax.Array) -> jax.Array:
        value, grads = nnx.value_and_grad(loss)(model, x)
        opt.update(model, grads)
        return value  # the updates are not outputs: XLA must not drop the backward pass

    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    p = hx.profile(train, model, opt, X, runs=3, warmup=1)
    assert all(p[k].backward_ms > 0 for k in ("layers/0", "layers/1", "head"))
    assert p.other_forward_ms > 0  # the loss and the optimizer's update
    after = nnx.state(model, nnx.Param)
    assert all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )
    check_adds_up(p)


def test_a_scanned_stack_gives_a_row_per_layer() -> None:
    model = Stack(3)
    p = hx.profile(jax.jit(lambda m, x: nnx.grad(loss)(m, x)), model, X, runs=3, warmup=1)
    assert [(r.key, r.site, r.layer, r.depth) for r in p.rows] == [
        ("", "", None, 0),
        ("blocks[0]", "blocks", 0, 1),
        ("blocks/lin[0]", "blocks/lin", 0, 2),
        ("blocks[1]", "blocks", 1, 1),
        ("blocks/lin[1]", "blocks/lin", 1, 2),
        ("blocks[2]", "blocks", 2, 1),
        ("blocks/lin[2]", "blocks/lin", 2, 2),
        ("head", "head", None, 1),
    ]
    for k in range(3):
        lin = p[f"blocks/lin[{k}]"]
        assert lin.forward_ms > 0 and lin.backward_ms > 0
        assert p[f"blocks[{k}]"].total_ms >= lin.total_ms
    assert not any("told apart" in note for note in p.notes)
    check_adds_up(p)
    text = str(p)
    assert "blocks[1]" in text and "  lin[1]" in text


class Looped(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(W, W, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(self.lin(h)), x)


def test_a_loop_inside_scanned_layers_gives_one_row_per_call_site_and_says_so() -> None:
    class LoopStack(nnx.Module):
        def __init__(self) -> None:
            make = nnx.vmap(lambda key: Looped(nnx.Rngs(key)), in_axes=0, out_axes=0)
            self.blocks = make(jax.random.split(jax.random.key(0), 3))

        def __call__(self, x: jax.Array) -> jax.Array:
            scan = nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            return scan(x, self.blocks)

    p = hx.profile(jax.jit(lambda m, x: nnx.grad(loss)(m, x)), LoopStack(), X, runs=3)
    assert [r.key for r in p.rows] == ["", "blocks", "blocks/lin"]
    assert all(r.layer is None for r in p.rows)
    assert p["blocks/lin"].forward_ms > 0 and p["blocks/lin"].backward_ms > 0
    assert "'blocks': a scanned stack with a loop inside its layers" in p.notes[-1]
    assert p.notes[-1] in str(p)
    check_adds_up(p)


def test_equinox() -> None:
    model = eqx.nn.MLP(W, 4, W, 2, key=jax.random.key(0))

    def eqx_loss(m: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(jax.vmap(m)(x) ** 2)

    step = eqx.filter_jit(lambda m, x: eqx.filter_grad(eqx_loss)(m, x))
    p = hx.profile(step, model, X, runs=3, warmup=1)
    assert [r.key for r in p.rows] == ["", "layers/0", "layers/1", "layers/2"]
    assert all(r.forward_ms > 0 and r.backward_ms > 0 for r in p.rows[1:])
    check_adds_up(p)


def test_the_table() -> None:
    p = hx.profile(jax.jit(lambda m, x: nnx.grad(loss)(m, x)), Net(nnx.Rngs(0)), X, runs=1)
    text = p.grid().text(200)
    lines = text.splitlines()
    assert "Forward" in lines[1] and "Backward" in lines[1] and "Share" in lines[1]
    assert any(line.startswith("│   layers/0") for line in lines)
    for name in ("(model)", "(other)", "(idle)", "step", "100.0%"):
        assert name in text
    assert "mean of 1 run on cpu" in text
    assert "<table" in p._repr_html_() and "(idle)" in p._repr_html_()
    assert repr(p).startswith("<hx.Profile: 4 call sites, step ")
    assert len(p) == 4 and [r.key for r in p] == ["", "layers/0", "layers/1", "head"]
    with pytest.raises(KeyError, match="no row 'nope'; its rows include '', 'layers/0'"):
        p["nope"]
    import json

    assert json.loads(p.to_json())["rows"][1]["key"] == "layers/0"


def test_bad_input_raises_clearly() -> None:
    model = Net(nnx.Rngs(0))
    with pytest.raises(hx.HookaxError, match=r"function to run.*ArrayImpl: pass the function"):
        hx.profile(model(X), model, X)  # type: ignore[arg-type]
    # a function without modules is a program: its root is a call site to time
    assert [r.key for r in hx.profile(lambda x: x * 2, X).rows][:1] == [""]
    with pytest.raises(hx.HookaxError, match="runs= takes an integer of at least 1, got 0"):
        hx.profile(jax.jit(lambda m, x: m(x)), model, X, runs=0)
    with pytest.raises(hx.HookaxError, match="warmup= takes an integer of at least 0"):
        hx.profile(jax.jit(lambda m, x: m(x)), model, X, warmup=-1)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            with pytest.raises(hx.HookaxError, match="Another profiler trace is running"):
                hx.profile(jax.jit(lambda m, x: m(x)), model, X, runs=1)
        finally:
            jax.profiler.stop_trace()


# -- the parts, on hand-made inputs --------------------------------------------------------------


@dataclasses.dataclass
class Event:
    name: str
    start_ns: float
    duration_ns: float
    stats: list[tuple[str, Any]]


@dataclasses.dataclass
class Line:
    events: list[Event]


@dataclasses.dataclass
class Plane:
    name: str
    lines: list[Line]


@dataclasses.dataclass
class Data:
    planes: list[Plane]


def op(name: str, start: float, end: float, run: int | None = 1, module: str = "jit_f") -> Event:
    stats = [("hlo_op", name), ("hlo_module", module)]
    if run is not None:
        stats.append(("run_id", run))
    return Event(name, start, end - start, stats)


def test_time_is_shared_nested_and_concurrent_events_counted_once() -> None:
    thread1 = Line(
        [
            op("while.1", 0, 20),  # a loop's event holds its body's events
            op("body_op", 5, 10),
            op("gap_after", 30, 40),
            Event("ThunkExecutor::Execute", 0, 40, []),  # no hlo_op: not an operation
            op("other_module", 0, 40, module="jit_g"),
        ]
    )
    thread2 = Line([op("parallel", 15, 25)])  # runs beside the loop's end
    runs = xplane.read_runs(Data([Plane("/host:CPU", [thread1, thread2])]), "jit_f", 1)
    assert len(runs) == 1
    got = {e.op: e.ns for e in runs[0].events}
    # [0,5) loop; [5,10) body; [10,15) loop; [15,20) loop and parallel share; [20,25) parallel
    assert got == {"while.1": 12.5, "body_op": 5.0, "parallel": 7.5, "gap_after": 10.0}
    assert runs[0].span_ns == 40 and runs[0].idle_ns == 5  # [25, 30)
    assert sum(got.values()) + runs[0].idle_ns == runs[0].span_ns


def test_runs_occurrences_and_device_planes() -> None:
    host = Plane("/host:CPU", [Line([op("launch", 0, 100)])])
    device = Plane(
        "/device:GPU:0",
        [Line([op("body", 0, 1, run=7), op("body", 2, 4, run=7), op("body", 50, 51, run=8)])],
    )
    runs = xplane.read_runs(Data([host, device]), "jit_f", 2)  # the host's launch: not device
    assert [[(e.op, e.occurrence, e.count, e.ns) for e in r.events] for r in runs] == [
        [("body", 0, 2, 1.0), ("body", 1, 2, 2.0)],
        [("body", 0, 1, 1.0)],
    ]
    assert [(r.span_ns, r.idle_ns) for r in runs] == [(4, 1), (1, 0)]


def test_runs_without_ids_are_cut_at_the_longest_gaps() -> None:
    events = [("a", 0, 2), ("b", 3, 5), ("a", 20, 22), ("b", 22, 23), ("a", 24, 26), ("b", 60, 61)]
    line = Line([op(name, start, end, run=None) for name, start, end in events])
    runs = xplane.read_runs(Data([Plane("/device:GPU:0", [line])]), "jit_f", 3)
    assert [[(e.op, e.occurrence, e.count) for e in r.events] for r in runs] == [
        [("a", 0, 1), ("b", 0, 1)],
        [("a", 0, 2), ("b", 0, 1), ("a", 1, 2)],
        [("b", 0, 1)],
    ]
    assert [(r.span_ns, r.idle_ns) for r in runs] == [(5, 1), (6, 1), (1, 0)]


def test_op_names_of_fusions_and_merged_names() -> None:
    text = """HloModule jit_step, is_scheduled=true
%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %exp.1 = f32[2]{0} exponential(%p), metadata={op_name="jit(step)/Net/lin/exp"}
}
ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0), metadata={op_name="x"}
  %a = f32[2]{0} add(%x, %x), metadata={op_name="jit(f)/jvp()/mul;jit(f)/jvp()/add" source_line=3}
  ROOT %loop_fusion = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused
}"""
    module, names = xplane.op_names(text)
    assert module == "jit_step"
    assert names == {
        "exp.1": "jit(step)/Net/lin/exp",
        "x": "x",
        "a": "jit(f)/jvp()/mul",
        "loop_fusion": "jit(step)/Net/lin/exp",
    }


class Ctx:
    def __init__(self, key: str) -> None:
        self.key, self.module, self.method = key, None, "__call__"


def test_op_names_to_call_sites() -> None:
    log = SiteLog()
    log.add(("Seq",), Ctx(""), False)
    log.add(("Seq", "layers/0"), Ctx("layers/0"), False)
    log.add(("Seq", "layers/0", "attn"), Ctx("layers/0/attn"), False)
    log.add(("Seq", "blocks"), Ctx("blocks"), True)
    log.add(("Seq", "blocks", "mlp"), Ctx("blocks/mlp"), True)
    cases = {
        "jit(step)/jvp(Seq)/layers/0/attn/jit(softmax)/exp": (("Seq", "layers/0", "attn"), 0),
        # a transform wraps a whole label, slashes and all
        "jit(step)/transpose(jvp(Seq))/transpose(jvp(layers/0))/dot_general": (
            ("Seq", "layers/0"),
            1,
        ),
        "jit(step)/jvp(Seq)/layers/0/my_scope/add": (("Seq", "layers/0"), 0),
        "jit(step)/jvp()/reduce_sum": ((), 0),
        "x": ((), 0),
    }
    for name, (chain, backward) in cases.items():
        assert place(name, log) == Place(chain, bool(backward), None), name
    scan = "jit(step)/transpose(jvp(Seq))/while/body/closed_call/blocks/mlp/dot_general"
    assert place(scan, log) == Place(("Seq", "blocks", "mlp"), True, 1)
    # a loop inside the scanned layers: its iterations and the layers are not told apart
    inner = "jit(step)/jvp(Seq)/while/body/blocks/mlp/while/body/add"
    assert place(inner, log) == Place(("Seq", "blocks", "mlp"), False, 1, nested=True)
    # a loop of the root's own (not a scan over layers: in_scan False) is not a stack
    own_loop = "jit(step)/jvp(Seq)/while/body/layers/0/add"
    assert place(own_loop, log) == Place(("Seq", "layers/0"), False, None)


# -- hookax profile ------------------------------------------------------------------------------


def _run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    from hookax._cli.main import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_the_table_of_an_example(capsys: Any) -> None:
    code, out, err = _run(capsys, "profile", "--example", "mlp", "--runs", "2")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert "Forward" in lines[1] and "Backward" in lines[1]
    for key in ("(model)", "layers/0", "layers/1", "layers/2", "(other)", "(idle)", "step"):
        assert any(key in line for line in lines), key
    assert "mean of " in out


def test_cli_json_forward_only_of_a_factory(capsys: Any, tmp_path: Any, monkeypatch: Any) -> None:
    import json

    (tmp_path / "prof_models.py").write_text(
        "from flax import nnx\n\n"
        "def make():\n"
        "    return nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.relu)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["profile", "prof_models:make", "--input", "f32[4,8]", "--forward", "--format", "json"]
    code, out, err = _run(capsys, *argv)
    assert (code, err) == (0, "")
    rows = json.loads(out)["rows"]
    assert [r["key"] for r in rows] == ["", "layers/0"]
    assert rows[1]["forward_ms"] > 0 and rows[1]["backward_ms"] == 0


def test_cli_profiles_a_linen_factory(capsys: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """A Linen model: its variables, initialised for the inputs, are the step's argument."""
    import json

    (tmp_path / "prof_linen.py").write_text(
        "import flax.linen as nn\n\n"
        "class Two(nn.Module):\n"
        "    @nn.compact\n"
        "    def __call__(self, x):\n"
        "        return nn.Dense(4, name='out')(nn.tanh(nn.Dense(8, name='hidden')(x)))\n\n"
        "def make():\n"
        "    return Two()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = _run(
        capsys, "profile", "prof_linen:make", "--input", "f32[4,8]", "--format", "json"
    )
    assert (code, err) == (0, "")
    rows = {r["key"]: r for r in json.loads(out)["rows"]}
    assert set(rows) == {"", "hidden", "out"}
    assert rows["hidden"]["forward_ms"] > 0 and rows["hidden"]["backward_ms"] > 0


def test_cli_errors_name_the_flags(capsys: Any) -> None:
    code, out, err = _run(capsys, "profile", "--example", "mlp", "--runs", "0")
    assert (code, out) == (2, "")
    assert err == "hookax: error: --runs takes a number of at least 1, got 0\n"


def test_linen_parameters_as_the_argument() -> None:
    import flax.linen as nn

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(4, name="out")(jnp.tanh(nn.Dense(W, name="hidden")(x)))

    model = Two()
    params = model.init(jax.random.key(0), X)

    def linen_loss(p: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(model.apply(p, x) ** 2)

    p = hx.profile(jax.jit(jax.grad(linen_loss)), params, X, runs=3, warmup=1)
    assert [(r.key, r.type) for r in p.rows] == [("", "Two"), ("hidden", "Dense"), ("out", "Dense")]
    assert all(r.forward_ms > 0 and r.backward_ms > 0 for r in p.rows[1:])
    check_adds_up(p)


def test_a_batch_sharded_over_devices() -> None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(jax.devices()[:4], ("batch",))
    x = jax.device_put(X, NamedSharding(mesh, PartitionSpec("batch")))
    p = hx.profile(jax.jit(lambda m, x: nnx.grad(loss)(m, x)), Net(nnx.Rngs(0)), x, runs=3)
    assert [r.key for r in p.rows] == ["", "layers/0", "layers/1", "head"]
    assert all(r.forward_ms > 0 and r.backward_ms > 0 for r in p.rows[1:])
    # the devices run at once: each moment is shared among them, so the rows add up to the step
    total = sum(own(r) for r in p.rows) + p.other_ms + p.idle_ms
    assert total == pytest.approx(p.step_ms, rel=1e-9)


def test_an_unrolled_scan_gives_one_row_per_call_site_and_says_so() -> None:
    """With unroll=2, XLA runs two copies of the body, each for two of the four layers: the
    occurrences of an operation are no layer index, so the layers are one row, with a note."""

    class Unrolled(nnx.Module):
        def __init__(self) -> None:
            make = nnx.vmap(lambda key: Block(nnx.Rngs(key)), in_axes=0, out_axes=0)
            self.blocks = make(jax.random.split(jax.random.key(0), 4))

        def __call__(self, x: jax.Array) -> jax.Array:
            def body(x, block):
                return block(x)

            scan = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, unroll=2)
            return scan(x, self.blocks)

    p = hx.profile(jax.jit(lambda m, x: nnx.grad(loss)(m, x)), Unrolled(), X, runs=3)
    assert [r.key for r in p.rows] == ["", "blocks", "blocks/lin"]
    assert all(r.layer is None for r in p.rows)
    assert "'blocks': a scanned stack in a scan with unroll > 1" in p.notes[-1]
    check_adds_up(p)
