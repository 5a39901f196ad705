"""The machinery that carries values through JAX transforms.

``tags`` is the identity primitive that marks a value (with batching, JVP, transpose and
lowering rules) and the sessions that collect or plant marked values; ``tagrules`` re-traces the
inner jaxprs of higher-order primitives (``pjit``, ``scan``, ``while``, ``cond``, ``remat``,
custom derivatives, ``shard_map``) so marked values leave each one as outputs, and holds the
forwarding ``HarvestTrace`` that applies the rules; ``optrace`` names and edits operations inside a
call site (``"mlp:dot_general#1"``) by re-tracing its method.

May import: :mod:`hookax._util`, :mod:`hookax._engine`.
"""
