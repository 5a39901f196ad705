"""Packaging: the public namespace, dependency ranges, and errors that name the missing extra."""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib
import types

import pytest

import hookax as hx
from hookax._cli import main as _cli
from hookax._diagnostics import gradflow as _gradflow
from hookax._util.extras import MissingExtraError, install_command, require

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_public_names_are_the_api():
    public = {
        name
        for name in dir(hx)
        if not name.startswith("_") and not isinstance(getattr(hx, name), types.ModuleType)
    }
    assert public == set(hx.__all__)
    for leaked in ("version", "PackageNotFoundError", "metadata"):
        assert not hasattr(hx, leaked)
    assert {"layer_grad_norms", "plot_grad_flow", "summary", "capture"} <= public
    assert hx.layer_grad_norms is _gradflow.layer_grad_norms


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()


def test_library_dependencies_are_ranges_with_rich_in_core():
    project = _project()
    core = project["dependencies"]
    assert {_name(r) for r in core} == {"jax", "rich"}
    extras = project["optional-dependencies"]
    names = ("nnx", "linen", "equinox", "haiku", "plot", "harvest", "tensorboard", "data")
    library = core + [r for e in names for r in extras[e]]
    for req in library:
        assert ">=" in req and "==" not in req and "<" not in req, req


def _version(text: str) -> tuple[int, ...]:
    parts = [int(p) for p in text.strip().split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_oldest_constraints_pin_the_lower_bounds():
    project = _project()
    extras = project["optional-dependencies"]
    reqs = project["dependencies"]
    names = ("nnx", "equinox", "haiku", "plot", "harvest", "tensorboard", "data")
    reqs += [r for e in names for r in extras[e]]
    lower = {_name(r): _version(r.split(">=")[1]) for r in reqs}
    lines = (ROOT / "constraints-oldest.txt").read_text().splitlines()
    pins = dict(ln.split("==") for ln in lines if "==" in ln and not ln.startswith("#"))
    assert {n: _version(v) for n, v in pins.items() if n != "jaxlib"} == lower
    assert pins["jaxlib"] == pins["jax"]


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError) as info:
        require("matplotlib", "plot", "hx.plot_grad_norms")
    assert isinstance(info.value, ModuleNotFoundError) and info.value.name == "matplotlib"
    assert str(info.value).endswith(f"Install it with: {install_command('plot')}")


@pytest.mark.parametrize(
    ("origin", "command"),
    [
        (
            {"url": "file:///src/hookax", "dir_info": {"editable": True}},
            'pip install -e "/src/hookax[plot]"',
        ),
        ({"url": "file:///src/hookax", "dir_info": {}}, 'pip install "/src/hookax[plot]"'),
        (
            {"url": "file:///d/hookax-0.1.0-py3-none-any.whl", "archive_info": {}},
            'pip install "/d/hookax-0.1.0-py3-none-any.whl[plot]"',
        ),
        ({"url": "file:///my%20dir/hookax", "dir_info": {}}, 'pip install "/my dir/hookax[plot]"'),
        (
            {"url": "https://example.org/hookax.whl", "archive_info": {}},
            'pip install "hookax[plot]"',
        ),
        ({}, 'pip install "hookax[plot]"'),
    ],
)
def test_install_command_is_the_one_that_works_for_this_installation(origin, command):
    assert install_command("plot", origin) == command


def test_install_command_of_this_checkout_installs_from_it():
    """The test suite runs on hookax installed from a checkout: the command names its folder."""
    command = install_command("nnx")
    if command != 'pip install "hookax[nnx]"':  # installed from a folder or a wheel file
        path = command.split('"')[1].removesuffix("[nnx]")
        assert pathlib.Path(path).exists(), command


def test_require_does_not_blame_a_broken_install(monkeypatch, tmp_path):
    (tmp_path / "half_installed_pkg.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        require("half_installed_pkg", "plot", "a feature")
    assert not isinstance(info.value, MissingExtraError)
    assert info.value.name == "no_such_dependency_xyz"


def test_plot_grad_flow_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    flow = hx.GradFlow(outputs={"layers/0": 1.0}, params={})
    with pytest.raises(MissingExtraError, match=r'hx.plot_grad_flow .*\[plot\]"'):
        hx.plot_grad_flow(flow, str(tmp_path / "g.png"))
    assert not (tmp_path / "g.png").exists()


def test_cli_gradflow_without_matplotlib_fails_before_computing(monkeypatch, capsys, tmp_path):
    def must_not_run(*args, **kwargs):
        raise AssertionError("gradients computed although the chart cannot be drawn")

    monkeypatch.setattr(_gradflow, "layer_grad_norms", must_not_run)
    monkeypatch.setattr(_gradflow, "grad_flow", must_not_run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "g.png"
    assert _cli.main(["gradflow", "--example", "mlp", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    assert captured.err == (
        "hookax: error: hookax gradflow (it draws a chart) needs the Python package "
        f"'matplotlib', which is not installed. Install it with: {install_command('plot')}\n"
    )


@pytest.mark.parametrize("command", ["summary", "gradflow"])
def test_cli_without_flax_names_the_nnx_extra(monkeypatch, capsys, command):
    monkeypatch.setitem(sys.modules, "flax", None)
    assert _cli.main([command, "--example", "mlp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"hookax {command} --example (the examples are Flax NNX) needs the Python package" in err
    assert err.endswith(f"Install it with: {install_command('nnx')}\n")


def test_every_public_name_is_in_the_api_reference():
    api = "".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))
    missing = [name for name in hx.__all__ if f"::: hookax.{name}\n" not in api]
    assert missing == [], f"add `::: hookax.NAME` to its page in docs/reference/ for {missing}"
