"""Labelled results: ``hx.patch_grid``, ``hx.attribution_patch``, ``hx.patch_block_every`` /
``hx.patch_head_every`` and ``hx.logit_lens`` return an ``hx.LabelledArray`` that names its rows
and columns, knows the metric of the unpatched runs, draws itself (HTML heatmap, a table at 80
columns, a matplotlib figure), and is still the array it holds everywhere an array was used.
"""

from __future__ import annotations

import io
import pickle
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._patching import picture
from hookax._patching.grid import Plan
from hookax._util.extras import MissingExtraError

from . import gpt_models as g
from .test_patching import CLEAN, CORRUPT, L, NModel, T, metric

SITES = ("layers/0", "layers/1", "layers/2")
POSITIONS = tuple(str(p) for p in range(T))


@pytest.fixture(scope="module")
def model() -> NModel:
    return NModel()


@pytest.fixture(scope="module")
def grid(model: NModel) -> hx.LabelledArray:
    return hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers/*")


def raw(model: NModel) -> np.ndarray:
    """The grid as the array patch_grid computes (its plan, unlabelled)."""
    plan = Plan("t", model, (CLEAN,), (CORRUPT,), metric, "layers/*", "each", 1)
    return np.asarray(plan.grid(None))


def test_grid_labels_are_the_call_sites_and_positions(model: NModel, grid: Any) -> None:
    assert isinstance(grid, hx.LabelledArray) and isinstance(grid, jax.Array)
    assert grid.axes == ("target", "position")
    assert grid.rows == SITES and grid.columns == POSITIONS
    assert grid.labels == (SITES, POSITIONS)
    picked = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers/*", positions=[1, 3])
    assert picked.columns == ("1", "3")
    masks = jnp.eye(T, dtype=bool)[:2]
    assert hx.patch_grid(
        model, (CLEAN,), (CORRUPT,), metric, where="layers/1", positions=masks
    ).labels == (("layers/1",), ("#0", "#1"))
    whole = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers/*", positions=None)
    assert (whole.axes, whole.labels, whole.columns) == (("target",), (SITES,), None)
    heads = hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where="layers/0", heads=2)
    assert heads.axes == ("target", "head", "position")
    assert heads.labels == (("layers/0",), ("H0", "H1", "H2", "H3"), POSITIONS)


def test_values_are_the_unlabelled_grid(model: NModel, grid: Any) -> None:
    want = raw(model)
    np.testing.assert_array_equal(np.asarray(grid), want)
    np.testing.assert_array_equal(np.asarray(grid.values), want)
    assert type(grid.values) is type(jnp.zeros(1))
    assert (grid.shape, grid.dtype, grid.ndim, grid.size, len(grid)) == (
        (L, T),
        want.dtype,
        2,
        15,
        L,
    )
    np.testing.assert_allclose(grid, want)  # numpy's testing helpers take it as it is
    assert float(grid[1, 2]) == float(want[1, 2])


def test_arithmetic_and_jnp_functions_give_plain_arrays(grid: Any) -> None:
    v = grid.values
    m = 0.5
    cases = {
        "grid - m": (grid - m, v - m),
        "m - grid": (m - grid, m - v),
        "numpy scalar - grid": (np.float32(m) - grid, m - v),
        "grid * grid": (grid * grid, v * v),
        "grid / 2": (grid / 2, v / 2),
        "-grid": (-grid, -v),
        "abs(grid)": (abs(grid), jnp.abs(v)),
        "grid ** 2": (grid**2, v**2),
        "grid @ ones": (grid @ jnp.ones(T), v @ jnp.ones(T)),
        "grid > m": (grid > m, v > m),
        "grid == grid": (grid == grid, v == v),
        "index": (grid[1:, ::2], v[1:, ::2]),
        "jnp.abs": (jnp.abs(grid), jnp.abs(v)),
        "jnp.argmax": (jnp.argmax(grid), jnp.argmax(v)),
        "jnp.max axis": (jnp.max(grid, axis=1), jnp.max(v, axis=1)),
        "jnp.where": (jnp.where(grid > m, grid, 0), jnp.where(v > m, v, 0)),
        "jnp.stack": (jnp.stack([grid, grid]), jnp.stack([v, v])),
        "jnp.allclose": (jnp.allclose(grid, v), jnp.array(True)),
        "reshape": (grid.reshape(-1), v.reshape(-1)),
        "T": (grid.T, v.T),
        "sum": (grid.sum(axis=0), v.sum(axis=0)),
        "astype": (grid.astype(jnp.int32), v.astype(jnp.int32)),
        "at": (grid.at[0, 0].set(9.0), v.at[0, 0].set(9.0)),
        "vmap": (jax.vmap(jnp.argmax)(grid), jnp.argmax(v, axis=1)),
    }
    for name, (got, want) in cases.items():
        assert not isinstance(got, hx.LabelledArray), name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    assert np.asarray(grid + np.ones(T, np.float32)).tolist() == np.asarray(v + 1).tolist()
    assert grid.tolist() == v.tolist()


def test_jnp_functions_on_each_new_grid_compile_nothing_new(model: NModel) -> None:
    """A grid's labels and metric runs are static data of its pytree, new for each grid; JAX's
    own functions are given its array, so a new grid is not a new program for them."""
    from .test_new_data import compiles

    first, second = (
        hx.patch_grid(model, (CLEAN + i,), (CORRUPT,), metric, where="layers/*") for i in (1, 2)
    )

    def post(g: Any) -> list[Any]:
        return [jnp.swapaxes(g, 0, 1), jnp.abs(g), jnp.max(g, axis=1), jnp.where(g > 0, g, 0)]

    post(first)
    with compiles() as names:
        got = post(second)
    assert names == []
    for a, b in zip(got, post(second.values), strict=True):
        assert not isinstance(a, hx.LabelledArray)
        np.testing.assert_array_equal(a, b)


def test_under_jit_labels_are_static(model: NModel, grid: Any) -> None:
    @jax.jit
    def inside(model: Any, clean: Any, corrupt: Any) -> Any:
        return hx.patch_grid(model, (clean,), (corrupt,), metric, where="layers/*")

    got = inside(model, CLEAN, CORRUPT)
    assert isinstance(got, hx.LabelledArray) and got.labels == (SITES, POSITIONS)
    np.testing.assert_allclose(got, grid, atol=1e-6)
    assert got.clean is None and got.corrupted is None  # traced inside: not known

    through = jax.jit(lambda x: x)(grid)
    assert isinstance(through, hx.LabelledArray) and through.labels == grid.labels
    assert through.clean == grid.clean and through.corrupted == grid.corrupted
    scaled = jax.jit(lambda x: 2 * x - jnp.abs(x))(grid)
    np.testing.assert_allclose(scaled, 2 * grid.values - jnp.abs(grid.values), atol=1e-6)
    kept = jax.block_until_ready(jax.device_put(grid))
    assert kept.labels == grid.labels and kept.clean == grid.clean
    assert jax.typeof(grid) == jax.typeof(grid.values)  # what Flax NNX's transforms ask
    np.testing.assert_allclose(nnx.jit(lambda x: x * 2)(grid), 2 * grid.values)


def test_clean_and_corrupted_are_the_unpatched_metric_read_when_asked(
    model: NModel, traces: Any
) -> None:
    def counted(y: jax.Array) -> jax.Array:
        traces()
        return metric(y)

    forwards = []

    class Counted(nnx.Module):
        def __init__(self, inner: NModel) -> None:
            self.inner = inner

        def __call__(self, x: jax.Array) -> jax.Array:
            forwards.append(x)
            return self.inner(x)

    fresh = hx.patch_grid(Counted(model), (CLEAN,), (CORRUPT,), counted, where="inner/layers/*")
    assert traces.n == L  # the grid alone: nothing more
    assert fresh.clean == pytest.approx(float(metric(model(CLEAN))), abs=1e-6)
    assert fresh.corrupted == pytest.approx(float(metric(model(CORRUPT))), abs=1e-6)
    n = traces.n
    assert fresh.clean is not None and traces.n == n  # read once, kept
    assert len(forwards) == 1  # the model traced once: to find the targets, reused since


def fits_80(result: Any, monkeypatch: Any) -> list[str]:
    """``hx.show(result)``'s table at 80 columns, its lines each checked to fit."""
    monkeypatch.setenv("COLUMNS", "80")
    lines = str(hx.show(result)).splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    return lines


def test_attribution_is_labelled_as_changes(model: NModel, grid: Any, monkeypatch: Any) -> None:
    est = hx.attribution_patch(model, (CLEAN,), (CORRUPT,), metric, where="layers/*")
    assert est.labels == grid.labels and est.delta and not grid.delta
    assert est.clean == pytest.approx(grid.clean) and est.corrupted == pytest.approx(grid.corrupted)
    span = est.clean - est.corrupted
    np.testing.assert_allclose(est.normalized(), np.asarray(est) / span, rtol=1e-6)
    lines = fits_80(est, monkeypatch)
    assert lines[0].startswith("estimated change of the metric: clean ")
    assert lines[1].split() == ["target", "\\", "position", *POSITIONS]
    assert [line.split()[0] for line in lines[2:]] == list(SITES)


def test_a_change_of_the_metric_is_coloured_on_the_change_from_corrupted_to_clean() -> None:
    """Estimates (changes of the metric) diverge around 0 and reach the whole change, clean
    minus corrupted, not the clean metric itself."""
    est = hx.LabelledArray(
        jnp.array([[0.0, 1.0, 2.0]]),
        ("target", "position"),
        (("layers/0",), ("0", "1", "2")),
        clean=10.0,
        corrupted=6.0,
        delta=True,
    )
    assert picture.scale(est, picture.matrix(est)[2]) == (-4.0, 4.0)
    grid = est.replace(jnp.array([[6.0, 7.0, 12.0]]), delta=False)
    assert picture.scale(grid, picture.matrix(grid)[2]) == (0.0, 12.0)  # around 6, to 12
    page = est._repr_html_()
    colours = re.findall(r"background:(#\w+)", page)
    assert colours == ["#f7f7f7", "#c2d3e4", "#8caed2"]  # 0, a quarter and a half of blue


def test_normalized_is_the_hand_formula(grid: Any) -> None:
    clean, corrupted = grid.clean, grid.corrupted
    want = (np.asarray(grid) - corrupted) / (clean - corrupted)
    got = grid.normalized()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert (got.labels, got.clean, got.corrupted) == (grid.labels, 1.0, 0.0)
    assert float(got[-1, -1]) == pytest.approx(1.0)  # the last block at the last position: all
    lens = hx.logit_lens(lambda h: h.sum(-1), {"layers/0": (jnp.ones((1, 2)),)})
    with pytest.raises(hx.HookaxError, match="clean and corrupted values are unknown"):
        lens.normalized()


def test_block_and_head_sweeps_are_labelled(monkeypatch: Any) -> None:
    m = g.make("mha")
    c = hx.Components(attn=f"{m.blocks}/attn", mlp=f"{m.blocks}/mlp", blocks=m.blocks)

    def answer(logits: jax.Array) -> jax.Array:
        return logits[:, -1, 2].sum()

    args = (m.fn, m.args(g.TOKENS), m.args(g.CORRUPT), answer)
    every = hx.patch_block_every(*args, c, positions=None)
    assert every.axes == ("component", "layer")
    assert every.labels == (("resid_pre", "attn_out", "mlp_out"), ("L0", "L1"))
    assert every.clean == pytest.approx(float(answer(g.hand(g.TOKENS)["logits"])), abs=1e-5)
    heads = hx.patch_head_every(
        *args, hx.transformer_names(m.blocks, attention="nnx"), which=("q",), positions=None
    )
    assert heads.axes == ("kind", "layer", "head")
    assert heads.labels == (("q",), ("L0", "L1"), ("H0", "H1"))
    assert heads.corrupted == pytest.approx(float(answer(g.hand(g.CORRUPT)["logits"])), abs=1e-5)
    lines = fits_80(every, monkeypatch)
    assert lines[0].startswith("patched metric: clean ")
    assert lines[1].split() == ["component", "\\", "layer", "L0", "L1"]
    assert [line.split()[0] for line in lines[2:]] == ["resid_pre", "attn_out", "mlp_out"]
    lines = fits_80(heads, monkeypatch)
    assert lines[1].split() == ["kind", "layer", "\\", "head", "H0", "H1"]
    assert [line.split()[:2] for line in lines[2:]] == [["q", "L0"], ["q", "L1"]]


def test_logit_lens_rows_are_the_layers(monkeypatch: Any) -> None:
    h = jnp.arange(6.0).reshape(3, 1, 2)
    acts = {f"layers/{i}": (h[i],) for i in range(3)}
    lens = hx.logit_lens(lambda x: x.sum(-1), acts)
    assert lens.rows == SITES and lens.axes == ("layer",) and lens.clean is None
    np.testing.assert_array_equal(lens, [[1.0], [5.0], [9.0]])
    assert hx.logit_lens(lambda x: x, {"blocks": (h,)}, "blocks").rows == (
        "blocks[0]",
        "blocks[1]",
        "blocks[2]",
    )
    assert hx.logit_lens(lambda x: x, {"mlp": (h[0], h[1])}, "mlp").rows == ("mlp#0", "mlp#1")
    # a vocabulary's worth of columns and long call-site keys: cut to 80 columns
    keys = [f"model/decoder/layers/{i}/self_attention" for i in range(3)]
    acts = {k: (jnp.ones((1, 4, 50)),) for k in keys}
    wide = hx.logit_lens(lambda x: x[0, -1], acts, "model/decoder/layers/*/self_attention")
    lines = fits_80(wide, monkeypatch)
    assert lines[0] == "readout"
    assert lines[1].split()[:3] == ["layer", "0", "1"] and lines[1].split()[-2:] == ["…", "49"]
    assert [line.split()[0] for line in lines[2:5]] == ["…" + k[-25:] for k in keys]
    assert lines[5] == "… 50 columns in all"


def test_repr_html_is_a_labelled_heatmap_centred_on_the_corrupted_run(grid: Any) -> None:
    page = grid._repr_html_()
    for label in (*SITES, *POSITIONS, "target \\ position"):
        assert f">{label}<" in page
    tips = re.findall(r'title="([^"]*)"', page)
    assert len(tips) == L * T and tips[0].startswith("layers/0 × 0: ")
    assert "(normalised " in tips[0]
    assert f"clean {grid.clean:.4g}, corrupted {grid.corrupted:.4g}" in page
    # position 0 comes before the corrupted token: the corrupted run's metric, the scale's centre
    first = re.search(r'<td title="layers/0 × 0: [^"]*" style="[^"]*background:(#\w+)', page)
    assert first is not None and first.group(1) == "#f7f7f7"
    assert f">{picture.formatter(np.asarray(grid))(float(grid[0, 0]))}<" in page  # its values


def test_show_prints_a_table_within_80_columns(grid: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert hx.show(grid) is grid
    text = str(hx.show(grid))
    lines = text.splitlines()
    assert lines[0].startswith("patched metric: clean ")
    assert lines[1].split() == ["target", "\\", "position", *POSITIONS]
    assert [line.split()[0] for line in lines[2:]] == list(SITES)
    wide = hx.LabelledArray(
        jnp.linspace(-1, 1, 6 * 64).reshape(6, 64),
        ("target", "position"),
        ([f"model/decoder/layers/{i}/self_attention/out" for i in range(6)], range(64)),
        corrupted=0.0,
        clean=1.0,
    )
    for table in (str(wide), str(hx.show(wide))):
        assert all(len(line) <= 80 for line in table.splitlines()), table
        assert "… 64 columns in all" in table and " 63" in table.splitlines()[1]
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=80, force_terminal=True, color_system="truecolor").print(wide)
    coloured = buf.getvalue()
    assert "\x1b[" in coloured  # each cell on its colour
    plain = re.sub(r"\x1b\[[0-9;]*m", "", coloured)
    assert all(len(line) <= 80 for line in plain.splitlines())


def test_table_numbers_share_their_decimals() -> None:
    fmt = picture.formatter(np.array([15.0, -6.31]))
    assert [fmt(v) for v in (15.0, -6.31, -1e-9, float("nan"))] == ["15.0", "-6.3", "0.0", "nan"]
    assert picture.formatter(np.array([0.186]))(0.18571) == "0.186"
    assert picture.formatter(np.array([2e6]))(2e6) == "2.00e+06"


def test_plot_is_a_labelled_figure(grid: Any, tmp_path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = grid.plot(out=tmp_path / "grid.png")
    assert isinstance(fig, Figure) and (tmp_path / "grid.png").stat().st_size > 0
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == list(SITES)
    assert [t.get_text() for t in ax.get_xticklabels()] == list(POSITIONS)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("position", "target")
    image = ax.get_images()[0]
    lo, hi = image.get_clim()
    assert (lo + hi) / 2 == pytest.approx(grid.corrupted)  # centred on the corrupted run
    np.testing.assert_allclose(image.get_array(), np.asarray(grid, np.float64))
    normed = grid.plot(normalize=True).axes[0].get_images()[0]
    want = (np.asarray(grid, np.float64) - grid.corrupted) / (grid.clean - grid.corrupted)
    np.testing.assert_allclose(normed.get_array(), want, rtol=1e-6)
    assert sum(normed.get_clim()) == pytest.approx(0.0)
    # a logit lens: its layers (by the readout's leading axes) as rows, a sequential scale
    acts = {f"layers/{i}": (jnp.full((1, 2), float(i)),) for i in range(3)}
    lens_ax = hx.logit_lens(lambda x: x, acts).plot().axes[0]
    assert (lens_ax.get_ylabel(), lens_ax.get_xlabel()) == ("layer", "")
    assert [t.get_text() for t in lens_ax.get_yticklabels()] == [f"{s} 0" for s in SITES]
    assert lens_ax.get_images()[0].get_clim() == (0.0, 2.0)


def test_plot_fits_its_title_and_colour_bar_and_shows_in_a_notebook() -> None:
    """Two columns under a long title, three rows beside a long colour bar label: both inside
    the figure; the figure is an image to IPython (``_repr_png_``) without pyplot."""
    import matplotlib

    matplotlib.use("Agg")
    narrow = hx.LabelledArray(
        jnp.array([[0.0, 1.0], [0.5, 0.2], [0.3, 0.1]]),
        ("layer", "head"),
        (("L0", "L1", "L2"), ("H0", "H1")),
        clean=1.25,
        corrupted=0.125,
        delta=True,
        title="estimated change of the metric",
    )
    fig = narrow.plot()
    fig.canvas.draw()
    ax, bar = fig.axes
    assert ax.get_title() == "estimated change of the metric: clean 1.25, corrupted 0.125"
    assert bar.get_ylabel() == "estimated change of the metric"
    for text in (ax.title, bar.yaxis.label):
        box = text.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (text.get_text(), box)
        assert box.y0 >= 0 and box.y1 <= fig.bbox.height, (text.get_text(), box)
    assert fig._repr_png_().startswith(b"\x89PNG\r\n\x1a\n")


def test_plot_without_matplotlib_names_the_extra(grid: Any, monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"hookax\[plot\]|\[plot\]"):
        grid.plot()


def test_pickled_grids_keep_their_labels_and_metric(grid: Any) -> None:
    back = pickle.loads(pickle.dumps(grid))
    assert (back.labels, back.clean, back.corrupted) == (grid.labels, grid.clean, grid.corrupted)
    np.testing.assert_array_equal(back, grid)
