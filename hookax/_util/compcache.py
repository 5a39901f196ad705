"""``hx.compilation_cache``: JAX's persistent compilation cache, one call away.

A notebook kernel that restarts compiles every grid, capture and jitted step again. JAX can keep
compiled programs on disk (``jax_compilation_cache_dir``), but by default it only stores
programs that took more than a second to compile, and a directory set after the first compile
of the process is ignored until the cache is reset. This sets the directory, stores every
program (the small ones are the many), and resets JAX's cache state so the setting takes effect
whenever it is called. Tracing still runs in a new process; XLA's compile is read back.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

__all__ = ["compilation_cache"]


def compilation_cache(
    path: str | os.PathLike[str] | None = None,
    *,
    min_compile_time_s: float = 0.0,
    min_entry_size_bytes: int = 0,
) -> str:
    """Keep compiled programs on disk, so a new process (a restarted kernel) reads them back.

    Wraps JAX's persistent compilation cache: sets ``jax_compilation_cache_dir`` and the
    thresholds below which a program is not stored, and takes effect at once, also after the
    process has compiled something. Every later compile of the process (hookax's grids, your
    ``jax.jit`` functions) reads and writes it. Equivalent settings without hookax::

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    Or the environment, before Python starts: ``JAX_COMPILATION_CACHE_DIR=path``.

    What the cache cannot skip: tracing (the cache key is the traced program), reading the
    program back, and its first run. On CPU a program's first run also sets up XLA's YNNPACK
    fusions: for the 12-block example transformer's residual grid, 1.1 s of a 3.0 s first call
    with the cache warm; ``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`` (before JAX
    starts) turns those fusions off, for 1.75 s, at some cost to warm calls
    ([benchmarks](../benchmarks.md#first-calls-and-new-data)).

    Args:
      path: the directory (created if missing); default ``~/.cache/hookax/jax``, or
        ``$HOOKAX_CACHE_DIR`` when set.
      min_compile_time_s: programs that compiled faster than this are not stored (JAX's
        default is 1 second; here 0: every program).
      min_entry_size_bytes: programs smaller than this are not stored.

    Returns:
      The directory, as an absolute path.

    Examples:
      >>> import tempfile
      >>> import hookax as hx
      >>> path = hx.compilation_cache(tempfile.mkdtemp())
      >>> import jax
      >>> jax.config.jax_compilation_cache_dir == path
      True
    """
    if path is None:
        path = os.environ.get("HOOKAX_CACHE_DIR") or Path.home() / ".cache" / "hookax" / "jax"
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    os.makedirs(full, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", full)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    from jax.experimental.compilation_cache import compilation_cache as cc

    cc.reset_cache()  # a cache JAX set up (or found off) at an earlier compile reads the new one
    return full
