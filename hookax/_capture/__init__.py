"""Values out of a model: ``hx.capture`` (``capture``), activation gradients
(``actgrad``: ``hx.value_and_grad``), operations inside call sites (``ops``: patterns, handlers,
``hx.intercept_op``, ``hx.named_scopes``; ``opslist``: ``hx.ops``).

May import: :mod:`hookax._util`, :mod:`hookax._engine`, :mod:`hookax._transforms`,
:mod:`hookax._hooks`, :mod:`hookax.frameworks`.
"""
