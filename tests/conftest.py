"""Test configuration: 8 CPU devices, strict dtype promotion, and shared helpers."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")


class TraceCounter:
    """Counts how many times a function body is traced (run in Python)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


@pytest.fixture
def traces() -> TraceCounter:
    return TraceCounter()
