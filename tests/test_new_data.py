"""New data reuses the compiled program: a grid's or an attribution's metric, forward, edit or
hook closing over new arrays (answer tokens, a steering vector, a prompt, a model's weights)
compiles nothing, counted with JAX's compile log; values that cannot be lifted fall back and
are named by ``hx.RecompileWarning``."""

import contextlib
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hookax as hx


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            self.names.append(msg.split()[1])


@contextlib.contextmanager
def compiles():
    """The names of the programs JAX compiles inside the block (its compile log)."""
    logger = logging.getLogger("jax._src.interpreters.pxla")
    handler, level = _Count(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.names
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _model():
    return nnx.Sequential(
        nnx.Linear(4, 8, rngs=nnx.Rngs(0)), jnp.tanh, nnx.Linear(8, 6, rngs=nnx.Rngs(1))
    )


CLEAN, CORRUPT = jnp.ones((1, 3, 4)), jnp.zeros((1, 3, 4))
L0 = "layers/0"


def _logit_diff(answers):
    return lambda y: y[0, -1, answers[0]] - y[0, -1, answers[1]]


def _by_hand(model, answers):
    """Patching layers/0 at each position, without hookax."""
    h_clean = model.layers[0](CLEAN)
    out = []
    for pos in range(3):
        h = jnp.where((jnp.arange(3) == pos)[None, :, None], h_clean, model.layers[0](CORRUPT))
        y = model.layers[2](jnp.tanh(h))
        out.append(y[0, -1, answers[0]] - y[0, -1, answers[1]])
    return np.asarray(out)


@pytest.mark.parametrize("kind", ["array", "ints"])
def test_new_answer_tokens_closed_over_by_the_metric_compile_nothing(kind):
    model = _model()
    make = (lambda a, b: jnp.array([a, b])) if kind == "array" else (lambda a, b: (a, b))
    hx.patch_grid(model, (CLEAN,), (CORRUPT,), _logit_diff(make(0, 1)), where=L0)
    for a, b in [(2, 3), (5, 4)]:
        with compiles() as names:
            grid = hx.patch_grid(
                model, (CLEAN,), (CORRUPT,), _logit_diff(make(a, b)), where="layers/0"
            )
        assert names == []
        np.testing.assert_allclose(grid[0], _by_hand(model, (a, b)), rtol=1e-5, atol=1e-6)


def test_a_new_prompt_compiles_nothing():
    model, metric = _model(), _logit_diff(jnp.array([0, 1]))
    hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where=L0)
    clean, corrupt = CLEAN * 2, CORRUPT + 1
    with compiles() as names:
        hx.patch_grid(model, (clean,), (corrupt,), metric, where=L0)
    assert names == []


ANSWERS = jnp.array([0, 1])


def _global_metric(y):
    return y[0, -1, ANSWERS[0]] - y[0, -1, ANSWERS[1]]


def test_a_global_the_metric_reads_is_read_afresh_without_compiling():
    global ANSWERS
    model = _model()
    hx.patch_grid(model, (CLEAN,), (CORRUPT,), _global_metric, where=L0)
    ANSWERS = jnp.array([4, 2])
    with compiles() as names:
        grid = hx.patch_grid(model, (CLEAN,), (CORRUPT,), _global_metric, where=L0)
    assert names == []
    np.testing.assert_allclose(grid[0], _by_hand(model, (4, 2)), rtol=1e-5, atol=1e-6)


def _forward(model):
    return lambda x: model(x)


def test_a_model_closed_over_by_fn_is_read_afresh_without_compiling():
    model, metric = _model(), _logit_diff(jnp.array([0, 1]))
    hx.patch_grid(_forward(model), (CLEAN,), (CORRUPT,), metric, where=L0)
    model.layers[2].kernel[...] = 2.0 * model.layers[2].kernel[...]  # trained further, in place
    with compiles() as names:
        grid = hx.patch_grid(_forward(model), (CLEAN,), (CORRUPT,), metric, where=L0)
    assert names == []
    np.testing.assert_allclose(grid[0], _by_hand(model, (0, 1)), rtol=1e-5, atol=1e-6)


def _steered(model, vector, how):
    def fn(x):
        if how == "intercept":
            edit = lambda nf, a, k, c: nf(*a, **k) + vector  # noqa: E731
            with hx.intercept(edit, where=L0):
                return model(x)
        with hx.hooks(forward=lambda m, a, out: out + vector, where=L0):
            return model(x)

    return fn


@pytest.mark.parametrize("how", ["intercept", "hooks"])
def test_a_new_steering_vector_in_an_edit_or_hook_compiles_nothing(how):
    model, metric = _model(), _logit_diff(jnp.array([0, 1]))
    args = ((CLEAN,), (CORRUPT,), metric)
    hx.patch_grid(_steered(model, jnp.zeros(8), how), *args, where="layers/2")
    vector = jnp.linspace(-1.0, 1.0, 8)
    with compiles() as names:
        grid = hx.patch_grid(_steered(model, vector, how), *args, where="layers/2")
        est = hx.attribution_patch(_steered(model, vector, how), *args, where="layers/2")
    assert [n for n in names if "_grid" in n] == []
    steered = lambda x: model.layers[2](jnp.tanh(model.layers[0](x) + vector))  # noqa: E731
    np.testing.assert_allclose(grid[0, -1], metric(steered(CLEAN)), rtol=1e-5)
    hx.attribution_patch(_steered(model, 2 * vector, how), *args, where="layers/2")
    with compiles() as names:
        again = hx.attribution_patch(_steered(model, vector, how), *args, where="layers/2")
    assert names == []
    np.testing.assert_allclose(again, est, rtol=1e-6)


def test_new_answers_in_attribution_compile_nothing():
    model = _model()
    hx.attribution_patch(
        model, (CLEAN,), (CORRUPT,), _logit_diff(jnp.array([0, 1])), where="layers/0"
    )
    with compiles() as names:
        est = hx.attribution_patch(
            model, (CLEAN,), (CORRUPT,), _logit_diff(jnp.array([3, 2])), where="layers/0"
        )
    assert names == []
    fresh = hx.attribution_patch(model, (CLEAN,), (CORRUPT,), _logit_diff((3, 2)), where=L0)
    np.testing.assert_allclose(est, fresh, rtol=1e-6)


def test_ints_used_as_static_values_fall_back_to_a_program_per_value():
    model = _model()

    def top(k):
        return lambda y: y[0, -1, :k].sum()  # k is a shape: it cannot be traced

    for k in (2, 3):
        grid = hx.patch_grid(model, (CLEAN,), (CORRUPT,), top(k), where=L0)
        expected = model(CLEAN)[0, -1, :k].sum()
        np.testing.assert_allclose(grid[0, -1], expected, rtol=1e-5)


def test_an_array_used_as_a_static_value_warns_naming_it():
    model = _model()

    def pick(index):
        return lambda y: y[0, -1, int(np.asarray(index)[0])]  # numpy: cannot be an argument

    with pytest.warns(hx.RecompileWarning, match=r"closing over index.*changed: index.*jax\.numpy"):
        for i in range(3):
            grid = hx.patch_grid(
                model, (CLEAN,), (CORRUPT,), pick(jnp.array([i])), where="layers/0"
            )
            np.testing.assert_allclose(grid[0, -1], model(CLEAN)[0, -1, i], rtol=1e-5)


def test_the_same_metric_twice_is_silent():
    model, metric = _model(), _logit_diff(jnp.array([0, 1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hx.RecompileWarning)
        for _ in range(3):
            hx.patch_grid(model, (CLEAN,), (CORRUPT,), metric, where=L0)


def test_under_jit_the_closed_over_tracers_are_lifted_too():
    model = _model()

    @jax.jit
    def grid_for(answers):
        return hx.patch_grid(model, (CLEAN,), (CORRUPT,), _logit_diff(answers), where=L0)

    np.testing.assert_allclose(
        grid_for(jnp.array([3, 1]))[0], _by_hand(model, (3, 1)), rtol=1e-5, atol=1e-6
    )
