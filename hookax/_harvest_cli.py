"""``hookax harvest``: activations of a model over random batches, into a store on disk.

    hookax harvest --example transformer --where "layers/*/mlp" --batches 100 --out acts.zarr
    hookax harvest mypkg.models:make_model --input "f32[32,784]" --where "**" --batches 10 --out a

The command line's own model loading and error style (:mod:`hookax._cli`) are reused; this module
only adds the subcommand's arguments and its run.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]

HELP = "run a model over random batches and store chosen layers' outputs (zarr v3)"


def add_parser(sub: Any) -> None:
    from .examples import NAMES

    c = sub.add_parser("harvest", help=HELP, description=HELP)
    c.add_argument(
        "factory",
        nargs="?",
        help="package.module:function returning an nnx.Module (called with no arguments)",
    )
    c.add_argument("--example", help=f"a built-in example: {', '.join(NAMES)}")
    c.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SPEC",
        help='one batch\'s input like "f32[8,784]"; repeat for several positional arguments',
    )
    c.add_argument("--where", default=None, help='call sites to store: a path glob ("layers/*")')
    c.add_argument("--batches", type=int, default=10, help="how many random batches")
    c.add_argument("--out", required=True, help="the store's folder")
    c.add_argument("--dtype", default=None, help="store floats as this dtype (bf16, f16, f32)")
    c.add_argument("--row-axes", type=int, default=1, help="leading axes of each row (2: tokens)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random batches")
    c.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> None:
    from . import _cli
    from ._errors import HookaxError
    from ._gradflow import random_inputs
    from ._harvest import harvest
    from ._specs import DTYPES

    if args.batches < 1:
        raise _cli.UsageError(f"--batches takes an integer >= 1, got {args.batches}")
    dtype = None
    if args.dtype is not None:
        if args.dtype not in DTYPES:
            raise _cli.UsageError(
                f"--dtype takes one of {', '.join(sorted(DTYPES))}, got {args.dtype!r}"
            )
        dtype = DTYPES[args.dtype]
    model, specs, int_high = _cli._model(args, abstract=False)
    batches = (random_inputs(specs, args.seed + i, int_high) for i in range(args.batches))
    try:
        h = harvest(
            model,
            batches,
            where=args.where,
            store=args.out,
            dtype=dtype,
            row_axes=args.row_axes,
            overwrite=args.overwrite,
            metadata={"cli": {"input": [_spec(s) for s in specs], "seed": args.seed}},
            progress=False if args.no_progress else None,
        )
    except HookaxError as e:
        raise _cli.UsageError(_cli._first_line(e)) from None
    except Exception as e:
        raise _cli._rejected(e, specs) from None
    _report(h)


def _spec(s: Any) -> str:
    from ._specs import format_spec

    return format_spec(tuple(s.shape), s.dtype)


def _report(h: Any) -> None:
    import json

    meta = json.loads((h.store / "hookax.json").read_text())
    width = max(len(n) for n in h.names)
    for name in h.names:
        a = meta["arrays"][name]
        print(f"{name:<{width}}  {a['dtype']}[{h.rows},{','.join(map(str, a['shape']))}]")
    rate = h.bytes / 1e6 / max(h.seconds, 1e-9)
    resumed = f", resumed at batch {h.resumed_at}" if h.resumed_at else ""
    print(
        f"wrote {h.store}: {h.batches} batches, {h.rows:,} rows, {h.bytes / 1e6:.1f} MB in "
        f"{h.seconds:.1f} s ({rate:.3g} MB/s{resumed})"
    )
