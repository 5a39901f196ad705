"""Circuits on the induction model, side by side in one run.

The two-layer attention-only model of ``hookax.examples.induction`` (four heads per layer,
d_model 32; random weights: the times do not depend on them), 32 sequences of 24 tokens, the
corrupted run with the first halves replaced. Median wall times over interleaved rounds (the
first call, which compiles, left out):

* ``eap``: ``hx.edge_attribution``, every edge (the corrupted forward, the clean forward and
  backward); ``eap_ig10``: with ``steps=10``;
* ``attribution``: ``hx.attribution_patch`` over the senders' call sites (the embeddings and each
  attention's output, whole values): node-level scores from one backward pass;
* ``path_grid``: ``hx.path_patch`` from the four layer-0 heads into the twelve query, key and
  value inputs of layer 1, one program; ``path_loop``: the same 48 cells as a loop of
  ``hx.run_circuit`` calls, each with one edge cut (one compiled program, reused);
* ``circuit``: ``hx.run_circuit`` with the top 24 edges; ``forward``: the plain jitted forward.

    python -m benchmarks circuits --json out.json
"""

from __future__ import annotations

from typing import Any

from benchmarks._timing import interleaved, table

ROUNDS = 3


def main() -> dict[str, Any]:
    import jax
    from flax import nnx

    import hookax as hx
    from hookax.examples import induction

    cfg = induction.Config()
    model = induction.AttnOnly(cfg, rngs=nnx.Rngs(0))
    parts = induction.components()
    clean = induction.repeated_tokens(jax.random.key(123), 32, cfg.half, cfg.vocab)
    corrupt = induction.corrupted(jax.random.key(7), clean, cfg.vocab)
    metric = induction.in_context_logprob(clean)
    edges = hx.edge_attribution(model, (clean,), (corrupt,), metric, parts)
    senders = [f"L0H{h}" for h in range(cfg.n_heads)]
    receivers = [f"L1H{h}.{k}" for h in range(cfg.n_heads) for k in "qkv"]
    every = list(edges)
    cuts = [[e for e in every if e != (s, r)] for s in senders for r in receivers]
    top = edges.top(24)
    forward = jax.jit(lambda m, x: m(x))

    def block(x: Any) -> Any:
        return jax.block_until_ready(x)

    configs = {
        "eap": lambda: hx.edge_attribution(model, (clean,), (corrupt,), metric, parts),
        "eap_ig10": lambda: hx.edge_attribution(
            model, (clean,), (corrupt,), metric, parts, steps=10
        ),
        "attribution": lambda: block(
            hx.attribution_patch(
                model,
                (clean,),
                (corrupt,),
                metric,
                where=["embed", "pos_embed", "blocks/*/attn"],
                positions=None,
            )
        ),
        "path_grid": lambda: block(
            hx.path_patch(
                model, (clean,), (corrupt,), metric, parts, senders=senders, receivers=receivers
            )
        ),
        "path_loop": lambda: [
            block(hx.run_circuit(model, (clean,), (corrupt,), cut, parts)) for cut in cuts
        ],
        "circuit": lambda: block(hx.run_circuit(model, (clean,), (corrupt,), top)),
        "forward": lambda: block(forward(model, clean)),
    }
    inner = {"path_loop": 1, "forward": 20, "circuit": 5}
    times = interleaved(configs, rounds=ROUNDS, inner={k: inner.get(k, 2) for k in configs})
    rows = [(name, f"{t * 1e3:.2f} ms") for name, t in times.items()]
    print(f"{len(edges)} edges, {len(cuts)} path-patching cells")
    print(table(rows, ("way", "median time")))
    ratios = {
        "eap_over_attribution": times["eap"] / times["attribution"],
        "path_loop_over_grid": times["path_loop"] / times["path_grid"],
        "circuit_over_forward": times["circuit"] / times["forward"],
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    return {"seconds": times, **ratios, "edges": len(edges)}


if __name__ == "__main__":
    main()
