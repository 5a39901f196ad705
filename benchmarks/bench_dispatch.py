"""Eager dispatch cost per forward of a 24-layer MLP: NNX with hookax vs Linen's interceptors.

Rows, measured side by side in one run (round-robin, medians):

* NNX plain: hookax's wrappers taken off the two classes involved (the model as NNX runs it);
* NNX idle: hookax installed, nothing active (the one-check fast path);
* NNX one interceptor: ``hx.intercept`` with the same no-op function object every call;
* NNX fresh interceptor: a new lambda for every forward (a new jit-cache key each time);
* Linen plain / ``nn.intercept_methods`` with one no-op function / a fresh lambda every call;
  Linen through hookax: ``hx.intercept`` with one no-op function;
* Equinox plain (hookax's wrappers taken off) / hookax idle / ``hx.intercept`` with one no-op.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from ._timing import interleaved, table

DEPTH, WIDTH, BATCH = 24, 64, 8


AROUND: dict = {}


def noop(next_fun, args, kwargs, context):
    return next_fun(*args, **kwargs)


def _nnx_configs() -> dict:
    from flax import nnx

    import hookax as hx
    from hookax.frameworks import _nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(DEPTH)])

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    with hx.intercept(noop):
        pass  # installs the NNX adapter
    model, x = MLP(nnx.Rngs(0)), jnp.ones((BATCH, WIDTH))
    classes = (MLP, nnx.Linear)
    wrapped = {c: c.__call__ for c in classes}
    originals = {c: getattr(c.__call__, _nnx._MARK) for c in classes}

    @contextlib.contextmanager
    def unwrapped():
        """The classes as NNX defines them, for one whole round (not toggled per call)."""
        for c, f in originals.items():
            type.__setattr__(c, "__call__", f)
        try:
            yield
        finally:
            for c, f in wrapped.items():
                type.__setattr__(c, "__call__", f)

    def plain():
        return model(x).block_until_ready()

    def idle():
        return model(x).block_until_ready()

    def one():
        with hx.intercept(noop):
            return model(x).block_until_ready()

    def fresh():
        with hx.intercept(lambda n, a, k, c: n(*a, **k)):
            return model(x).block_until_ready()

    AROUND["NNX plain"] = unwrapped
    return {
        "NNX plain": plain,
        "NNX hookax idle": idle,
        "NNX hx.intercept, one no-op": one,
        "NNX hx.intercept, fresh lambda": fresh,
    }


def _linen_configs() -> dict:
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(DEPTH):
                x = jax.nn.relu(nn.Dense(WIDTH)(x))
            return x

    model, x = MLP(), jnp.ones((BATCH, WIDTH))
    params = model.init(jax.random.key(0), x)

    def plain():
        return model.apply(params, x).block_until_ready()

    def one():
        with nn.intercept_methods(noop):
            return model.apply(params, x).block_until_ready()

    def fresh():
        with nn.intercept_methods(lambda n, a, k, c: n(*a, **k)):
            return model.apply(params, x).block_until_ready()

    import hookax as hx

    def hookax_one():
        with hx.intercept(noop):
            return model.apply(params, x).block_until_ready()

    return {
        "Linen plain": plain,
        "Linen intercept_methods, one no-op": one,
        "Linen intercept_methods, fresh lambda": fresh,
        "Linen hx.intercept, one no-op": hookax_one,
    }


def _equinox_configs() -> dict:
    import equinox as eqx

    import hookax as hx
    from hookax.frameworks import _equinox

    class MLP(eqx.Module):
        layers: list

        def __init__(self, key):
            keys = jax.random.split(key, DEPTH)
            self.layers = [eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys]

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    with hx.intercept(noop):
        pass  # installs the Equinox adapter
    model, x = MLP(jax.random.key(0)), jnp.ones((WIDTH,))
    classes = (MLP, eqx.nn.Linear)
    wrapped = {c: c.__call__ for c in classes}
    originals = {c: getattr(c.__call__, _equinox._MARK) for c in classes}

    @contextlib.contextmanager
    def unwrapped():
        """The classes as Equinox defines them, for one whole round (not toggled per call)."""
        for c, f in originals.items():
            type.__setattr__(c, "__call__", f)
        try:
            yield
        finally:
            for c, f in wrapped.items():
                type.__setattr__(c, "__call__", f)

    # eqx.nn.Linear takes one example; it is called on one (a jax.vmap around it would add the
    # same batching cost to every row and hide the dispatch cost being measured).
    def forward():
        return model(x).block_until_ready()

    plain = forward

    def one():
        with hx.intercept(noop):
            return forward()

    AROUND["Equinox plain"] = unwrapped
    return {
        "Equinox plain": plain,
        "Equinox hookax idle": lambda: forward(),
        "Equinox hx.intercept, one no-op": one,
    }


def _per_call_overhead() -> tuple[float, float]:
    """Seconds per call of a trivial method: hookax's idle wrapper vs the bare function."""
    import timeit

    from flax import nnx

    from hookax.frameworks import _nnx

    class Id(nnx.Module):
        def __call__(self, x):
            return x

    m, bare = Id(), getattr(Id.__call__, _nnx._MARK)
    n = 200_000
    wrapped = min(timeit.repeat(lambda: m(1), number=n, repeat=5)) / n
    direct = min(timeit.repeat(lambda: bare(m, 1), number=n, repeat=5)) / n
    return wrapped, direct


def main(rounds: int = 15) -> dict[str, float]:
    configs = {**_nnx_configs(), **_linen_configs(), **_equinox_configs()}
    slow = {"NNX hx.intercept, fresh lambda"}
    inner = {name: (3 if name in slow else 20) for name in configs}
    t = interleaved(configs, rounds=rounds, inner=inner, around=AROUND)
    base = {"NNX": t["NNX plain"], "Linen": t["Linen plain"], "Equinox": t["Equinox plain"]}
    rows = [
        (name, f"{t[name] * 1e3:.3f}", f"{t[name] / base[name.split()[0]]:.3f}") for name in configs
    ]
    print(f"Eager forward, {DEPTH}-layer MLP (width {WIDTH}, batch {BATCH}), median of {rounds}")
    print(table(rows, ("configuration", "ms/forward", "ratio to own plain")))
    wrapped, direct = _per_call_overhead()
    print(
        f"Idle check per module call: {(wrapped - direct) * 1e9:.0f} ns "
        f"(trivial method: {wrapped * 1e9:.0f} ns wrapped vs {direct * 1e9:.0f} ns bare)"
    )
    return t


if __name__ == "__main__":
    main()
