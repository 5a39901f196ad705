"""Diagnostics built on capture and activation gradients: gradient flow per layer
(``gradflow``: ``hx.grad_flow``, ``hx.plot_grad_flow``).

May import: everything below the CLI (:mod:`hookax._util`, :mod:`hookax._engine`,
:mod:`hookax._transforms`, :mod:`hookax._hooks`, :mod:`hookax.frameworks`, :mod:`hookax._capture`,
:mod:`hookax._summary`, :mod:`hookax._harvest`).
"""
