"""Errors that name the fix that applies: the call that works, not another API's form."""

from __future__ import annotations

import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import hookax as hx
from hookax._cli.main import main


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(nn.relu(nn.Dense(8, name="hid")(x)))


LINEN = _Linen()
X = jnp.ones((2, 3))


# ---- hx.summary of a function that runs a module ---------------------------------------------


def test_summary_of_linen_apply_is_the_summary_of_the_bound_module():
    variables = LINEN.init(jax.random.key(0), X)
    got = hx.summary(LINEN.apply, variables, X)
    want = hx.summary(LINEN.bind(variables), X)
    assert [(r.key, r.params, r.outputs) for r in got.rows] == [
        (r.key, r.params, r.outputs) for r in want.rows
    ]
    assert [r.key for r in got.rows] == ["", "hid", "out"]


def test_summary_of_a_function_running_a_linen_module_names_the_module_and_the_fix():
    variables = LINEN.init(jax.random.key(0), X)

    def forward(variables, x):
        return LINEN.apply(variables, x)

    with pytest.raises(hx.HookaxError) as info:
        hx.summary(forward, variables, X)
    msg = str(info.value)
    assert "runs the Linen module 'LINEN' (_Linen) through apply" in msg
    assert "hx.summary(LINEN.bind(variables), *inputs)" in msg
    assert "hx.summary(LINEN.apply, variables, *inputs)" in msg
    assert "cache" not in msg


def test_summary_of_a_function_calling_a_module_from_outside_its_arguments_names_it():
    lin = nnx.Linear(3, 4, rngs=nnx.Rngs(0))

    def forward(x):
        return lin(x)

    with pytest.raises(hx.HookaxError, match=r"calls the module 'lin' \(Linear\)") as info:
        hx.summary(forward, X)
    assert "def forward(lin, ...)" in str(info.value)
    assert "hx.summary(forward, lin, *inputs)" in str(info.value)


# ---- hx.logit_lens ---------------------------------------------------------------------------

BLOCKS = {f"blocks/{i}": (jnp.ones((1, 2)),) for i in range(3)} | {"embed": (jnp.ones((1, 2)),)}


def test_logit_lens_with_swapped_arguments_says_the_readout_comes_first():
    with pytest.raises(TypeError, match=r"the readout comes first\. Fix: hx\.logit_lens\(") as info:
        hx.logit_lens(BLOCKS, lambda h: h)
    assert isinstance(info.value, hx.HookaxError)
    assert "Array(" not in str(info.value)  # no dump of the captured values


def test_logit_lens_default_where_names_the_layers_the_keys_hold():
    with pytest.raises(hx.SelectorError) as info:
        hx.logit_lens(lambda h: h, BLOCKS)
    msg = str(info.value)
    assert msg.startswith("hx.logit_lens: where='layers/*' matched no captured key")
    assert "Fix: pass where= naming the layers" in msg
    assert "hx.logit_lens(readout, acts, where='blocks/*') (3 layers)" in msg
    assert "capture" not in msg.split("Fix:")[1]
    assert hx.logit_lens(lambda h: h.sum(-1), BLOCKS, where="blocks/*").shape == (3, 1)


def test_stack_layers_names_the_layers_the_keys_hold():
    with pytest.raises(hx.SelectorError, match=r"hx\.stack_layers\(acts, where='blocks/\*'\)"):
        hx.stack_layers(BLOCKS)


# ---- a layer suffix without a call site --------------------------------------------------------


@pytest.mark.parametrize("where", ["[1]", "[1,3]", "[2:5]", "blocks/[1]"])
def test_a_bare_layer_suffix_says_to_name_the_call_site_first(where):
    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    with pytest.raises(hx.SelectorError) as info:
        hx.capture(model, where=where)(X)
    msg = str(info.value)
    assert "a layer suffix follows the path of a call site inside a scan" in msg
    assert "Fix: name the call site first, e.g. 'blocks[1]'" in msg


# ---- an Equinox model given a batch ------------------------------------------------------------

EQX = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
BATCH = jnp.ones((5, 3))
VMAP_HINT = "an Equinox model takes one example at a time. Fix: map it over the batch, jax.vmap"


def _hooked(x):
    with hx.hooks(forward=lambda module, args, out: None):
        return EQX(x)


@pytest.mark.parametrize(
    "run",
    [lambda x: hx.capture(EQX)(x), lambda x: hx.summary(EQX, x), _hooked],
    ids=["capture", "summary", "hooks"],
)
def test_an_equinox_model_given_a_batch_under_hookax_says_vmap(run):
    with pytest.raises(TypeError) as info:
        run(BATCH)
    notes = "\n".join(info.value.__notes__)
    assert "MLP fits one example, and its input has one more (leading) axis of size 5" in notes
    assert VMAP_HINT in notes


def test_the_vmap_hint_only_where_it_applies():
    with pytest.raises(TypeError) as idle:
        EQX(BATCH)  # hookax idle: the exception as it is
    assert not any("vmap" in n for n in getattr(idle.value, "__notes__", ()))
    with pytest.raises(TypeError) as other:
        hx.capture(EQX)(jnp.ones((5, 4)))  # one example of this does not fit either
    assert not any("vmap" in n for n in other.value.__notes__)
    _, acts = hx.capture(lambda x: jax.vmap(EQX)(x))(BATCH)  # the fix works
    assert acts["layers/0"][0].shape == (5, 8)


# ---- the command line ------------------------------------------------------------------------


def _cli_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err.removeprefix("hookax: error: ").removesuffix("\n")


def test_cli_factory_that_needs_arguments_names_them_and_the_fix(capsys, tmp_path, monkeypatch):
    (tmp_path / "needs_args.py").write_text(
        "from flax import nnx\n\n"
        "def make(width, depth=2, *, seed):\n"
        "    return nnx.Linear(width, width, rngs=nnx.Rngs(seed))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        msg = _cli_error(capsys, "summary", "needs_args:make", "--input", "f32[2,4]")
    finally:
        sys.modules.pop("needs_args", None)
    assert msg.startswith("factory 'needs_args:make' needs width, seed (no default)")
    assert "calls it with no arguments" in msg
    assert "def build(): return make(width=..., seed=...), and pass needs_args:build" in msg


def test_cli_unknown_command_says_did_you_mean(capsys):
    msg = _cli_error(capsys, "sumary", "--example", "mlp")
    assert "invalid choice: 'sumary'" in msg
    assert "did you mean 'summary'?" in msg
    assert "did you mean" not in _cli_error(capsys, "xyzzy")


def test_cli_unknown_choice_says_did_you_mean(capsys):
    msg = _cli_error(capsys, "summary", "--example", "mlp", "--format", "tabel")
    assert "did you mean 'table'?" in msg


# ---- counts ------------------------------------------------------------------------------------


def test_counts_are_singular_for_one(capsys, tmp_path):
    ops = hx.ops(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), X)
    assert repr(ops).endswith(" in 1 call site>")
    assert str(ops).rstrip().endswith("in 1 call site")


# ---- docs ----------------------------------------------------------------------------------------


def test_the_transformer_lens_page_says_what_its_equinox_block_needs():
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "from_transformer_lens.md").read_text()
    equinox = page.split("## Equinox", 1)[1].split("```python", 1)[0]
    assert '".[nnx,equinox]"' in equinox
