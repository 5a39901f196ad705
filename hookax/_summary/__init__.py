"""``hx.summary``: the per-call-site table (``summary``), computed abstractly by tracing the model
with an interceptor (``trace``), its FLOPs and bytes (``cost``), the framework-specific parameter
counting (``frameworks``) and the text and HTML rendering (``render``).

May import: :mod:`hookax._util`, :mod:`hookax._engine`, :mod:`hookax._transforms`,
:mod:`hookax._hooks`, :mod:`hookax.frameworks`, :mod:`hookax._capture`.
"""
