"""``make compat``: the frameworks' own test suites, without hookax and with it, compared.

Runs Flax's ``tests/nnx`` and ``tests/linen``, Equinox's ``tests/`` and Haiku's tests (of the
versions pinned in pyproject.toml) three ways:

* ``plain``: hookax is not importable at all;
* ``imported``: hookax imported after the frameworks and its adapters installed, nothing active;
* ``scoped``: also a no-op ``hx.intercept`` and no-op ``hx.hooks`` active around every test;
* ``ops`` (with ``--ways``, not by default): a no-op ``hx.intercept_op`` on every operation of
  every call site around every test;

and prints a table of passed / failed / skipped per suite and way, then every test whose outcome
differs from the plain run. Everything it needs lives in a cache directory outside the checkout
(``$HOOKAX_COMPAT_CACHE``, default ``~/.cache/hookax-compat``):

* a virtual environment with the pinned jax, flax, equinox and dm-haiku and the suites' test
  dependencies
  (hookax itself is not installed there; it comes from this checkout via ``PYTHONPATH``);
* Flax's tests, from its source distribution on the package index (``pip download``);
* Equinox's tests, which its source distribution does not ship: from GitHub's tag archive, or,
  where GitHub cannot be reached, from a git directory named by ``$HOOKAX_COMPAT_EQUINOX_GIT``
  (``git archive v<version>``);
* Haiku's tests, which its wheel ships beside its modules (``haiku/_src/*_test.py``): copied from
  the environment's installed package.

The full suites take hours on a 2-core machine, so by default a selection of files runs (see
``SELECTION``); ``--full`` runs everything. ``python compat/run.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("HOOKAX_COMPAT_CACHE", Path.home() / ".cache" / "hookax-compat"))
# Results of each Python apart (its lock's frameworks differ).
RESULTS = CACHE / f"results-py{sys.version_info[0]}{sys.version_info[1]}"
WAYS = ("plain", "imported", "scoped")
TEST_DEPS = (
    "pytest",
    "pytest-timeout",
    "absl-py",
    "optax",
    "cloudpickle",
    "orbax-checkpoint",
    "jaxtyping",
    "beartype",
)

# The default selection: the files that exercise modules, their methods and the transforms over
# them (where hookax is in the way), small enough for a 2-core machine; --full runs every file.
SELECTION = {
    "nnx": (
        "module_test.py",
        "graph_utils_test.py",
        "rngs_test.py",
        "helpers_test.py",
        "containers_test.py",
        "integration_test.py",
        "summary_test.py",
        "nnx_compat_test.py",
    ),
    "linen": (
        "linen_module_test.py",
        "linen_test.py",
        "linen_combinators_test.py",
        "linen_transforms_test.py",
        "summary_test.py",
    ),
    "equinox": (
        "test_module.py",
        "test_jit.py",
        "test_vmap.py",
        "test_ad.py",
        "test_nn.py",
        "test_stateful.py",
        "test_scan.py",
        "test_noinline.py",
    ),
    # (transform_test.py needs TensorFlow, recurrent_test.py and moving_averages_test.py dm-tree)
    "haiku": (
        "module_test.py",
        "base_test.py",
        "stateful_test.py",
        "layer_stack_test.py",
        "lift_test.py",
        "basic_test.py",
        "summarise_test.py",
        "batch_norm_test.py",
    ),
}


def pins(lock: str = "requirements-dev.lock") -> dict[str, str]:
    """The versions of jax, jaxlib, flax, equinox and dm-haiku in a development lock (the newest
    set of one Python: ``requirements-dev.lock`` for 3.11, ``requirements-dev-py312.lock``, ...)."""
    found = {}
    for line in (ROOT / lock).read_text().splitlines():
        m = re.fullmatch(r"(jax|jaxlib|flax|equinox|dm-haiku)==([\w.]+)", line.strip())
        if m:
            found[m.group(1)] = m.group(2)
    return found


def run(cmd: list[str], **kw: object) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def venv(versions: dict[str, str]) -> Path:
    """The cached virtual environment with the pinned frameworks and the test dependencies."""
    env = CACHE / f"venv-py{sys.version_info[0]}{sys.version_info[1]}"
    stamp = env / "hookax-compat.json"
    want = {"pins": versions, "deps": list(TEST_DEPS)}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return env / "bin" / "python"
    shutil.rmtree(env, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(env)])
    py = env / "bin" / "python"
    run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    run(
        [str(py), "-m", "pip", "install", "-q"]
        + [f"{k}=={v}" for k, v in versions.items()]
        + list(TEST_DEPS)
    )
    stamp.write_text(json.dumps(want))
    return py


def _extract(data: bytes, dest: Path, keep: tuple[str, ...]) -> None:
    """Extract the members under ``keep`` (paths below the archive's top folder) into dest."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) == 2 and parts[1].split("/")[0] in keep and member.isfile():
                member.name = parts[1]
                tar.extract(member, tmp, filter="data")
    tmp.rename(dest)


def flax_tests(py: Path, version: str) -> Path:
    dest = CACHE / f"flax-{version}"
    if not (dest / "tests").is_dir():
        sdist = CACHE / "sdist"
        pip = [str(py), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        run([*pip, f"flax=={version}", "-d", str(sdist)])
        _extract((sdist / f"flax-{version}.tar.gz").read_bytes(), dest, ("tests", "pyproject.toml"))
    return dest


def equinox_tests(version: str) -> Path | None:
    dest = CACHE / f"equinox-{version}"
    if (dest / "tests").is_dir():
        return dest
    url = f"https://github.com/patrick-kidger/equinox/archive/refs/tags/v{version}.tar.gz"
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            _extract(r.read(), dest, ("tests", "pyproject.toml"))
        return dest
    except OSError as e:
        print(f"cannot download {url}: {e}")
    git = os.environ.get("HOOKAX_COMPAT_EQUINOX_GIT")
    if git:
        git_archive = ["git", f"--git-dir={git}", "archive", f"--prefix=equinox-{version}/"]
        archive = subprocess.run(
            [*git_archive, f"v{version}", "tests", "pyproject.toml"],
            capture_output=True,
            check=True,
        ).stdout
        _extract(archive, dest, ("tests", "pyproject.toml"))
        return dest
    print("Equinox's tests are not in its sdist: set HOOKAX_COMPAT_EQUINOX_GIT to a git clone.")
    return None


def haiku_tests(py: Path, version: str) -> Path:
    """Haiku's test files, copied from the package installed in the environment ``py``."""
    dest = CACHE / f"dm-haiku-{version}"
    if (dest / "tests").is_dir():
        return dest
    where = subprocess.run(
        [str(py), "-c", "import haiku, os; print(os.path.dirname(haiku.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "tests").mkdir(parents=True)
    for test in Path(where, "_src").glob("*_test.py"):
        shutil.copy(test, tmp / "tests" / test.name)
    (tmp / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    tmp.rename(dest)
    return dest


def outcomes(xml: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from a JUnit XML report."""
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            result[test_id] = "failed"
        elif "skipped" in kinds:
            result[test_id] = "skipped"
        else:
            result[test_id] = "passed"
    return result


def run_suite(
    py: Path, suite: str, src: Path, files: list[str], way: str, out: Path
) -> dict[str, str]:
    xml, stats = out / f"{suite}-{way}.xml", out / f"{suite}-{way}-stats.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env.pop("PYTHONPATH", None)
    cmd = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=900"]
    cmd += ["-c", str(src / "pyproject.toml"), "--rootdir", str(src), f"--junitxml={xml}"]
    if way != "plain":
        env.update(
            PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]),
            HOOKAX_COMPAT_WAY=way,
            HOOKAX_COMPAT_STATS=str(stats),
        )
        cmd += ["-p", "hookax_compat_plugin"]
    log = out / f"{suite}-{way}.log"
    print(f"== {suite} / {way}: {len(files)} files (log: {log})", flush=True)
    with open(log, "w") as f:
        subprocess.run(cmd + files, cwd=src, env=env, stdout=f, stderr=subprocess.STDOUT)
    if stats.exists():
        print("   hookax:", stats.read_text(), flush=True)
    return outcomes(xml) if xml.exists() else {}


def _calls(suite: str, way: str) -> str:
    """How many calls the no-op interceptor saw: the proof that hookax was in the way."""
    stats = RESULTS / f"{suite}-{way}-stats.json"
    if way != "scoped" or not stats.exists():
        return "-"
    return str(json.loads(stats.read_text())["intercepted"])


def report(results: dict[str, dict[str, dict[str, str]]], header: str) -> str:
    lines = [
        header,
        "",
        "| suite | way | passed | failed | skipped | calls intercepted |",
        "|---|---|---|---|---|---|",
    ]
    diffs = []
    for suite, by_way in results.items():
        for way, res in by_way.items():
            c = Counter(res.values())
            counts = f"{c['passed']} | {c['failed']} | {c['skipped']}"
            lines.append(f"| {suite} | {way} | {counts} | {_calls(suite, way)} |")
        plain = by_way.get("plain", {})
        for way, res in by_way.items():
            for test_id in sorted(set(plain) | set(res)):
                a, b = plain.get(test_id, "missing"), res.get(test_id, "missing")
                if way != "plain" and a != b:
                    diffs.append(f"- {suite} / {way}: `{test_id}`: {a} without hookax, {b} with")
    lines += ["", "Differences from the plain run:" if diffs else "No differences.", *diffs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="every test file, not the selection")
    parser.add_argument("--suites", default="nnx,linen,equinox,haiku")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--files", help="comma-separated file names instead of the selection")
    parser.add_argument(
        "--lock",
        default="requirements-dev.lock",
        help="the lock whose frameworks to test (requirements-dev-py312.lock on 3.12)",
    )
    parser.add_argument(
        "--report", action="store_true", help="only print the table of the last runs' results"
    )
    args = parser.parse_args(argv)
    versions = pins(args.lock)
    out = RESULTS
    if args.report:
        results = {
            suite: {
                way: outcomes(out / f"{suite}-{way}.xml")
                for way in args.ways.split(",")
                if (out / f"{suite}-{way}.xml").exists()
            }
            for suite in args.suites.split(",")
        }
        print(
            report(
                results,
                f"jax {versions['jax']}, flax {versions['flax']}, "
                f"equinox {versions['equinox']}, dm-haiku {versions.get('dm-haiku')}; "
                f"the last runs in {out}",
            )
        )
        return 0
    CACHE.mkdir(parents=True, exist_ok=True)
    py = venv(versions)
    flax_src = flax_tests(py, versions["flax"])
    sources = {
        "nnx": flax_src,
        "linen": flax_src,
        "equinox": equinox_tests(versions["equinox"]),
        "haiku": haiku_tests(py, versions["dm-haiku"]),
    }
    folders = {"nnx": "tests/nnx", "linen": "tests/linen", "equinox": "tests", "haiku": "tests"}
    out.mkdir(exist_ok=True)
    results: dict[str, dict[str, dict[str, str]]] = {}
    for suite in args.suites.split(","):
        src = sources[suite]
        if src is None:
            continue
        folder = src / folders[suite]
        test_file = re.compile(r"(test_.*|.*_test)\.py$")
        names = sorted(p.name for p in folder.glob("*.py") if test_file.match(p.name))
        if args.files:
            names = [n for n in names if n in args.files.split(",")]
        elif not args.full:
            names = [n for n in names if n in SELECTION[suite]]
        files = [f"{folders[suite]}/{n}" for n in names]
        results[suite] = {
            way: run_suite(py, suite, src, files, way, out) for way in args.ways.split(",")
        }
    selection = (
        f"files {args.files}"
        if args.files
        else "every test file"
        if args.full
        else "the selection in compat/run.py"
    )
    header = (
        f"jax {versions['jax']}, flax {versions['flax']}, equinox {versions['equinox']}, "
        f"dm-haiku {versions.get('dm-haiku')}; {selection}"
    )
    text = report(results, header)
    (out / "compat.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
