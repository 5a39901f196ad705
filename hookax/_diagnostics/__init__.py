"""Diagnostics built on capture and activation gradients: gradient flow per layer
(``gradflow``: ``hx.grad_flow``, ``hx.plot_grad_flow``); statistics of every layer inside a
train step (``stats``: ``hx.value_grad_and_stats``), their TensorBoard logger (``logger``:
``hx.StatsLogger``, ``hx.read_events``).

May import: everything below the CLI (``hookax._util``, ``hookax._engine``,
``hookax._transforms``, ``hookax._hooks``, ``hookax.frameworks``, ``hookax._capture``,
``hookax._summary``, ``hookax._harvest``).
"""
