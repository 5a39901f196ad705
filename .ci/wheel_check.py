"""Install a built hookax wheel as a user would, one fresh venv per extra, and run it.

    python .ci/wheel_check.py dist/hookax-0.1.0-py3-none-any.whl WORKDIR

Each venv gets only ``install "<wheel>[extra]"`` (uv's pip-compatible installer, from the package
registry) and then runs what a user of that extra runs first. Exits non-zero at the first failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

EQUINOX_SUMMARY = r"""
import equinox as eqx, jax, hookax as hx
model = eqx.nn.MLP(4, 2, 8, depth=2, key=jax.random.key(0))
s = hx.summary(model, jax.ShapeDtypeStruct((4,), "float32"))
print(s)
assert s.totals.params == 4 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2, s.totals
"""

LINEN_SUMMARY = r"""
import flax.linen as nn, jax, hookax as hx
s = hx.summary(nn.Dense(3), jax.ShapeDtypeStruct((2, 4), "float32"))
print(s)
assert s.totals.params == 4 * 3 + 3, s.totals
"""

CORE_ONLY = r"""
import sys, jax.numpy as jnp, hookax as hx
g = __import__("jax").grad(lambda x: hx.hook_grad(x, lambda c: 2 * c).sum())(jnp.ones(3))
assert g.tolist() == [2.0, 2.0, 2.0], g
assert "flax" not in sys.modules and "equinox" not in sys.modules
"""


def sh(
    cmd: list[str], *, expect: int = 0, contains: str = "", env: dict | None = None, cwd: str = "."
) -> str:
    shown = " ".join(c if "\n" not in c else "<script>" for c in cmd)
    print("$", shown, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, check=False)
    out = done.stdout + done.stderr
    if done.returncode != expect or contains not in out:
        sys.exit(f"FAILED (exit {done.returncode}, wanted {expect} and {contains!r}):\n{out}")
    return out


def main(wheel: str, work: str) -> None:
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
    # the README's first example pasted into a plain prompt (.ci/readme_example.py)
    paste = os.path.join(os.path.dirname(os.path.abspath(__file__)), "readme_example.py")
    env = dict(os.environ, MPLBACKEND="Agg")
    env.pop("VIRTUAL_ENV", None)
    uv = [sys.executable, "-m", "uv"]
    checks: dict[str, list[tuple[list[str], int, str]]] = {
        "": [
            (["python", "-c", CORE_ONLY], 0, ""),
            (["hookax", "summary", "--example", "mlp"], 2, '-none-any.whl[nnx]"'),
        ],
        "nnx": [
            (["hookax", "summary", "--example", "mlp"], 0, "Total parameters: 235,146"),
            (["python", paste, readme], 0, "pasted: ok"),
            (["hookax", "gradflow", "--example", "mlp"], 2, '-none-any.whl[plot]"'),
        ],
        "linen": [(["python", "-c", LINEN_SUMMARY], 0, "Total parameters: 15")],
        "equinox": [
            (["python", "-c", EQUINOX_SUMMARY], 0, "Total parameters"),
            (["hookax", "summary", "--example", "mlp"], 2, '-none-any.whl[nnx]"'),
        ],
        "all": [
            (["hookax", "gradflow", "--example", "mlp", "--out", "g.png"], 0, "wrote g.png"),
        ],
    }
    for extra, steps in checks.items():
        t0 = time.perf_counter()
        venv = os.path.join(work, f"venv-{extra or 'core'}")
        sh([*uv, "venv", "-q", "--python", sys.executable, venv], env=env)
        spec = f"{wheel}[{extra}]" if extra else wheel
        python = os.path.join(venv, "bin", "python")
        # symlinks into uv's cache: these venvs are thrown away, and copying jaxlib five times
        # would be most of this check's time
        sh([*uv, "pip", "install", "-q", "--link-mode", "symlink", "--python", python, spec])
        bin_env = dict(env, PATH=os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""))
        for cmd, code, text in steps:
            exe = os.path.join(venv, "bin", cmd[0])
            # run from `work`, never from the source tree: only the installed wheel is imported
            sh([exe, *cmd[1:]], expect=code, contains=text, env=bin_env, cwd=work)
        print(f"ok: {spec.rsplit('/', 1)[-1]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"wheel: {len(checks)} passed, 0 failed")  # a failure exits above


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
