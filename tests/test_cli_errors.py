"""The command line's errors: a model's own exception is the model's (its call site and line),
never an input mismatch; an input that does not fit is one; errors say the command's flags,
not Python's arguments. Run in-process through ``main``, stderr captured."""

from __future__ import annotations

import sys
import textwrap

import pytest

from hookax._cli.main import main

COMMANDS = ["summary", "ops", "gradflow", "harvest"]

MODELS = textwrap.dedent(
    """
    import equinox as eqx
    import flax.linen as nn
    import jax
    from flax import nnx


    class Inner(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            y = self.lin(x)
            if y.shape[-1] == 4:
                raise ValueError("boom")  # nnx
            return y


    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = Inner(rngs)

        def __call__(self, x):
            return self.b(self.a(x))


    class EqxBoom(eqx.Module):
        lin: eqx.nn.Linear

        def __init__(self):
            self.lin = eqx.nn.Linear(4, 4, key=jax.random.key(0))

        def __call__(self, x):
            raise ValueError("boom")  # equinox


    class LinenBoom(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4)(x)
            raise RuntimeError("boom")  # linen


    class Asserts(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            assert x.ndim == 1, "one example at a time"  # assert
            return self.lin(x)


    def nnx_boom():
        return Outer(nnx.Rngs(0))


    def eqx_boom():
        return EqxBoom()


    def linen_boom():
        return LinenBoom()


    def asserts():
        return Asserts(nnx.Rngs(0))


    def eqx_linear():
        return eqx.nn.Linear(4, 4, key=jax.random.key(0))


    class TwoMethods(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return self.lin(x)

        def encode(self, x):
            return self.lin(x)

        def decode(self, x):
            return self.lin(x)

        def _private(self, x):
            return x


    def two_methods():
        return TwoMethods(nnx.Rngs(0))
    """
)


@pytest.fixture
def models(tmp_path, monkeypatch):
    """``user_boom``, a module of models in the current folder, and the line of each marker."""
    (tmp_path / "user_boom.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    lines = {}
    for i, text in enumerate(MODELS.splitlines(), 1):
        if "  # " in text:
            lines[text.rsplit("# ", 1)[1]] = i
    yield lines
    sys.modules.pop("user_boom", None)


def _extra(command: str, tmp_path) -> list[str]:
    if command == "gradflow":
        return ["--out", str(tmp_path / "g.png")]
    if command == "harvest":
        return ["--out", str(tmp_path / "acts"), "--batches", "1", "--no-progress"]
    return []


def error(capsys, *argv: str) -> str:
    """The one line ``hookax ARGV`` prints on stderr, exiting with 2 and printing nothing else."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err.startswith("hookax: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err.removeprefix("hookax: error: ").removesuffix("\n")


# ---- a model's own exception ----------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_a_models_own_exception_is_shown_as_the_models(capsys, tmp_path, models, command):
    extra = _extra(command, tmp_path)
    msg = error(capsys, command, "user_boom:nnx_boom", "--input", "f32[2,4]", *extra)
    assert msg == (
        "model 'user_boom:nnx_boom' raised ValueError: boom (call site 'b' (Inner.__call__), "
        f"at user_boom.py:{models['nnx']} in Inner.__call__); its input was f32[2,4]"
    )
    msg = error(capsys, command, "user_boom:eqx_boom", "--input", "f32[4]", *extra)
    assert msg == (
        "model 'user_boom:eqx_boom' raised ValueError: boom (call site '' (EqxBoom.__call__), "
        f"at user_boom.py:{models['equinox']} in EqxBoom.__call__); its input was f32[4]"
    )
    msg = error(capsys, command, "user_boom:asserts", "--input", "f32[2,4]", *extra)
    assert msg == (
        "model 'user_boom:asserts' raised AssertionError: one example at a time (call site '' "
        f"(Asserts.__call__), at user_boom.py:{models['assert']} in Asserts.__call__); its input "
        "was f32[2,4]"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_linen_models_own_exception_is_shown_as_the_models(capsys, tmp_path, models, command):
    msg = error(
        capsys, command, "user_boom:linen_boom", "--input", "f32[2,4]", *_extra(command, tmp_path)
    )
    assert msg.startswith("model 'user_boom:linen_boom' raised RuntimeError: boom (")
    assert msg.endswith(
        f"at user_boom.py:{models['linen']} in LinenBoom.__call__); its input was f32[2,4]"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_an_input_that_does_not_fit_is_an_input_mismatch(capsys, tmp_path, command):
    extra = _extra(command, tmp_path)
    msg = error(capsys, command, "--example", "mlp", "--input", "f32[8,10]", *extra)
    assert msg.startswith(
        "input f32[8,10] does not fit the model: call site 'layers/0' (Linear.__call__)"
    )
    assert msg.endswith(
        "TypeError: dot_general requires contracting dimensions to have the same shape, "
        "got (10,) and (784,)."
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_an_equinox_input_that_does_not_fit(capsys, tmp_path, models, command):
    extra = _extra(command, tmp_path)
    msg = error(capsys, command, "user_boom:eqx_linear", "--input", "f32[5]", *extra)
    assert msg.startswith("input f32[5] does not fit the model: call site '' (Linear.__call__)")
    assert "TypeError: dot_general requires contracting dimensions" in msg
