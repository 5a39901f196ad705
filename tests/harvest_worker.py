"""The model, data and runs shared by the harvest tests and the processes they start.

``python -m tests.harvest_worker single STORE`` harvests :func:`batches` into STORE (the tests
kill it); ``python -m tests.harvest_worker dist STORE PROCESS PORT`` is one of two
``jax.distributed`` processes on loopback, each with 2 CPU devices.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

BATCH, SEQ, WIDTH = 4, 3, 4


def make_model() -> Any:
    """A two-layer MLP with parameters drawn by numpy (no JAX op compiles on the way)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def build() -> Any:
        rngs = nnx.Rngs(0)
        return nnx.Sequential(
            nnx.Linear(WIDTH, 8, rngs=rngs), nnx.relu, nnx.Linear(8, 6, rngs=rngs)
        )

    graphdef, state = nnx.split(nnx.eval_shape(build))
    rng = np.random.default_rng(1)
    state = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape).astype(s.dtype)), state)
    return nnx.merge(graphdef, state)


def host_batches(n: int) -> list[np.ndarray]:
    """``n`` batches of shape (BATCH, SEQ, WIDTH); entry 0 of the last axis <= 0 marks padding."""
    rng = np.random.default_rng(0)
    return [rng.normal(size=(BATCH, SEQ, WIDTH)).astype(np.float32) for _ in range(n)]


def pad_mask(x: Any) -> Any:
    return x[..., 0] > -0.5


def sharded_run(store: str, devices: list[Any], n: int = 5) -> Any:
    """Harvest with the input sharded over rows and the last layer over features (a 2x2 mesh
    whose ``model`` axis spans the processes when there are two)."""
    import jax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import hookax as hx

    mesh = Mesh(np.array(devices).reshape(2, 2).T, ("data", "model"))
    model = make_model()
    state = nnx.state(model)
    kernel_spec = P(None, "model")

    def place(path: Any, v: Any) -> Any:
        spec = kernel_spec if jax.tree_util.keystr(path).find("[2]") >= 0 and v.ndim == 2 else P()
        return jax.device_put(np.asarray(v), NamedSharding(mesh, spec))

    nnx.update(model, jax.tree_util.tree_map_with_path(place, state))
    rows = NamedSharding(mesh, P("data"))
    data = [
        jax.make_array_from_callback(x.shape, rows, lambda i, x=x: x[i]) for x in host_batches(n)
    ]
    return hx.harvest(
        model, data, where="layers/*", store=store, mask=pad_mask, row_axes=2, progress=False
    )


def main(argv: list[str]) -> None:
    mode, store = argv[0], argv[1]
    if mode == "single":
        import hookax as hx

        model = make_model()
        hx.harvest(
            model,
            host_batches(int(argv[2])),
            where="layers/*",
            store=store,
            progress=False,
            queue_size=1,
        )
    else:
        process, port = int(argv[2]), argv[3]
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
        sharded_run(store, jax.devices())


if __name__ == "__main__":
    if sys.argv[1] == "dist":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    main(sys.argv[1:])
