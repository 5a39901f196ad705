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


# The slowest tests (by `pytest --durations`, on 2 cores) run in `make test-slow`, which CI runs
# after `make test`, so `make test` stays under about 6 minutes. Node-id prefixes; the docs'
# pages are doctests and cannot carry a decorator.
SLOW = (
    "docs/attention.md::",
    "docs/patching.md::",
    "docs/generation.md::",
    "docs/float32_layer.md::",
    "docs/harvest.md::",
    "docs/features.md::",
    "docs/learned_masks.md::",
    "docs/training.md::",
    "docs/nonfinite.md::",
    "tests/test_reliability_property.py::test_capture_equals_a_hand_unrolled_forward",
    "docs/sae.md::",
    "docs/param_noise.md::",
    "docs/gradients.md::",
    "docs/gradcam.md::",
    "tests/test_sae.py::test_cli_harvest_tokens",
    "tests/test_harvest_safety.py::test_cli_overwrite_of_user_folders_and_dot",
    "tests/test_ops.py::test_scanned_decoder_probabilities_edits_and_gradients",
    "tests/test_ops.py::test_gradients_of_operations_equal_finite_differences",
    "tests/test_transforms.py::test_no_tracer_leaks",
    "tests/test_reliability_property.py::test_no_op_hooks_interceptors_and_capture_change_no_bit",
    "tests/test_reliability_memory.py::",
    "tests/test_harvest_procs.py::",
    "tests/test_pickle.py::",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
