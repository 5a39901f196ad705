"""Which call site an XLA operation belongs to, read from its ``op_name``.

While ``hx.profile`` traces a step, every call site pushes its label on JAX's name stack (as
``hx.named_scopes()`` does) and tells a :class:`SiteLog` its chain of labels from the root
(``("MLP", "l1")``). The compiled program's ``op_name`` holds the same labels with JAX's own
scopes between and around them: ``jit(step)/transpose(jvp(MLP))/while/body/closed_call/blocks/lin/
dot_general``. :func:`place` walks it: transform wrappers (``jvp(...)``, ``transpose(...)``) are
unwrapped, the labels the log knows are matched in order, and everything else is skipped. An
operation under ``transpose(`` is part of the backward pass; one whose call site sits inside a
``while`` loop entered by its caller (``nnx.scan``/``lax.scan`` over stacked layers) is one layer
of a scanned stack.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = ["Place", "SiteLog", "place"]

_WRAPPED = re.compile(r"([\w.\-]+)\((.*)\)", re.S)


@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """A call site the trace met: its key, its module's type, its method, whether it runs
    inside a scan entered within the model's call (one layer of a scanned stack)."""

    key: str
    type: str
    method: str
    in_scan: bool


class SiteLog:
    """The call sites a trace met, by chain of scope labels, in call order."""

    def __init__(self) -> None:
        self.sites: dict[tuple[str, ...], SiteInfo] = {}
        self._trie: dict[str, Any] | None = None
        self.unrolled = False  # whether the program holds a scan with unroll > 1

    def add(self, chain: tuple[str, ...], ctx: Any, in_scan: bool) -> None:
        if chain not in self.sites:
            info = SiteInfo(ctx.key, type(ctx.module).__name__, ctx.method, in_scan)
            self.sites[chain] = info
            self._trie = None

    def trie(self) -> dict[str, Any]:
        """label -> (its parts, the chain so far, the labels below it)."""
        if self._trie is None:
            root: dict[str, Any] = {}
            for chain in self.sites:
                node = root
                for i, label in enumerate(chain):
                    entry = node.setdefault(label, (label.split("/"), chain[: i + 1], {}))
                    node = entry[2]
            self._trie = root
        return self._trie


@dataclasses.dataclass(frozen=True)
class Place:
    """Where an operation belongs: the chain of its call site (``()``: outside every call
    site), forward or backward, and how deep in the chain a scanned stack starts (None: not in
    one; the call site at that depth, and those inside it, run once per layer). ``nested``: a
    loop inside the scanned layers as well (its iterations are not told apart)."""

    chain: tuple[str, ...]
    backward: bool
    scanned: int | None
    nested: bool = False


def _parts(op_name: str) -> tuple[list[str], bool]:
    """The name's parts, transform wrappers removed, and whether ``transpose`` wraps any."""
    parts: list[str] = []
    backward = False
    depth, start = 0, 0
    pieces = []
    for i, ch in enumerate(op_name):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "/" and depth == 0:
            pieces.append(op_name[start:i])
            start = i + 1
    pieces.append(op_name[start:])
    for piece in pieces:
        m = _WRAPPED.fullmatch(piece)
        while m is not None:
            backward |= m.group(1) == "transpose"
            piece = m.group(2)
            m = _WRAPPED.fullmatch(piece)
        parts += [p for p in piece.split("/") if p]
    return parts, backward


def place(op_name: str, log: SiteLog) -> Place:
    """Where the operation named ``op_name`` belongs (see the module's docstring).

    Examples:
      >>> class Ctx:
      ...     def __init__(self, key): self.key, self.module, self.method = key, None, "__call__"
      >>> log = SiteLog()
      >>> log.add(("Net",), Ctx(""), False)
      >>> log.add(("Net", "blocks"), Ctx("blocks"), True)
      >>> log.add(("Net", "blocks", "lin"), Ctx("blocks/lin"), True)
      >>> place("jit(step)/transpose(jvp(Net))/while/body/closed_call/blocks/lin/dot_general", log)
      Place(chain=('Net', 'blocks', 'lin'), backward=True, scanned=1, nested=False)
      >>> place("jit(step)/jvp()/reduce_sum", log)
      Place(chain=(), backward=False, scanned=None, nested=False)
    """
    parts, backward = _parts(op_name)
    node = log.trie()
    chain: tuple[str, ...] = ()
    scanned: int | None = None
    nested = loop = False
    i = 0
    while i < len(parts):
        hit = None
        for entry in node.values():
            n = len(entry[0])
            if parts[i : i + n] == entry[0] and (hit is None or n > len(hit[0])):
                hit = entry
        if hit is None:
            loop |= bool(chain) and parts[i] == "while"
            i += 1
            continue
        if loop and scanned is not None:
            nested = True
        elif loop and log.sites[hit[1]].in_scan:
            scanned = len(chain)
        loop = False
        i += len(hit[0])
        chain, node = hit[1], hit[2]
    if loop and scanned is not None:  # a loop inside the layer's own operations
        nested = True
    return Place(chain, backward, scanned, nested)
