"""Tables where people read them, a newcomer's first hour: fitted to the terminal's width
(wrapped inside cells, numbers never cut), ``COLUMNS`` followed, natural width when piped,
colour on a terminal only, plain ``str()`` everywhere, short reprs, HTML for notebooks."""

from __future__ import annotations

import io
import os
import re
import sys

import jax
import pytest
from flax import nnx

import hookax as hx
from hookax._cli.main import main
from hookax._util import display
from hookax._util.display import Grid, Line, fit, pieces, wrap

NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def _numbers(text: str) -> set[str]:
    return {n for line in text.splitlines() for n in NUMBER.findall(line)}


def _cli(capsys, monkeypatch, columns, *argv):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(list(argv)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


@pytest.mark.parametrize("command", ["summary", "ops"])
def test_cli_tables_fit_80_columns_and_keep_every_number(capsys, monkeypatch, command):
    wide = _cli(capsys, monkeypatch, 400, command, "--example", "transformer")
    narrow = _cli(capsys, monkeypatch, 80, command, "--example", "transformer")
    assert max(len(line) for line in wide.splitlines()) > 80  # the test means something
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert "…" not in narrow
    assert _numbers(wide) == _numbers(narrow)
    if command == "summary":  # the totals, written out in full, stay whole
        assert "FLOPs (XLA cost analysis): forward 16,109,248 (16.1M)" in narrow
        assert "\n  embed " in narrow and "\n      gate " in narrow  # a tree of short names
    else:
        assert "  at flax/nnx/nn/linear.py:422 (Linear.__call__)\n" in narrow
        assert "  embed:take (jit) " in narrow  # the whole address, as ops= takes it
        assert not any(os.sep + "hookax" + os.sep in line for line in wide.splitlines()[2:])


def test_piped_output_keeps_its_natural_width(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["summary", "--example", "transformer"]) == 0
    out = capsys.readouterr().out
    model, inputs = _transformer()
    assert out == str(hx.summary(model, *inputs)) + "\n"
    assert out.splitlines()[1].startswith("┏━") and max(map(len, out.splitlines())) > 100


def _transformer():
    from hookax.examples import transformer

    model = nnx.eval_shape(lambda: transformer.make_model(nnx.Rngs(0)))
    return model, transformer.example_inputs()


def test_str_follows_columns(monkeypatch):
    model, inputs = _transformer()
    s = hx.summary(model, *inputs)
    monkeypatch.delenv("COLUMNS", raising=False)
    natural = str(s)
    monkeypatch.setenv("COLUMNS", "80")  # at 79 and below, names stay whole (attn_norm)
    narrow = str(s)
    assert max(map(len, narrow.splitlines())) <= 80 < max(map(len, natural.splitlines()))
    assert _numbers(natural) == _numbers(narrow)
    assert s.__rich__().text(80) == narrow
    assert "\x1b" not in natural + narrow


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_on_a_terminal_only(monkeypatch):
    grid = Grid("t", ("Key", "Count"), [("a", "1")], numeric=frozenset({1}), styles={0: "cyan"})
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "40")
    tty, pipe = _Terminal(), io.StringIO()
    display.echo(grid, tty)
    display.echo(grid, pipe)
    assert "\x1b[" in tty.getvalue()
    assert "\x1b[" not in pipe.getvalue()
    assert pipe.getvalue() == grid.text(40) + "\n"
    monkeypatch.setenv("NO_COLOR", "1")
    plain = _Terminal()
    display.echo(grid, plain)
    assert "\x1b[" not in plain.getvalue()


def test_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "93")
    assert display.terminal_width(io.StringIO()) == 93
    monkeypatch.delenv("COLUMNS")
    assert display.terminal_width(io.StringIO()) is None  # piped: natural width
    monkeypatch.setenv("COLUMNS", "wide")
    assert display.terminal_width(io.StringIO()) is None


def test_pieces_never_split_a_number():
    assert pieces("f32[2,32,172] 1.41M 115,520 layers/10/mlp") == [
        "f32[2,32,172] ",
        "1.41M ",
        "115,520 ",
        "layers/",
        "10/",
        "mlp",
    ]
    assert pieces("a.b, c_d:e") == ["a.b, ", "c_d:", "e"]  # words stay whole
    text = "  inputs 256 B + variables 451.25 KiB + f32[8,224,224,3]"
    assert display.min_width(text) == 2 + 1 + len("f32[8,224,224,3]")
    for width in range(display.min_width(text), 60):
        lines = wrap(text, width)
        assert all(len(line) <= width for line in lines)
        assert _numbers("\n".join(lines)) == {"256", "451.25", "32", "8,224,224,3"}
        assert all(line.startswith("  ") for line in lines)
        assert all(line.startswith("   ") for line in lines[1:])  # continuation: one more


def test_fit_narrows_where_fewest_lines_grow():
    header_then_cells = [["Call site", "a", "b"], ["A long header", "12", "34"]]
    # 9 + 13 do not fit 16: the header of one column wraps (one line) before two cells do
    assert fit(header_then_cells, [1, 6], 16) == [9, 7]
    assert fit([["Key", "layers/0/mlp", "x"], ["Count", "1,234"]], [7, 5], 14) == [9, 5]
    assert fit([["abcdef"], ["ghijkl"]], [4, 4], 2) == [4, 4]  # the minimums: never below


def test_too_narrow_runs_past_the_edge_rather_than_cutting():
    grid = Grid("", ("Name", "Count"), [("x", "1,234,567,890")], numeric=frozenset({1}))
    text = grid.text(8)
    assert "1,234,567,890" in text
    assert max(map(len, text.splitlines())) > 8


def test_boxed_when_it_fits_rules_otherwise():
    grid = Grid("T", ("A", "B"), [("x", "1")], numeric=frozenset({1}))
    grid = Grid("T", ("A", "Count"), [("x", "1")], numeric=frozenset({1}))
    assert grid.text() == "\n".join(
        ["T", "┏━━━┳━━━━━━━┓", "┃ A ┃ Count ┃", "┡━━━╇━━━━━━━┩", "│ x │     1 │", "└───┴───────┘"]
    )
    lines = Grid("T", ("A", "B"), [("x", "1"), Line("span over")]).text()
    assert lines == "T\nA  B\n────\nx  1\nspan over"


def test_html_of_a_grid_escapes_and_spans():
    grid = Grid(
        "f<x>",
        ("Key", "N"),
        [("  a&b", "1,234"), Line("all\nover")],
        numeric=frozenset({1}),
        sections=frozenset({1}),
        footer=("total <1>",),
    )
    out = grid.html()
    assert "<caption" in out and "f&lt;x&gt;" in out
    assert '<td style="text-align:left">&nbsp;&nbsp;a&amp;b</td>' in out
    assert '<td style="text-align:right;white-space:nowrap">1,234</td>' in out
    assert '<td colspan="2" style="text-align:left">all<br>over</td>' in out
    assert '<tr style="border-top:1px solid">' in out
    assert "<p>total &lt;1&gt;</p>" in out


def test_reprs_are_one_short_line():
    model, inputs = _transformer()
    s = hx.summary(model, *inputs)
    assert repr(s) == (
        "<hx.Summary Decoder(i32[2,32]): 28 call sites, 115,520 parameters, 16.1M FLOPs>"
    )
    ops = hx.ops(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((1, 2), "float32"))
    assert [r.name for r in ops] == ["dot_general", "reshape", "add"]
    assert repr(ops) == "<hx.Ops: 3 operations in 1 call site>"


def test_short_source_paths(monkeypatch, tmp_path):
    from hookax._transforms.optrace import _short_path

    pkg = tmp_path / "src"
    path = str(pkg / "mypkg" / "mod.py")
    monkeypatch.setattr(sys, "path", [*sys.path, str(pkg)])
    assert _short_path(path) == os.path.join("mypkg", "mod.py")  # as its package names it
    monkeypatch.chdir(tmp_path)
    assert _short_path(path) == os.path.join("mypkg", "mod.py")  # the deeper folder wins
    other = str(tmp_path / "scripts" / "run.py")
    assert _short_path(other) == os.path.join("scripts", "run.py")  # else from the cwd
    site = os.path.join("/x", "lib", "site-packages", "flax", "nnx", "a.py")
    assert _short_path(site) == os.path.join("flax", "nnx", "a.py")


class ZMQInteractiveShell:  # what rich takes for a Jupyter kernel
    pass


def test_str_is_the_text_inside_a_jupyter_kernel(monkeypatch):
    import builtins

    from rich.console import Console

    monkeypatch.delenv("COLUMNS", raising=False)
    model, inputs = _transformer()
    s = hx.summary(model, *inputs)
    ops = hx.ops(model, *inputs)
    before = str(s), str(ops)
    monkeypatch.setattr(builtins, "get_ipython", ZMQInteractiveShell, raising=False)
    assert Console(file=io.StringIO()).is_jupyter  # rich would send the table elsewhere
    assert (str(s), str(ops)) == before
    assert str(s).startswith("Decoder(i32[2,32])\n┏━") and len(str(ops).splitlines()) > 100


def test_notebook_html_of_summary_and_ops():
    model, inputs = _transformer()
    s = hx.summary(model, *inputs)
    page = s._repr_html_()
    assert page.count("<tr") == 1 + len(s.rows) + 1  # the header, the rows, the total
    assert "<b>Decoder(i32[2,32])</b>" in page and "<td" in page
    assert "<p>Total parameters: 115,520 (451.25 KiB)" in page
    ops = hx.ops(model, *inputs)
    page = ops._repr_html_()
    assert page.count("<tr") == 1 + len(ops.rows)  # the wide table: every address in full
    assert ">layers/0/attn:softmax</td>" in page or ">layers/0/attn:tril</td>" in page


def _flow() -> hx.GradFlow:
    return hx.GradFlow(
        {"layers/0": 0.0123456789, "layers/1": 1234.5678, "act": 0.0},
        {"layers/0": (1.23456e-5, 0.5), "layers/1": (2.0, float("nan"))},
    )


def test_grad_flow_reads_as_a_table(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    flow = _flow()
    assert repr(flow) == (
        "<hx.GradFlow: 3 call sites, 2 with parameters; ‖∂loss/∂output‖₂ 0 to 1235>"
    )
    rows = [line.strip("│ ").split(" │ ") for line in str(flow).splitlines()[4:-1]]
    assert [[c.strip() for c in row] for row in rows] == [
        ["layers/0", "0.01235", "1.235e-05", "0.5"],
        ["layers/1", "1235", "2", "nan"],
        ["act", "0", "-", "-"],
    ]
    assert str(flow).splitlines()[0] == "Gradient flow: 3 call sites, 2 with parameters"


def test_grad_flow_shows_its_figure_in_a_notebook():
    import base64

    import matplotlib.figure

    flow = _flow()
    page = flow._repr_html_()
    assert page.startswith('<img src="data:image/png;base64,')
    data = base64.b64decode(page.split("base64,", 1)[1].split('"', 1)[0])
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert flow.grid().html() in page  # and the table below it
    fig = hx.plot_grad_flow(flow)
    assert isinstance(fig, matplotlib.figure.Figure)  # still a Figure: savefig, axes, ...
    assert fig._repr_png_().startswith(b"\x89PNG")
    assert "matplotlib.pyplot" not in sys.modules or not _in_pyplot(fig)


def test_grad_flow_png_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """The PNG goes to a temporary file hookax makes, renamed into place; an interrupt leaves
    the earlier image; the user's other files (some named like temporaries) stay as they were."""
    flow = _flow()
    users = {
        f"g.png.{os.getpid()}.tmp": b"user data 1",
        ".g.png.abc.tmp": b"user data 2",
        "notes.txt": b"user data 3",
    }
    for name, data in users.items():
        (tmp_path / name).write_bytes(data)
    out = tmp_path / "g.png"
    hx.plot_grad_flow(flow, out)
    whole = out.read_bytes()
    assert whole.startswith(b"\x89PNG") and whole.endswith(b"IEND\xaeB`\x82")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hx.plot_grad_flow(flow, out)
    assert out.read_bytes() == whole  # the earlier image, untouched; no temporary left
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, "g.png"])
    assert {name: (tmp_path / name).read_bytes() for name in users} == users
    buf = io.BytesIO()
    hx.plot_grad_flow(flow, buf)  # a file object is written to directly
    assert buf.getvalue() == whole


def _in_pyplot(fig) -> bool:
    import matplotlib.pyplot as plt

    return any(plt.figure(n) is fig for n in plt.get_fignums())


class Twice(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(self.lin(x))


def test_show_gives_shapes_and_statistics_of_a_capture():
    import jax.numpy as jnp
    import numpy as np

    x = jnp.arange(6.0).reshape(2, 3)
    _, acts = hx.capture(Twice())(x)
    table = hx.show(acts)
    assert [r.name for r in table.rows] == ["(model)", "lin#0", "lin#1"]
    values = [acts[""][0], *acts["lin"]]
    for row, value in zip(table.rows, values, strict=True):
        a = np.asarray(value, np.float64)
        assert (row.shape, row.dtype) == ((2, 3), "float32")
        assert (row.mean, row.std, row.min, row.max) == (a.mean(), a.std(), a.min(), a.max())
    assert repr(table) == "<hx.Values: 3 arrays>"
    assert table._repr_html_().count("<tr") == 1 + 3
    text = str(table)
    assert f"{table.rows[1].mean:.4g}" in text and "f32[2,3]" in text
    # any pytree: rows named by their paths; abstract values have no statistics
    other = hx.show({"a": [jnp.ones(2), jax.ShapeDtypeStruct((4,), jnp.bfloat16)]})
    assert [(r.name, r.shape, r.mean) for r in other.rows] == [
        ("a/0", (2,), 1.0),
        ("a/1", (4,), None),
    ]
