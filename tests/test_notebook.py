"""hookax in a Jupyter notebook, a newcomer's first hour: a notebook built here runs in a real
kernel (nbclient) and its saved outputs are checked: HTML tables for the summary, the operations,
a capture and the gradient flow (its figure inline), the figure of ``hx.plot_grad_flow`` as an
image, ``str()`` of a summary as its text inside the kernel, one-line reprs, the heatmaps of a
patching grid, an attribution, a sweep and a logit lens, with their tables at 80 columns, and a
grid's ``plot()`` as an image. One kernel runs the whole notebook once (``make test-slow``);
nbformat, nbclient and ipykernel are in the ``dev`` extra."""

from __future__ import annotations

import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.slow  # a kernel that imports JAX and Flax: 15 to 40 s on 2 cores

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
    "gpt": """
import jax.numpy as jnp

class Block(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(d, 4 * d, rngs=rngs), jax.nn.gelu,
                                  nnx.Linear(4 * d, d, rngs=rngs))
    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.mlp(self.ln2(x))

class GPT(nnx.Module):
    def __init__(self, vocab=20, seq=6, d=16, heads=2, depth=2, *, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos_embed = nnx.Embed(seq, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(depth)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.unembed = nnx.Linear(d, vocab, rngs=rngs)
    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))

gpt = GPT(rngs=nnx.Rngs(0))
clean = jnp.array([[3, 1, 4, 1, 5, 9]])
corrupt = jnp.array([[3, 2, 4, 1, 5, 9]])
def metric(logits):
    return logits[0, -1, 7] - logits[0, -1, 2]
""",
    "grid": """
grid = hx.patch_grid(gpt, (clean,), (corrupt,), metric, where=["embed", "blocks/*"])
grid
""",
    "attribution": """
estimate = hx.attribution_patch(gpt, (clean,), (corrupt,), metric, where=["embed", "blocks/*"])
estimate
""",
    "sweep": """
parts = hx.Components(attn="blocks/*/attn", mlp="blocks/*/mlp", blocks="blocks/*")
sweep = hx.patch_block_every(gpt, (clean,), (corrupt,), metric, parts, positions=None)
sweep
""",
    "lens": """
@nnx.jit
def lens_of(model, tokens):  # the probability of token 7 after each block, by position
    _, acts = hx.capture(model, where="blocks/*")(tokens)
    readout = lambda h: jax.nn.softmax(model.unembed(model.ln_f(h)))[0, :, 7]
    return hx.logit_lens(readout, acts, where="blocks/*")
lens = lens_of(gpt, clean)
lens
""",
    "tables": """
for result in (grid, estimate, sweep, lens):
    print(hx.show(result), end="\\n\\n")
""",
    "plot": "grid.plot()",
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


HEATMAPS = {  # cell: (heading, corner, row labels, column labels)
    "grid": (
        "patched metric: clean ",
        "target \\ position",
        ["embed", "blocks/0", "blocks/1"],
        ["0", "1", "2", "3", "4", "5"],
    ),
    "attribution": (
        "estimated change of the metric: clean ",
        "target \\ position",
        ["embed", "blocks/0", "blocks/1"],
        ["0", "1", "2", "3", "4", "5"],
    ),
    "sweep": (
        "patched metric: clean ",
        "component \\ layer",
        ["resid_pre", "attn_out", "mlp_out"],
        ["L0", "L1"],
    ),
    "lens": ("readout", "layer", ["blocks/0", "blocks/1"], ["0", "1", "2", "3", "4", "5"]),
}
CELL = re.compile(r'<td title="([^"]*)" style="background:(#[0-9a-f]{6});color:#[0-9a-f]{6}">')


@pytest.mark.parametrize("cell", list(HEATMAPS))
def test_patching_results_display_as_labelled_heatmaps(executed, cell):
    heading, corner, rows, cols = HEATMAPS[cell]
    page = _data(executed[cell])["text/html"]
    assert page.startswith('<div class="hookax">') and '<table class="hookax-heatmap"' in page
    assert f'<div style="font-weight:bold;font-size:12px;margin-bottom:2px">{heading}' in page
    head = "".join(f'<th style="text-align:right">{c}</th>' for c in cols)
    assert f'<thead><tr><th style="text-align:left">{corner}</th>{head}</tr></thead>' in page
    body = page.split("<tbody>")[1]
    assert re.findall(r'<tr><th style="text-align:left;[^"]*">([^<]*)</th>', body) == rows
    cells = CELL.findall(body)  # every value a cell on its colour, row by row
    assert [tip.split(":")[0] for tip, _ in cells] == [f"{r} × {c}" for r in rows for c in cols]
    colours = {c for _, c in cells}
    assert "#2166ac" in colours and len(colours) > 3  # the top of the scale, and shades
    # a patch that changes nothing sits at the centre (the lens: its smallest value at the foot)
    assert ("#f7f7f7" in colours) == (cell != "sweep")  # every sweep's patch changes the metric


def test_patching_results_print_as_tables_within_80_columns(executed):
    tables = _stdout(executed["tables"]).split("\n\n")
    assert tables[-1] == "" and len(tables) == 5
    for (cell, (heading, corner, rows, cols)), table in zip(HEATMAPS.items(), tables):
        lines = table.splitlines()
        assert all(len(line) <= 80 for line in lines), table
        assert lines[0].startswith(heading)
        assert lines[1].split() == [*corner.split(), *cols]
        assert [line.split()[0] for line in lines[2:]] == rows
        shown = _data(executed[cell])["text/plain"]  # the cell's text: the same table
        assert shown == table


def test_a_results_plot_is_an_image(executed):
    figure = _data(executed["plot"])
    assert figure["image/png"].startswith("iVBORw0KGgo")  # not only "<Figure size ...>"
    assert figure["text/plain"].startswith("<Figure size ")
