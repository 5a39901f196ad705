"""Names users choose for call sites, their inputs and operations: ``hx.names({...})``.

A :class:`Name` is a ``str`` (the address it stands for), so it goes wherever an address goes,
in every ``where=`` and ``ops=`` of every API, with no API knowing about names. It also carries
the axes of its value (``("batch", "pos", "head", "d_head")``), so ``heads=``/``axis=`` can be
given by name (:meth:`Names.axis`), and its kind: a call site's output, its input
(``"blocks/*:in"``), or an operation (``"blocks/*/attn:softmax"``). :meth:`Names.capture`
keys results by name, every layer of a name on one leading axis (unrolled layers and a scanned
stack alike), as TransformerLens' ``run_with_cache`` keys its cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .._capture.capture import capture
from .._engine.select import Select, split_layers, split_method
from .._patching.cache import stack_layers
from .._util.errors import HookaxError

__all__ = ["Name", "Names", "names"]

KINDS = ("site", "input", "op")


class Name(str):
    """An address with a name, the axes of its value and its kind (``"site"``, ``"input"``,
    ``"op"``). A ``str``: ``where=names.attn_out`` is ``where="blocks/*/attn"``."""

    name: str
    axes: tuple[str, ...] | None
    kind: str

    def __new__(
        cls, address: str, *, name: str = "", axes: Any = None, kind: str | None = None
    ) -> Name:
        self = super().__new__(cls, address)
        self.name = name
        self.axes = tuple(axes.split()) if isinstance(axes, str) else axes and tuple(axes)
        self.kind = kind or _kind(address)
        if self.kind not in KINDS:
            raise HookaxError(f"hx.names: kind= takes one of {KINDS}, got {kind!r}.")
        return self

    def __reduce__(self) -> Any:
        return (_rebuild, (str(self), self.name, self.axes, self.kind))

    def layer(self, i: int) -> Name:
        """The address of one layer: the first ``*`` segment of the path replaced by ``i``
        (``"blocks/*/attn"`` -> ``"blocks/3/attn"``), or for a scanned stack's key the layer
        suffix (``"blocks/attn"`` -> ``"blocks/attn[3]"``)."""
        path, method = split_method(str(self))
        segs = path.split("/")
        if "*" in segs:
            segs[segs.index("*")] = str(i)
            path = "/".join(segs)
        elif any("*" in s for s in segs):  # "blocks_*" (Linen's list names)
            j = next(k for k, s in enumerate(segs) if "*" in s)
            segs[j] = segs[j].replace("*", str(i), 1)
            path = "/".join(segs)
        else:
            path = f"{split_layers(path)[0]}[{i}]"
        return Name(
            f"{path}:{method}" if method else path, name=self.name, axes=self.axes, kind=self.kind
        )


def _rebuild(address: str, name: str, axes: Any, kind: str) -> Name:
    return Name(address, name=name, axes=axes, kind=kind)


def _kind(address: str) -> str:
    _, method = split_method(address)
    if not method:
        return "site"
    return "input" if method == "in" else "op"


class Names(Mapping[str, Name]):
    """A table of names (``names["pattern"]``, ``names.pattern``), built by
    [`hx.names`][hookax.names]. ``n_heads``: the model's number of heads, where known (heads
    grids check their head axis against it)."""

    def __init__(self, table: Mapping[str, Any], n_heads: int | None = None) -> None:
        if n_heads is not None and (
            isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1
        ):
            raise HookaxError(f"hx.names: n_heads= takes a positive int or None, got {n_heads!r}.")
        self.n_heads = n_heads
        self._table: dict[str, Name] = {}
        for key, entry in table.items():
            if isinstance(entry, Name):
                entry = Name(str(entry), name=key, axes=entry.axes, kind=entry.kind)
            elif isinstance(entry, str):
                entry = Name(entry, name=key)
            elif isinstance(entry, tuple) and len(entry) == 2:
                entry = Name(entry[0], name=key, axes=entry[1])
            else:
                raise HookaxError(
                    f"hx.names: {key!r} maps to {entry!r}; an entry is an address "
                    f"('blocks/*/attn'), (address, axes) ('blocks/*/attn/query', 'batch pos head "
                    f"d_head') or hx.Name(address, axes=..., kind=...)."
                )
            self._table[key] = entry

    def __getitem__(self, key: str) -> Name:
        try:
            return self._table[key]
        except KeyError:
            raise KeyError(f"no name {key!r}; the names are {', '.join(self._table)}") from None

    def __getattr__(self, key: str) -> Name:
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(str(e)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        rows = [
            f"  {k!r}: {str(v)!r}" + (f" ({' '.join(v.axes)})" if v.axes else "")
            for k, v in self._table.items()
        ]
        return "hx.names({\n" + ",\n".join(rows) + "\n})"

    def __or__(self, other: Mapping[str, Any]) -> Names:
        n_heads = getattr(other, "n_heads", None) or self.n_heads
        return Names({**self._table, **other}, n_heads=n_heads)

    def act(self, name: str, layer: int | None = None) -> Name:
        """The address of ``name`` at ``layer`` (TransformerLens' ``get_act_name("z", 1)``);
        without a layer, every layer's."""
        n = self[name]
        return n if layer is None else n.layer(layer)

    def axis(self, name: str, axis: str) -> int:
        """The index of axis ``axis`` in one call's value of ``name`` (for ``heads=``/
        ``axis=``): ``names.axis("pattern", "head")``."""
        n = self[name]
        if not n.axes or axis not in n.axes:
            raise HookaxError(
                f"hx.names: {name!r} has axes {n.axes}, not {axis!r}. Fix: name its axes, "
                f"hx.names({{{name!r}: ({str(n)!r}, 'batch pos head d_head')}})."
            )
        return n.axes.index(axis)

    def capture(self, fn: Callable[..., Any], *which: str) -> Callable[..., tuple[Any, Any]]:
        """``y, cache = names.capture(fn, "resid_pre", "pattern")(*args)``: ``cache[name]``
        holds every layer's value on a leading axis (``hx.stack_layers``); a name matching
        one call is that call's value. No names: every name of the table."""
        picked = [self[w] for w in (which or tuple(self))]
        sites = tuple({split_method(str(n))[0] for n in picked if n.kind != "op"})
        ops = [str(n) for n in picked if n.kind == "op"]
        inputs = any(n.kind == "input" for n in picked)
        kw: dict[str, Any] = {"inputs": inputs}
        if sites:
            kw["where"] = Select(paths=sites)
        if ops:
            kw["ops"] = ops
        forward = capture(fn, **kw)

        def run(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
            y, acts = forward(*args, **kwargs)
            acts = {k: _first(v) if k.endswith(":in") else v for k, v in acts.items()}
            return y, {n.name: stack_layers(acts, str(n)) for n in picked}

        return run


def _first(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v[0] if isinstance(v, tuple) else v for v in values)


def names(table: Mapping[str, Any] | None = None, **entries: Any) -> Names:
    """A table of names for addresses: call sites, their inputs (``"key:in"``) and operations.

    Each entry is an address, ``(address, axes)`` with the axes of one call's value as a
    space-separated string or a tuple, or an [`hx.Name`][hookax.Name]. An address with
    ``:in`` names a call's input, another ``:suffix`` an operation (``"blocks/*/attn:softmax"``);
    a method other than ``__call__`` needs ``hx.Name("enc:encode", kind="site")``. Names are
    strings: pass them to any ``where=``/``ops=``.

    Examples:
      >>> import hookax as hx
      >>> nm = hx.names({"attn_out": "blocks/*/attn",
      ...                "pattern": ("blocks/*/attn:softmax", "batch head query key")})
      >>> nm.attn_out, nm.act("pattern", 1), nm.axis("pattern", "head")
      ('blocks/*/attn', 'blocks/1/attn:softmax', 1)
      >>> nm.pattern.kind, hx.names(z="blocks/attn/out:in").act("z", 0)
      ('op', 'blocks/attn/out[0]:in')
    """
    return Names({**(table or {}), **entries})


_HEADS = "batch pos head d_head"
_ATTENTION: dict[str, dict[str, tuple[str, str]]] = {
    # the layout of each library's attention module: where q, k, v, the pattern and z (the
    # heads' outputs before the output projection) are, as a suffix of the module's address,
    # with the axes of one call's value
    "nnx": {  # under a vmap over head groups: the pattern's leading group axis
        "q": ("/query", _HEADS),
        "k": ("/key", _HEADS),
        "v": ("/value", _HEADS),
        "pattern": (":softmax", "group batch head query key"),
        "z": ("/out:in", _HEADS),
    },
    "linen": {
        "q": ("/query", _HEADS),
        "k": ("/key", _HEADS),
        "v": ("/value", _HEADS),
        "pattern": (":softmax", "batch head query key"),
        "z": ("/out:in", _HEADS),
    },
    # eqx.nn.MultiheadAttention, on one example: its projections concatenate the heads (their
    # outputs are split by the reshapes of _project, in the order q, k, v) and its output
    # projection takes them concatenated again; per head, dot_product_attention's softmax
    # and its second matmul (probabilities @ values) under a vmap over heads, head axis first
    "equinox": {
        "q": (":reshape", "pos head d_head"),
        "k": (":reshape#1", "pos head d_head"),
        "v": (":reshape#2", "pos head d_head"),
        "pattern": (":softmax", "head query key"),
        "z": (":dot_general#1", "head pos d_head"),
    },
}


def transformer_names(
    blocks: str = "blocks/*",
    *,
    attn: str = "attn",
    mlp: str = "mlp",
    attention: str = "nnx",
    embed: str | None = "embed",
    pos_embed: str | None = None,
    final_norm: str | None = "ln_f",
    n_heads: int | None = None,
) -> Names:
    """TransformerLens' hook names for a transformer whose blocks hold an attention module of
    a library, with the axes of each value named.

    ``attention``: ``"nnx"`` (``nnx.MultiHeadAttention``) or ``"linen"``
    (``nn.MultiHeadDotProductAttention``): ``q``/``k``/``v`` are its projections' outputs
    ``(batch, pos, head, d_head)``, ``pattern`` the probabilities (Flax NNX computes them
    under a ``vmap`` over head groups: a leading ``group`` axis), ``z`` the heads' outputs
    entering the output projection. ``"equinox"`` (``eqx.nn.MultiheadAttention``): operations
    inside the module, which runs on one example, so every name's axes are one example's (no
    ``batch``), as patches inside ``jax.vmap(model)`` index them (a capture puts the vmap's
    batch axis in front): ``q``/``k``/``v`` ``(pos, head, d_head)``, ``pattern`` ``(head,
    query, key)``, ``z`` ``(head, pos, d_head)``. ``None`` for attention of your own (add its
    names with ``|``). Every layout has ``embed``, ``pos_embed``, ``resid_pre`` (a block's
    input), ``resid_post``, ``attn_out``, ``mlp_out`` and ``ln_final`` (the final norm's
    output). ``n_heads``, the model's number of heads, makes every heads grid of these names
    (``hx.patch_head_every``) check that its head axis has that size: an operation whose
    value holds the heads on another axis, or lumped with another, raises instead of giving a
    grid of something else.

    Examples:
      >>> import hookax as hx
      >>> nm = hx.transformer_names("blocks/*", attention="nnx")
      >>> nm.act("z", 1), nm.axis("z", "head"), nm.axis("pattern", "query")
      ('blocks/1/attn/out:in', 2, 3)
      >>> eq = hx.transformer_names("blocks/*", attention="equinox")
      >>> eq.act("z", 1), eq.axis("z", "head"), eq.resid_pre.axes
      ('blocks/1/attn:dot_general#1', 0, ('pos', 'd_model'))
    """
    resid = "pos d_model" if attention == "equinox" else "batch pos d_model"
    table: dict[str, Any] = {
        "resid_pre": (f"{blocks}:in", resid),
        "resid_post": (blocks, resid),
        "attn_out": (f"{blocks}/{attn}", resid),
    }
    if mlp:
        table["mlp_out"] = (f"{blocks}/{mlp}", resid)
    if embed:
        table["embed"] = (embed, resid)
    if pos_embed:
        table["pos_embed"] = (pos_embed, "pos d_model")
    if final_norm:
        table["ln_final"] = (final_norm, resid)
    if attention is not None:
        if attention not in _ATTENTION:
            raise HookaxError(
                f"hx.transformer_names: attention= takes {', '.join(map(repr, _ATTENTION))} or "
                f"None (attention of your own: add its names with |), got {attention!r}."
            )
        a = f"{blocks}/{attn}"
        table |= {k: (f"{a}{suffix}", axes) for k, (suffix, axes) in _ATTENTION[attention].items()}
    return Names(table, n_heads=n_heads)
