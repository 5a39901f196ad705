"""hookax in a Jupyter notebook, a newcomer's first hour: a notebook built here runs in a real
kernel (nbclient) and its saved outputs are checked: HTML tables for the summary, the operations,
a capture and the gradient flow (its figure inline), the figure of ``hx.plot_grad_flow`` as an
image, ``str()`` of a summary as its text inside the kernel, and one-line reprs. One kernel runs
the whole notebook once (``make test-slow``); nbformat, nbclient and ipykernel are in the
``dev`` extra."""

from __future__ import annotations

import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.slow  # a kernel that imports JAX and Flax: 15 to 25 s on 2 cores

CELLS = {
    "setup": """
import jax
from flax import nnx
import hookax as hx
from hookax.examples import mlp, transformer

decoder = nnx.eval_shape(lambda: transformer.make_model(nnx.Rngs(0)))
tokens = transformer.example_inputs()
net = mlp.make_model(nnx.Rngs(0))
x = jax.random.normal(jax.random.key(0), (8, 784))
""",
    "summary": "s = hx.summary(decoder, *tokens)\ns",
    "str": "lines = str(s).splitlines()\nprint(len(str(s)) > 0, repr(lines[0]), len(lines))",
    "ops": "hx.ops(decoder, *tokens)",
    "capture": "y, acts = hx.capture(net)(x)\nhx.show(acts)",
    "gradflow": "flow = hx.grad_flow(net, x)\nflow",
    "figure": "hx.plot_grad_flow(flow)",
    "reprs": "print(repr(s)); print(repr(flow))",
    "harvest": """
import tempfile
h = hx.harvest(net, [x, x, x], where="layers/0", store=tempfile.mkdtemp() + "/acts")
h
""",
}


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook, run in a fresh kernel, saved and read back: ``{cell name: outputs}``."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(src.strip(), metadata={"name": k}) for k, src in CELLS.items()
    ]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # a notebook has no width
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=False)
    client.execute(env=env)  # the kernel's environment: this one's (the same hookax)
    path = tmp_path_factory.mktemp("nb") / "first_hour.ipynb"
    nbformat.write(nb, str(path))
    saved = nbformat.read(str(path), as_version=4)
    return {c.metadata["name"]: c.outputs for c in saved.cells}


def _data(outputs) -> dict:
    """The MIME bundle of the cell's result (execute_result or display_data)."""
    (result,) = [o for o in outputs if o.output_type in ("execute_result", "display_data")]
    return result.data


def _stdout(outputs) -> str:
    return "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")


def test_summary_and_ops_display_as_html_tables(executed):
    summary = _data(executed["summary"])
    assert summary["text/html"].startswith('<div class="hookax">')
    assert "<b>Decoder(i32[2,32])</b>" in summary["text/html"]
    assert summary["text/plain"].startswith("Decoder(i32[2,32])\n┏━")  # the table as text
    ops = _data(executed["ops"])
    assert "<table" in ops["text/html"] and ">layers/0/attn/q:dot_general</td>" in ops["text/html"]


def test_str_of_a_summary_is_its_text_inside_the_kernel(executed):
    first, rest = _stdout(executed["str"]).split(" ", 1)
    assert first == "True"
    assert rest.startswith("'Decoder(i32[2,32])' ")
    assert int(rest.split()[-1]) > 30  # the whole table, not ''


def test_capture_and_grad_flow_display_as_html(executed):
    values = _data(executed["capture"])["text/html"]
    assert values.count("<tr") == 1 + 4  # the header; the model and its three layers
    assert "f32[8,784]" not in values and "f32[8,256]" in values  # shapes, not numbers
    flow = _data(executed["gradflow"])
    assert flow["text/html"].startswith('<img src="data:image/png;base64,')
    assert "<table" in flow["text/html"]
    assert flow["text/plain"].startswith("Gradient flow: 3 call sites, 3 with parameters")


def test_the_grad_flow_figure_is_an_image(executed):
    figure = _data(executed["figure"])
    assert "image/png" in figure
    assert figure["image/png"].startswith("iVBORw0KGgo")  # base64 of the PNG signature


def test_reprs_are_one_line(executed):
    lines = _stdout(executed["reprs"]).splitlines()
    assert lines[0] == (
        "<hx.Summary Decoder(i32[2,32]): 28 call sites, 115,520 parameters, 16.1M FLOPs>"
    )
    assert lines[1].startswith("<hx.GradFlow: 3 call sites, 3 with parameters; ‖∂loss/∂output‖₂ ")
    assert len(lines) == 2


def test_harvest_shows_progress_and_leaves_its_final_line_in_the_saved_file(executed):
    pytest.importorskip("tensorstore")
    err = "".join(o.text for o in executed["harvest"] if o.output_type == "stream")
    assert "harvest: " + "█" * 20 + " 100% batch 3/3, 24 rows" in err  # the line in place
    final = err.split("\r")[-1]
    assert final.endswith("\n") and final.count("\n") == 1
    assert re.fullmatch(r"harvest: 3 batches, 24 rows, .* MB/s\) -> .+/acts *\n", final), final
    result = _data(executed["harvest"])["text/plain"]
    assert result.startswith("<hx.Harvest '") and "\n" not in result
