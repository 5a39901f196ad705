"""hx.StatsLogger: one TensorBoard event per step, written off the training thread, read back."""

from __future__ import annotations

import struct
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c

import hookax as hx
from hookax._diagnostics import logger as _logger
from hookax._util.extras import MissingExtraError

from .test_stats import Stack, mse


def tensorboardx_events(logdir: Path) -> list[Any]:
    """Every event of the event files in ``logdir``: TFRecord framing (length, masked CRC32C of
    the length, data, masked CRC32C of the data) parsed into tensorboardX's ``Event`` proto."""
    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            assert struct.unpack("<I", data[i + 8 : i + 12])[0] == masked_crc32c(data[i : i + 8])
            body = data[i + 12 : i + 12 + n]
            assert struct.unpack("<I", data[i + 12 + n : i + 16 + n])[0] == masked_crc32c(body)
            events.append(Event.FromString(body))
            i += 16 + n
    return events


def train(logger: hx.StatsLogger, steps: int) -> dict[int, dict[str, float]]:
    """A short optax run of a scanned stack; the values it logged, fetched here, by step."""
    x = jax.random.normal(jax.random.key(1), (8, 4))
    y = jax.random.normal(jax.random.key(2), (8, 2))
    model = Stack()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step_with_stats(model: Any, opt: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads, stats = hx.value_grad_and_stats(mse)(model, x, y)
        opt.update(model, grads)
        return loss, stats

    @nnx.jit
    def step(model: Any, opt: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = nnx.value_and_grad(mse)(model, x, y)
        opt.update(model, grads)
        return loss

    logged = {}
    for i in range(steps):
        if logger.due(i):
            loss, stats = step_with_stats(model, opt, x, y)
            logger.log(i, stats, loss=loss)
            logged[i] = hx.StatsLogger.as_dict(stats, loss=loss)
        else:
            step(model, opt, x, y)
    logger.close()
    return logged


def test_one_event_per_logged_step_read_back_with_tensorboardx_protos(tmp_path: Path) -> None:
    logged = train(hx.StatsLogger(tmp_path, every=3), steps=10)
    assert sorted(logged) == [0, 3, 6, 9]
    events = tensorboardx_events(tmp_path)
    assert events[0].file_version.startswith("brain.Event")
    with_values = [e for e in events if e.HasField("summary")]
    assert [e.step for e in with_values] == [0, 3, 6, 9]  # one event per step, all values in it
    for e in with_values:
        values = {v.tag: v.simple_value for v in e.summary.value}
        want = logged[e.step]
        assert list(values) == list(want)
        np.testing.assert_allclose(list(values.values()), list(want.values()), rtol=1e-6)
    # the names: one statistic of every layer in one TensorBoard section
    tags = list(logged[0])
    assert "grad_norm/blocks/lin[2]" in tags and "act_max_abs/(model)" in tags
    assert "loss" in tags and len(tags) == 1 + 2 * 5 * (1 + 3 + 3 + 1)  # root, blocks, lin, head
    assert logged[3]["loss"] < logged[0]["loss"]  # it trains


def test_read_events_equals_the_files(tmp_path: Path) -> None:
    logged = train(hx.StatsLogger(tmp_path, every=2), steps=5)
    read = hx.read_events(tmp_path)
    assert list(read) == list(logged[0])
    for t, (steps, values) in read.items():
        assert steps == [0, 2, 4]
        np.testing.assert_allclose(values, [logged[s][t] for s in steps], rtol=1e-6)


class Probe:
    """A statistic that records the thread that reads it and when."""

    reads: ClassVar[list[tuple[str, int]]] = []
    clock: ClassVar[int] = 0

    def __init__(self, value: float) -> None:
        self.value = value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        Probe.reads.append((threading.current_thread().name, Probe.clock))
        return np.asarray(self.value, dtype)


def test_values_are_read_a_step_late_on_the_logger_thread() -> None:
    Probe.reads, Probe.clock = [], 0
    seen: list[tuple[int, dict[str, float], str]] = []
    logger = hx.StatsLogger(
        None, callback=lambda s, v: seen.append((s, v, threading.current_thread().name))
    )
    for step in range(3):
        Probe.clock = step
        logger.log(step, {"lin": {"act": {"norm": Probe(step)}}})
        if step == 0:
            assert Probe.reads == []  # not read while logging its own step
    logger.close()
    # step s is read after step s + 1 was logged (the last one at close), never on this thread
    assert len(Probe.reads) == 3
    assert all(clock >= min(s + 1, 2) for s, (_, clock) in enumerate(Probe.reads))
    assert {name for name, _ in Probe.reads} == {"hx.StatsLogger"}
    assert [(s, v) for s, v, _ in seen] == [(s, {"act_norm/lin": float(s)}) for s in range(3)]
    assert {name for *_, name in seen} == {"hx.StatsLogger"}


def test_an_error_on_the_thread_is_raised_by_the_next_call() -> None:
    def broken(step: int, values: dict[str, float]) -> None:
        raise ValueError("the other logger is down")

    logger = hx.StatsLogger(None, callback=broken)
    logger.log(0, loss=1.0)
    with pytest.raises(ValueError, match="the other logger is down") as info:
        logger.flush()
    assert "hx.StatsLogger's thread while writing step 0" in str(info.value.__notes__)
    logger.close()
    with pytest.raises(hx.HookaxError, match="log\\(\\) after close"):
        logger.log(1, loss=1.0)
    logger.close()  # idempotent


def test_as_dict_names_layers_calls_and_scalars() -> None:
    stats = {
        "": {"act": {"norm": jnp.float32(1)}, "grad": {"norm": jnp.float32(2)}},
        "blocks/lin": {"act": {"mean": jnp.arange(2.0)}, "grad": {}},
        "twice": {"act": {"max_abs": jnp.ones((2, 2))}, "grad": {}},
    }
    assert hx.StatsLogger.as_dict(stats, loss=jnp.float32(0.25)) == {
        "act_norm/(model)": 1.0,
        "grad_norm/(model)": 2.0,
        "act_mean/blocks/lin[0]": 0.0,
        "act_mean/blocks/lin[1]": 1.0,
        "act_max_abs/twice[0][0]": 1.0,
        "act_max_abs/twice[0][1]": 1.0,
        "act_max_abs/twice[1][0]": 1.0,
        "act_max_abs/twice[1][1]": 1.0,
        "loss": 0.25,
    }


def test_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(hx.HookaxError, match="every=0 must be an integer >= 1"):
        hx.StatsLogger(None, every=0)
    with pytest.raises(hx.HookaxError, match="holds no TensorBoard event files"):
        hx.read_events(tmp_path)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(MissingExtraError, match=r'Install it with: pip install .*\[tensorboard\]"'):
        hx.StatsLogger(tmp_path)
    assert _logger.tag("", "grad", "norm") == "grad_norm/(model)"
