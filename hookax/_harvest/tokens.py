"""Token batches from local files, for ``hx.harvest`` and ``hookax harvest --tokens``.

A language model's activations come from a token dataset, not from random batches. The files
users have: a ``.npy`` token array, a ``.npz`` with a ``tokens`` array (and optionally ``mask``
or ``lengths``), or a ``.jsonl`` file with one sequence of token ids per line. Every batch has
the same shape ``(batch_size, seq_len)`` (so the jitted step compiles once), padded with
``pad_id``, with a boolean mask that is False on padding; harvest's ``mask=`` drops those rows.

Examples:
  >>> import pathlib, tempfile, numpy as np
  >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.jsonl"
  >>> _ = path.write_text("[5, 6, 7]\\n[8]\\n[9, 10]\\n")
  >>> batches = list(token_batches(path, batch_size=2, seq_len=3))
  >>> batches[0]
  (array([[5, 6, 7],
         [8, 0, 0]], dtype=int32), array([[ True,  True,  True],
         [ True, False, False]]))
  >>> batches[1][0], batches[1][1].sum()  # the last batch is padded with empty sequences
  (array([[ 9, 10,  0],
         [ 0,  0,  0]], dtype=int32), np.int64(2))
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._util.errors import HookaxError

__all__ = ["read_sequences", "token_batches"]

SUFFIXES = (".npy", ".npz", ".jsonl")


def _error(path: Path, what: str) -> HookaxError:
    return HookaxError(f"token file {str(path)!r}: {what}")


def _jsonl(path: Path) -> list[np.ndarray]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as e:
                raise _error(path, f"line {i} is not JSON ({e}).") from None
            if isinstance(item, dict):
                found = [k for k in ("tokens", "input_ids", "ids") if k in item]
                if not found:
                    raise _error(
                        path,
                        f"line {i} is an object without 'tokens', 'input_ids' or 'ids' (keys "
                        f"{sorted(item)}). Fix: one list of token ids per line, or an object "
                        f'with one of those keys: {{"tokens": [1, 2, 3]}}.',
                    )
                item = item[found[0]]
            seq = np.asarray(item)
            if seq.ndim != 1 or (seq.size and not np.issubdtype(seq.dtype, np.integer)):
                raise _error(path, f"line {i} is not a flat list of integer token ids.")
            out.append(seq.astype(np.int64))
    return out


def _rows(tokens: np.ndarray, mask: np.ndarray | None, path: Path) -> list[np.ndarray]:
    if not np.issubdtype(tokens.dtype, np.integer):
        raise _error(path, f"holds {tokens.dtype} values, not integer token ids.")
    if tokens.ndim == 1:
        return [tokens]  # one stream of tokens: cut into seq_len pieces
    if tokens.ndim != 2:
        raise _error(
            path, f"holds an array of shape {tokens.shape}; token ids are (sequences, length)"
        )
    if mask is None:
        return list(tokens)
    if mask.shape != tokens.shape:
        raise _error(path, f"its mask has shape {mask.shape}, its tokens {tokens.shape}.")
    return [row[m.astype(bool)] for row, m in zip(tokens, mask)]


def read_sequences(path: str | Path) -> list[np.ndarray]:
    """The token sequences a file holds, without padding.

    ``.npy``: a ``(sequences, length)`` integer array (every row whole) or a 1-D stream.
    ``.npz``: ``tokens`` (or its only array), with ``mask`` (True on real tokens) or
    ``lengths`` (each row's count of real tokens) when rows are padded. ``.jsonl``: one list of
    token ids per line, or an object with ``tokens``/``input_ids``/``ids``.
    """
    p = Path(path)
    if p.suffix not in SUFFIXES:
        raise _error(p, f"has suffix {p.suffix!r}; token files are {', '.join(SUFFIXES)}.")
    if not p.is_file():
        raise _error(p, "does not exist.")
    if p.suffix == ".jsonl":
        return _jsonl(p)
    if p.suffix == ".npy":
        return _rows(np.load(p, allow_pickle=False), None, p)
    with np.load(p, allow_pickle=False) as z:
        names = list(z.files)
        key = "tokens" if "tokens" in names else (names[0] if len(names) == 1 else None)
        if key is None:
            raise _error(p, f"holds {names} and no 'tokens' array. Fix: save it as tokens=...")
        tokens = z[key]
        mask = z["mask"] if "mask" in names else None
        if mask is None and "lengths" in names:
            lengths = z["lengths"]
            mask = np.arange(tokens.shape[-1])[None, :] < np.asarray(lengths)[:, None]
    return _rows(tokens, mask, p)


def token_batches(
    path: str | Path,
    *,
    batch_size: int,
    seq_len: int | None = None,
    pad_id: int = 0,
    dtype: Any = np.int32,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches ``(tokens, mask)`` of a token file, for [`hx.harvest`][hookax.harvest].

    Sequences longer than ``seq_len`` are cut into consecutive pieces of ``seq_len`` tokens
    (no token is dropped); shorter ones are padded with ``pad_id`` and masked out. The last
    batch is filled with empty (all-padding) sequences, so every batch has the same shape and
    a jitted step compiles once. Use the mask as harvest's ``mask=`` with ``row_axes=2``::

        hx.harvest(lambda tokens, mask: model(tokens), hx.token_batches(path, batch_size=8),
                   mask=lambda tokens, mask: mask, row_axes=2, store=...)

    Args:
      path: a ``.npy``, ``.npz`` or ``.jsonl`` file (``read_sequences`` says what each holds).
      batch_size: sequences per batch.
      seq_len: tokens per sequence; default the longest sequence of the file.
      pad_id: the token id written where there is no token (the mask is False there).
      dtype: the tokens' dtype.

    Yields:
      ``(tokens, mask)``: numpy arrays of shape ``(batch_size, seq_len)``, ``dtype`` and bool.
    """
    if batch_size < 1:
        raise HookaxError(f"token_batches: batch_size must be >= 1, got {batch_size}")
    seqs = read_sequences(path)
    if seq_len is None:
        seq_len = max((len(s) for s in seqs), default=0)
    if seq_len < 1:
        raise _error(Path(path), "holds no tokens.")
    pieces = [s[i : i + seq_len] for s in seqs for i in range(0, max(len(s), 1), seq_len)]
    pieces = [p for p in pieces if len(p)]
    if not pieces:
        raise _error(Path(path), "holds no tokens.")
    info = np.iinfo(dtype)
    for start in range(0, len(pieces), batch_size):
        tokens = np.full((batch_size, seq_len), pad_id, dtype)
        mask = np.zeros((batch_size, seq_len), bool)
        for r, piece in enumerate(pieces[start : start + batch_size]):
            if piece.min() < info.min or piece.max() > info.max:
                raise _error(Path(path), f"holds token ids outside {np.dtype(dtype).name}.")
            tokens[r, : len(piece)] = piece
            mask[r, : len(piece)] = True
        yield tokens, mask


class TokenBatches:
    """:func:`token_batches` of a file read at once (errors come before any work), iterable
    again; what ``hookax harvest --tokens`` runs on."""

    def __init__(
        self, path: str | Path, batch_size: int, seq_len: int | None, pad_id: int, limit: int | None
    ) -> None:
        self.path, self.pad_id, self.limit = str(path), pad_id, limit
        self.batches = list(
            token_batches(path, batch_size=batch_size, seq_len=seq_len, pad_id=pad_id)
        )
        if limit is not None:
            self.batches = self.batches[:limit]
        self.shape = self.batches[0][0].shape

    @property
    def spec(self) -> str:
        """The input spec of one batch's tokens (``i32[8,128]``)."""
        return f"i32[{self.shape[0]},{self.shape[1]}]"

    def describe(self) -> dict[str, Any]:
        """What a store records about the batches (a resumed run must match it)."""
        return {"tokens": Path(self.path).name, "pad_id": self.pad_id, "input": [self.spec]}

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return iter(self.batches)

    def __len__(self) -> int:  # the progress bar's total
        return len(self.batches)


class TokenModel:
    """``model(tokens)`` for batches ``(tokens, mask)``: a named callable (a store records what
    ran)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, tokens: Any, mask: Any) -> Any:
        return self.model(tokens)


def token_mask(tokens: Any, mask: Any) -> Any:
    """Harvest's ``mask=`` for batches ``(tokens, mask)``: the batch's own mask."""
    return mask
