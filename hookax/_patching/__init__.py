"""Activation patching: ``patch`` (``hx.patching``: call-site outputs replaced by given values,
at chosen positions), ``grid`` (``hx.patch_grid``: every target x position as batched compiled
programs), ``attribution`` (``hx.attribution_patch``: the same grid to first order, from one
backward pass), ``cache`` (``hx.stack_layers``, ``hx.logit_lens``, ``hx.split_heads``),
``targets`` (``where=`` and ``positions=`` of a grid, found abstractly) and ``compiled``
(functions and modules as arguments of cached compiled programs).

Built on the public features below it (``hx.intercept``, ``hx.capture``, ``hx.value_and_grad``),
not on the engine's internals.

May import: :mod:`hookax._util`, :mod:`hookax._engine`, :mod:`hookax._transforms`,
:mod:`hookax._hooks`, :mod:`hookax.frameworks`, :mod:`hookax._capture`.
"""
