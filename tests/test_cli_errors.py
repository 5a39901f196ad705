"""The command line's errors: a model's own exception is the model's (its call site and line),
never an input mismatch; an input that does not fit is one; errors say the command's flags,
not Python's arguments. Run in-process through ``main``, stderr captured."""

from __future__ import annotations

import json
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


# ---- errors in the words of the command line's flags ---------------------------------------


def harvest_argv(out, *extra: str) -> list[str]:
    return [
        "harvest",
        "--example",
        "mlp",
        "--batches",
        "1",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


def no_python_words(msg: str) -> None:
    for python in ("overwrite=", "store=", "where=", "row_axes", "method=", "hx.", "dtype="):
        assert python not in msg, msg


def test_out_and_overwrite(capsys, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "x.txt").write_text("hi")
    msg = error(capsys, *harvest_argv(mine, "--overwrite"))
    assert msg == (
        f"--out {str(mine)!r} is a folder that is not a hookax store (it holds 1 entry: "
        "'x.txt'); hookax writes only into a new folder, an empty one, or a store of its own, "
        "and --overwrite replaces only those. Nothing was written or deleted. Fix: give a new "
        f"--out PATH (for example {str(mine / 'acts.zarr')!r})."
    )
    s = tmp_path / "s"
    assert main(harvest_argv(s, "--where", "layers/0")) == 0
    capsys.readouterr()
    msg = error(capsys, *harvest_argv(s, "--where", "layers/1"))
    assert msg.startswith(f"--out {str(s)!r} holds another harvest than this run would write: ")
    assert msg.endswith(
        "Nothing was written. Fix: give another --out PATH, or --overwrite to replace it (a "
        "store is resumed only by the same command: the same model, --where, --dtype, --input, "
        "--kw, --eval, --seed and --tokens)."
    )
    no_python_words(msg)


@pytest.mark.parametrize("command", ["ops", "gradflow", "harvest"])  # summary has no --where
def test_where(capsys, tmp_path, command):
    argv = [command, "--example", "mlp", *_extra(command, tmp_path)]
    msg = error(capsys, *argv, "--where", "nope/*")
    assert msg == (
        "--where 'nope/*' matched no call site; those that ran include 'layers/2', 'layers/1', "
        "'layers/0', ''. Fix: pass a --where that matches one of them."
    )
    msg = error(capsys, *argv, "--where", "[[")
    assert msg.startswith("--where '[[': malformed path glob '[[': ")
    no_python_words(msg)


def test_summary_where_is_not_a_flag(capsys):
    assert main(["summary", "--example", "mlp", "--where", "x"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: hookax summary ")
    last = err.splitlines()[-1]
    assert last.startswith("hookax: error: unrecognized arguments: --where; --where is a flag of")
    assert last.endswith("not of hookax summary (see: hookax summary --help)")


def test_row_axes(capsys, tmp_path):
    assert error(capsys, *harvest_argv(tmp_path / "a", "--row-axes", "0")) == (
        "--row-axes takes an integer >= 1, got 0"
    )
    msg = error(capsys, *harvest_argv(tmp_path / "a", "--row-axes", "3"))
    assert msg == (
        "call site output '' has shape (8, 10), whose leading 3 axes are not the batch's rows "
        "(8, 10) (--row-axes 3, from the first output). Every stored value must lead with the "
        "same row axes. Fix: select only call sites whose outputs lead with the batch axes "
        "(--where ...), or set --row-axes to match."
    )
    assert not (tmp_path / "a").exists()


def test_method_lists_the_public_methods(capsys, models):
    argv = ["summary", "user_boom:two_methods", "--input", "f32[2,4]"]
    for method in ("nope", "_private"):
        assert error(capsys, *argv, "--method", method) == (
            f"--method {method!r}: TwoMethods has no public method {method!r}; its methods: "
            "__call__, decode, encode"
        )
    assert main([*argv, "--method", "encode", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["method"], out["rows"][0]["key"]) == ("encode", ":encode")


@pytest.mark.parametrize("command", COMMANDS)
def test_kw(capsys, tmp_path, models, command):
    argv = [command, "user_boom:two_methods", "--input", "f32[2,4]", *_extra(command, tmp_path)]
    assert error(capsys, *argv, "--kw", "scale=2") == (
        "--kw scale: TwoMethods.__call__(x) has no argument 'scale'; its keyword arguments: x"
    )
    assert error(capsys, *argv, "--kw", "x=f32[2,4]") == (
        "--kw x: x is given by an --input already"
    )
    assert error(capsys, *argv, "--input", "f32[2,4]") == (
        "TwoMethods.__call__(x) takes 1 input, got 2 --input"
    )
