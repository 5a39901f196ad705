"""TransformerLens' conveniences on any JAX model: ``resid`` (``hx.Components``,
``hx.ResidualStream``: residual-stream views of captured values), ``stack`` (``hx.Stack``),
``weights`` (kernels and norms read by call-site path), ``names`` (``hx.names``,
``hx.transformer_names``), ``sweeps`` (``hx.patch_block_every``, ``hx.patch_head_every``) and
``inputs`` (grids over call-site inputs, through forward pre-hooks).

May import: :mod:`hookax._util`, :mod:`hookax._engine`, :mod:`hookax._transforms`,
:mod:`hookax._hooks`, :mod:`hookax.frameworks`, :mod:`hookax._capture`,
:mod:`hookax._patching` (the sweeps are its grids).
"""
