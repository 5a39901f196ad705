"""hx.plot_stats / ``hookax stats-plot``: per-layer lines over the steps, from logged files."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import hookax as hx
from hookax._cli.main import main
from hookax._util.extras import MissingExtraError, install_command

STEPS = [0, 5, 10, 15]


def value(step: int, layer: int) -> float:
    return (layer + 1) * 10.0 ** (-step / 15)


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    """A run of 4 logged steps: a scanned stack of 3 layers, two unrolled layers, the model;
    layer 1's gradient norm is NaN at step 10."""
    with hx.StatsLogger(tmp_path / "run") as logger:
        for step in STEPS:
            grad = np.array([value(step, i) for i in range(3)])
            if step == 10:
                grad[1] = np.nan
            stats = {
                "": {"act": {"norm": np.float32(1.0)}, "grad": {"norm": np.float32(2.0)}},
                "layers/10": {"act": {"norm": np.float32(4.0)}, "grad": {"norm": value(step, 9)}},
                "layers/2": {"act": {"norm": np.float32(3.0)}, "grad": {"norm": value(step, 1)}},
                "blocks/lin": {"act": {"norm": grad * 3}, "grad": {"norm": grad}},
            }
            logger.log(step, stats, loss=1.0 / (step + 1))
    return tmp_path / "run"


def lines(ax: object) -> dict[str, tuple[list[float], list[float]]]:
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.get_lines()  # type: ignore[attr-defined]
        if not line.get_label().startswith("_")
    }


def test_one_line_per_layer_in_layer_order_with_the_logged_values(logdir: Path) -> None:
    fig = hx.plot_stats(logdir, ("grad_norm", "act_norm"))
    grad_ax, act_ax = fig.axes[:2]
    got = lines(grad_ax)
    assert list(got) == [
        "(model)",
        "blocks/lin[0]",
        "blocks/lin[1]",
        "blocks/lin[2]",
        "layers/2",
        "layers/10",
    ]
    for i in range(3):
        steps, values = got[f"blocks/lin[{i}]"]
        assert steps == STEPS
        want = [math.nan if (s, i) == (10, 1) else value(s, i) for s in STEPS]
        np.testing.assert_allclose(values, want, rtol=1e-6)
    assert grad_ax.get_yscale() == "log" and grad_ax.get_ylabel() == "grad_norm (log)"
    # the NaN is marked, not dropped: a red X at step 10
    marks = [line for line in grad_ax.get_lines() if line.get_marker() == "X"]
    assert [list(m.get_xdata()) for m in marks] == [[10]]
    assert lines(act_ax)["layers/2"] == (STEPS, [3.0] * 4)


def test_where_and_png(logdir: Path, tmp_path: Path) -> None:
    out = tmp_path / "stats.png"
    fig = hx.plot_stats(logdir, "grad_norm", where="layers/*", out=out)
    assert list(lines(fig.axes[0])) == ["layers/2", "layers/10"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a notebook shows the figure as its image without pyplot (IPython's _repr_png_)
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_statistic_lists_those_logged(logdir: Path) -> None:
    with pytest.raises(hx.HookaxError, match=r"no statistic 'grad_std'; it has: act_norm, grad_no"):
        hx.plot_stats(logdir, "grad_std")


def test_cli(logdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fig.png"
    code = main(["stats-plot", str(logdir), "--stat", "grad_norm", "--out", str(out)])
    printed, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert printed == f"grad_norm: 6 call sites, steps 0..15 (4)\nwrote {out}\n"
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stat", "median"], "holds no statistic 'median'; it has: act_norm, grad_norm. Fix: "),
        (["--where", "layers/["], "--where 'layers/[': malformed path glob"),
        (["--out", "/no/such/dir/x.png"], "cannot write '/no/such/dir/x.png'"),
    ],
)
def test_cli_errors_are_one_line(
    logdir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code = main(["stats-plot", str(logdir), *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("hookax: error: ") and err.count("\n") == 1
    assert message in err


def test_cli_missing_folder_and_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["stats-plot", str(tmp_path / "nope")]) == 2
    assert "LOGDIR" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["stats-plot", str(tmp_path)]) == 2
    assert install_command("plot") in capsys.readouterr().err
    with pytest.raises(MissingExtraError):
        hx.plot_stats(tmp_path)
