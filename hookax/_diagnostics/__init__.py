"""Diagnostics built on capture and activation gradients: gradient flow per layer
(``gradflow``: ``hx.grad_flow``, ``hx.plot_grad_flow``); statistics of every layer inside a
train step (``stats``: ``hx.value_grad_and_stats``), their TensorBoard logger (``logger``:
``hx.StatsLogger``, ``hx.read_events``).

May import: everything below the CLI (:mod:`hookax._util`, :mod:`hookax._engine`,
:mod:`hookax._transforms`, :mod:`hookax._hooks`, :mod:`hookax.frameworks`, :mod:`hookax._capture`,
:mod:`hookax._summary`, :mod:`hookax._harvest`).
"""
