"""hx.harvest across processes: SIGKILL at random points then resume; two jax.distributed
processes writing one store. Each test starts its processes together (they import in parallel)."""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import hookax as hx
from tests import harvest_worker as w
from tests.test_harvest import assert_same_store

ROOT = Path(__file__).resolve().parent.parent
N_BATCHES = 40


def _start(*argv, devices=8):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "tests.harvest_worker", *map(str, argv)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _kill_when(proc, ready, delay, timeout=120.0):
    """SIGKILL ``proc`` ``delay`` seconds after ``ready()`` first holds (or when it exits)."""
    t0 = time.monotonic()
    while not ready() and proc.poll() is None:
        assert time.monotonic() - t0 < timeout, "the worker never started writing"
        time.sleep(0.005)
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    assert proc.returncode in (0, -signal.SIGKILL), out
    return proc.returncode


def test_resume_after_sigkill_gives_the_same_store(tmp_path):
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    early, late = tmp_path / "early", tmp_path / "late"
    procs = [_start("single", s, N_BATCHES) for s in (early, late)]
    # one kill while the store is being created or its first batches written, one anywhere
    codes = [
        _kill_when(procs[0], early.exists, rnd.uniform(0, 0.1)),
        _kill_when(procs[1], (late / "progress").exists, rnd.uniform(0, 1.0)),
    ]
    model = w.make_model()
    data = w.host_batches(N_BATCHES)
    hx.harvest(model, data, where="layers/*", store=tmp_path / "ref", progress=False)
    for store, code in zip((early, late), codes):
        h = hx.harvest(model, data, where="layers/*", store=store, progress=False)
        assert h.batches == N_BATCHES, (seed, code)
        assert_same_store(tmp_path / "ref", store)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 host devices")
def test_two_processes_write_the_store_of_one(tmp_path):
    port = _free_port()
    procs = [_start("dist", tmp_path / "two", i, port, devices=2) for i in range(2)]
    try:
        w.sharded_run(str(tmp_path / "one"), jax.devices()[:4])  # meanwhile, here: one process
        for p in procs:
            # Generous: two JAX processes start on a loaded 2-core machine (a hang still ends).
            out, _ = p.communicate(timeout=480)
            assert p.returncode == 0, out
    finally:
        for p in procs:
            p.kill()
    # one process writes chunks of up to 64 batches itself, two write one batch per chunk
    # through TensorStore: the same arrays, chunked differently
    assert_same_store(tmp_path / "one", tmp_path / "two", files=False)
    # and hx.StoreReader gives the same batches of both (blocks of the two-process chunks)
    block = hx.open_store(tmp_path / "two").chunk_rows("layers/2")
    names = ["layers/0", "layers/2"]
    one, two = (
        hx.StoreReader(tmp_path / s, names, 7, seed=1, epochs=2, block_rows=block, window_rows=50)
        for s in ("one", "two")
    )
    for a, b in zip(one, two, strict=True):
        for n in names:
            np.testing.assert_array_equal(np.asarray(a[n]), np.asarray(b[n]))
