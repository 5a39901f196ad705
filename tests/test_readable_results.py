"""Every hookax result reads as a table or a sentence, printed or in a notebook: training
statistics, the first NaN, ``hx.show`` of any result; a summary printed at any width keeps each
number with its unit and each name whole; ``hookax ops`` shows the addresses ``ops=`` takes."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx
from hookax._cli.main import main
from hookax._util.display import pieces
from hookax.examples import transformer


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(self.lin(x))


class Scanned(nnx.Module):
    """A Linear, then three Blocks stacked and run with nnx.scan."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=3)
        @nnx.vmap
        def make(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.blocks = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return body(self.hidden(x), self.blocks).sum()


@pytest.fixture(scope="module")
def stats() -> hx.Stats:
    model = Scanned(nnx.Rngs(0))
    _, _, stats = hx.value_grad_and_stats(lambda m, x: m(x))(model, jnp.ones((2, 4)))
    return stats


def test_stats_print_as_a_table_of_call_sites_layers_kinds_and_statistics(stats, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = str(stats)
    lines = text.splitlines()
    assert lines[0].split() == ["Key", "Kind", *stats.names]
    keys = [line.split()[0] for line in lines[2:] if not line.startswith(" ")]
    assert keys == [
        "hidden",
        *(f"blocks/lin[{i}]" for i in range(3)),
        *(f"blocks[{i}]" for i in range(3)),
        "(model)",
    ]
    kinds = [line.split()[-len(stats.names) - 1] for line in lines[2:]]
    assert kinds == ["act", "grad"] * 8
    # the cells are the values, to 4 significant digits
    row = lines[2 + 2 * 2 + 1].split()  # blocks/lin[1], grad
    want = np.asarray(stats["blocks/lin"].array)[1, 1]
    assert [float(v) for v in row[1:]] == pytest.approx(want.tolist(), rel=1e-3, abs=1e-6)
    assert max(len(line) for line in lines) <= 80
    assert repr(stats).startswith("Stats(keys=['hidden', 'blocks/lin', 'blocks', ''], ")


def test_stats_in_a_notebook_and_as_plain_dicts(stats):
    page = stats._repr_html_()
    assert page.count("<tr") == 1 + 16 and "blocks/lin[2]" in page and ">grad<" in page
    plain = stats.to_dict()
    assert list(plain) == ["hidden", "blocks/lin", "blocks", ""]
    assert list(plain["hidden"]["act"]) == list(stats.names)
    assert isinstance(plain["hidden"]["grad"]["norm"], float)
    per_layer = plain["blocks/lin"]["act"]["norm"]
    assert isinstance(per_layer, list) and len(per_layer) == 3
    assert all(isinstance(v, float) for v in per_layer)
    one = stats["hidden"]
    assert repr(one).startswith("SiteStats({'act': {'norm': ")
    assert "Array(" not in repr(one) and "dtype" not in repr(one)
    assert str(one).splitlines()[0].split() == ["Key", "Kind", *stats.names]
    assert "<table" in one._repr_html_()


def test_stats_inside_jit_print_without_values():
    seen = []

    def step(m, x):
        _, _, s = hx.value_grad_and_stats(lambda m, x: m(x))(m, x)
        seen.append((str(s), repr(s["hidden"]), s._repr_html_(), s.to_dict()["hidden"]))
        return s

    nnx.jit(step)(Scanned(nnx.Rngs(0)), jnp.ones((2, 4)))
    text, site, page, values = seen[0]
    assert text.startswith("Stats(keys=") and site.startswith("SiteStats(names=")
    assert page is None and isinstance(values["act"]["norm"], jax.core.Tracer)


def test_nonfinite_is_its_sentence_and_a_notebook_table():
    model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), jnp.log)
    found = hx.find_nonfinite(lambda m, x: m(x).sum(), model, -jnp.ones((2, 3)) * 9)
    assert repr(found) == str(found) and str(found).startswith("forward: ")
    page = found._repr_html_()
    assert page.startswith('<div class="hookax"><p>forward: ') and "<table" in page
    assert found.label in page


def test_show_of_any_hookax_result_is_its_table(stats):
    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    x = jnp.ones((4, 2))
    results = [stats, stats["hidden"], hx.summary(model, x), hx.ops(model, x)]
    for result in results:
        assert hx.show(result) is result
        assert "<table" in result._repr_html_() and "\n" in str(result)
    _, acts = hx.capture(model)(x)
    assert isinstance(hx.show(acts), hx.Values)
    assert [r.name for r in hx.show(stats.array).rows] == ["(value)"]  # an array: its row


@pytest.fixture(scope="module")
def summary() -> hx.Summary:
    return hx.summary(transformer.make_model(nnx.Rngs(0)), jnp.zeros((2, 32), jnp.int32))


UNIT = re.compile(r"^\s*(B|KiB|MiB|GiB)\b")


def test_print_of_a_summary_splits_no_number_and_no_name_at_any_width(summary, monkeypatch):
    whole_words = {w for w in re.findall(r"[\w.]+", str(summary)) if "_" in w}
    assert {"lm_head", "attn_norm"} <= whole_words
    for width in range(20, 161, 7):
        monkeypatch.setenv("COLUMNS", str(width))
        lines = str(summary).splitlines()
        for a, b in itertools.pairwise(lines):
            assert not (re.search(r"\d[.,]?$", a) and re.match(r"\s*\d", b)), (width, a, b)
            assert not (re.search(r"\d$", a) and UNIT.match(b)), (width, a, b)
            assert not a.endswith("_"), (width, a, b)
        words = {w for line in lines for w in re.findall(r"[\w.]+", line) if "_" in w}
        assert words <= whole_words, (width, words - whole_words)


def test_pieces_keep_units_names_and_numbers():
    assert pieces("variables 451.25 KiB + gradients 3 MiB") == [
        "variables ",
        "451.25 KiB ",
        "+ ",
        "gradients ",
        "3 MiB",
    ]
    assert pieces("(tied: lm_head) Embed.__call__ f32[2,32]") == [
        "(tied: ",
        "lm_head) ",
        "Embed.__call__ ",
        "f32[2,32]",
    ]
    assert pieces("3 layers, 2 Bs") == ["3 ", "layers, ", "2 ", "Bs"]


def test_hookax_ops_shows_each_operations_whole_address(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["ops", "--example", "transformer"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  embed:take \(jit\) ", out, re.M)
    assert re.search(r"^  layers/0/attn:softmax ", out, re.M) or "layers/0/attn:softmax" in out
    tokens = jnp.zeros((2, 32), jnp.int32)
    addresses = [r.address for r in hx.ops(transformer.make_model(nnx.Rngs(0)), tokens)]
    shown = set(re.findall(r"(\S*:\S+)", out))
    assert set(addresses) <= shown, sorted(set(addresses) - shown)[:5]
