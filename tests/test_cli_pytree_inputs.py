"""Command-line inputs that are pytrees: ``--input pkg.module:function`` returns the input, a
Haliax-style NamedArray (an array and its axis names, a registered pytree) as Levanter models
take, or any tree of arrays and ``ShapeDtypeStruct`` s."""

import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from hookax._cli.main import main
from hookax._diagnostics.gradflow import random_inputs

USER = textwrap.dedent(
    """
    import dataclasses

    import equinox as eqx
    import jax
    import jax.numpy as jnp


    @jax.tree_util.register_pytree_node_class
    @dataclasses.dataclass(frozen=True)
    class Named:
        array: jax.Array
        axes: tuple

        @property
        def shape(self):
            return dict(zip(self.axes, self.array.shape))

        def tree_flatten(self):
            return (self.array,), self.axes

        @classmethod
        def tree_unflatten(cls, axes, children):
            return cls(children[0], axes)


    class Lm(eqx.Module):
        embed: jax.Array
        head: eqx.nn.Linear

        def __call__(self, ids):
            x = jnp.tanh(self.embed[ids.array])
            return Named(jax.vmap(jax.vmap(self.head))(x), (*ids.axes, "vocab"))


    def model():
        k1, k2 = jax.random.split(jax.random.key(0))
        return Lm(jax.random.normal(k1, (16, 8)), eqx.nn.Linear(8, 16, key=k2))


    def tokens():
        return Named(jax.ShapeDtypeStruct((2, 5), jnp.int32), ("batch", "position"))


    def broken():
        raise ValueError("no tokenizer here")
    """
)


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "haliax_user.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    yield "haliax_user.py"
    sys.modules.pop("haliax_user", None)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_summary_of_a_model_taking_a_named_array(capsys, user):
    code, out, err = _run(capsys, "summary", f"{user}:model", "--input", f"{user}:tokens")
    assert (code, err) == (0, "")
    assert out.startswith("Lm(i32[batch=2,position=5])")
    assert "f32[batch=2,position=5,vocab=16]" in out  # the output keeps its names
    assert "\nTotal parameters: 272 (" in out  # embed 16x8, head 8x16 + 16


def test_ops_and_json_of_a_model_taking_a_named_array(capsys, user):
    code, out, err = _run(capsys, "ops", f"{user}:model", "--input", f"{user}:tokens")
    assert (code, err) == (0, "")
    assert "head:dot_general" in out and ":tanh" in out
    code, out, err = _run(capsys, "summary", f"{user}:model", "--input", f"{user}:tokens", "--json")
    assert code == 0 and '"inputs": [\n        "i32[batch=2,position=5]"' in out


def test_random_inputs_fill_specs_inside_a_pytree(user):
    from hookax._cli.common import _import

    haliax_user = _import(user)
    assert _import(user) is haliax_user  # the model's and the input's classes are the same

    (named, pair) = random_inputs(
        (haliax_user.tokens(), {"a": jax.ShapeDtypeStruct((3,), jnp.float32), "b": 7}),
        seed=0,
        int_high=16,
    )
    assert type(named) is haliax_user.Named and named.axes == ("batch", "position")
    assert named.array.shape == (2, 5) and named.array.dtype == jnp.int32
    assert int(named.array.min()) >= 0 and int(named.array.max()) < 16
    assert pair["a"].shape == (3,) and pair["b"] == 7
    # a spec alone draws the same values as before: one key per leaf, in order
    (alone,) = random_inputs((jax.ShapeDtypeStruct((3,), jnp.float32),), seed=4)
    assert jnp.array_equal(
        alone, jax.random.normal(jax.random.split(jax.random.key(4), 1)[0], (3,))
    )


def test_bad_input_functions_say_what_is_wrong(capsys, user):
    code, _, err = _run(capsys, "summary", f"{user}:model", "--input", f"{user}:nope")
    assert code == 2
    assert f"cannot import input function '{user}:nope': {user} has no 'nope'" in err
    code, _, err = _run(capsys, "summary", f"{user}:model", "--input", f"{user}:broken")
    assert code == 2
    assert f"--input {user}:broken: it raised ValueError: no tokenizer here" in err
    code, _, err = _run(capsys, "summary", f"{user}:model")
    assert code == 2 and "--input pkg.module:function returning it" in err
