"""``hookax harvest``: activations of a model over random batches, into a store on disk.

    hookax harvest --example transformer --where "layers/*/mlp" --batches 100 --out acts.zarr
    hookax harvest mypkg.models:make_model --input "f32[32,784]" --where "**" --batches 10 --out a
    hookax harvest model.py:make --input "i32[4,128]" --kw train=false --eval --out a

The command line's model options (``add_model_arguments``: a factory, also a file's, or
``--example``, ``--input``, ``--kw``, ``--eval``), model loading and error style
(:mod:`hookax._cli.common`) are reused; this module only adds the subcommand's arguments and its
run.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._util.words import counted

__all__ = ["add_parser", "run"]

HELP = "run a model over batches (random, or --tokens FILE) and store chosen layers' outputs"
# One paragraph per line: argparse wraps them at the terminal's width (helptext.HelpFormatter).
SAFETY = (
    "safety:\n"
    "  --out must be a new folder, an empty one, or a hookax store. Any other folder is refused "
    "with its contents listed and every file left as it was; so are the current folder, the "
    "home folder and the folders above them. --overwrite replaces only a hookax store that "
    "holds nothing but what hookax wrote.\n"
    "\n"
    "what survives an interruption:\n"
    "  Every committed batch, whatever stopped the run (Ctrl-C, a kill, a full disk). Ctrl-C "
    "exits with status 130 and one line: how many batches the store holds. Run the same command "
    "again: it resumes after the last committed batch and ends as an uninterrupted run would.\n"
    "\n"
    "store faults:\n"
    "  A --out that cannot be written (a file on its path, a read-only or full disk, a folder "
    "moved or replaced while the run writes) is one line naming --out, the cause and the batch "
    "reached, exit status 2; the committed batches are kept, and the same command resumes once "
    "the cause is fixed."
)


def add_parser(sub: Any) -> None:
    from .common import add_model_arguments

    c = sub.add_parser(
        "harvest",
        help=HELP,
        description=HELP,
        epilog=SAFETY,
    )
    add_model_arguments(c)  # the factory or --example, --input, --kw, --eval
    c.add_argument("--where", default=None, help='call sites to store: a path glob ("layers/*")')
    c.add_argument("--batches", type=int, help="how many batches (random: 10, --tokens: all)")
    c.add_argument("--out", required=True, help="the store's folder")
    c.add_argument("--dtype", default=None, help="store floats as this dtype (bf16, f16, f32)")
    c.add_argument(
        "--row-axes", type=int, default=None, help="leading axes of each row (2: tokens)"
    )
    c.add_argument("--seed", type=int, default=0, help="seed of the random batches")
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the hookax store at --out (never a folder hookax did not write)",
    )
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--tokens", help="batches of token ids from a .npy, .npz or .jsonl file")
    c.add_argument("--batch-size", type=int, default=8, help="with --tokens: sequences a batch")
    c.add_argument("--seq-len", type=int, help="with --tokens: tokens a sequence (the longest)")
    c.add_argument("--pad-id", type=int, default=0, help="with --tokens: the padding token id")


def run(args: argparse.Namespace) -> None:
    from .interrupt import describing

    with describing(lambda: kept(args.out)):  # Ctrl-C says what the store holds
        _run(args)


def kept(out: str) -> str:
    """What a store holds after Ctrl-C, and how to go on (the line after ``interrupted: ``)."""
    from pathlib import Path

    from .._harvest.store import committed_batches

    try:
        n = committed_batches(Path(out))
    except (OSError, ValueError, KeyError):  # no store (yet)
        n = 0
    if not n:
        return f"no batch committed to --out {out!r}; run the same command again to start"
    s, are = ("es", "are") if n != 1 else ("", "is")
    return (
        f"{n} batch{s} committed to --out {out!r} {are} kept; run the same command again to "
        f"resume at batch {n}"
    )


def _run(args: argparse.Namespace) -> None:
    from .._diagnostics.gradflow import random_inputs
    from .._harvest.harvest import harvest
    from .._harvest.tokens import TokenBatches, TokenModel, token_mask
    from .._util.errors import HookaxError
    from .._util.specs import DTYPES
    from . import common as _cli
    from .interrupt import graceful

    if args.batches is not None and args.batches < 1:
        raise _cli.UsageError(f"--batches takes an integer >= 1, got {args.batches}")
    if args.row_axes is not None and args.row_axes < 1:
        raise _cli.UsageError(f"--row-axes takes an integer >= 1, got {args.row_axes}")
    dtype = None
    if args.dtype is not None:
        if args.dtype not in DTYPES:
            raise _cli.UsageError(
                f"--dtype takes one of {', '.join(sorted(DTYPES))}, got {args.dtype!r}"
            )
        dtype = DTYPES[args.dtype]
    tokens = None
    if args.tokens is not None:
        try:
            tokens = TokenBatches(
                args.tokens, args.batch_size, args.seq_len, args.pad_id, args.batches
            )
        except HookaxError as e:
            raise _cli.UsageError(f"--tokens: {_cli._first_line(e)}") from None
        args.input = args.input or [tokens.spec]
    loaded = _cli.load_nnx_or_equinox(args, "harvest runs", linen=True)
    _cli.check_call(loaded)
    model, specs = loaded.model, loaded.args
    kwargs = _cli._concrete_kwargs(loaded.kwargs, args.seed)
    try:
        model = _cli.bind_linen(
            model, random_inputs(specs, args.seed, loaded.int_high), kwargs, args.seed
        )
    except Exception as e:
        raise _cli.command_error(e, loaded) from None
    fn: Any = model
    if loaded.kwargs:  # the same keyword arguments for every batch
        fn = _Call(model, kwargs)
    batches: Any = _Random(specs, args.seed, loaded.int_high, args.batches or 10)
    cli: dict[str, Any] = {"input": [_spec(s) for s in specs], "seed": args.seed}
    if tokens is not None:
        fn, batches, cli = TokenModel(fn), tokens, {**cli, **tokens.describe()}
    if args.kw:
        cli["kw"] = list(args.kw)
    if args.eval:
        cli["eval"] = True
    try:
        with graceful(lambda: kept(args.out)):  # Ctrl-C: the batches handed over commit
            h = harvest(
                fn,
                batches,
                where=args.where,
                store=args.out,
                dtype=dtype,
                row_axes=args.row_axes or (2 if tokens is not None else 1),
                mask=token_mask if tokens is not None else None,
                overwrite=args.overwrite,
                metadata={"cli": cli},
                progress=False if args.no_progress else None,
            )
    except Exception as e:
        raise _cli.command_error(e, loaded, args.where) from None
    from .._harvest.progress import shown

    _report(h, final_line_shown=shown(False if args.no_progress else None))


class _Random:
    """``n`` batches of random inputs for ``specs``, made one at a time (a length: the progress
    bar's total)."""

    def __init__(self, specs: tuple[Any, ...], seed: int, int_high: int, n: int) -> None:
        self.specs, self.seed, self.int_high, self.n = specs, seed, int_high, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        from .._diagnostics.gradflow import random_inputs

        for i in range(self.n):
            yield random_inputs(self.specs, self.seed + i, self.int_high)


class _Call:
    """``model(*batch, **kwargs)``: a named callable (a store records what ran; a lambda's
    name would do too, but says less)."""

    def __init__(self, model: Any, kwargs: dict[str, Any]) -> None:
        self.model, self.kwargs = model, kwargs

    def __call__(self, *args: Any) -> Any:
        return self.model(*args, **self.kwargs)


def _spec(s: Any) -> str:
    from .._util.specs import format_spec

    return format_spec(tuple(s.shape), s.dtype)


def _report(h: Any, final_line_shown: bool) -> None:
    """What was stored (``(model)`` for the model's own output), and the run in one line unless
    the progress already ended with it (one set of figures, one throughput)."""
    import json

    meta = json.loads((h.store / "hookax.json").read_text())
    names = {name: name or "(model)" for name in h.names}
    width = max(len(n) for n in names.values())
    for name, shown in names.items():
        a = meta["arrays"][name]
        print(f"{shown:<{width}}  {a['dtype']}[{h.rows},{','.join(map(str, a['shape']))}]")
    if h.resumed_at >= h.batches:  # every batch asked for was there already
        print(
            f"{h.store} already holds {counted(h.batches, 'batch')} "
            f"({counted(h.rows, 'row', ',')}): nothing to compute. "
            f"A larger --batches adds batches after them; --overwrite starts again."
        )
        return
    print(f"wrote {h.store}" + ("" if final_line_shown else f": {h.describe()}"))
