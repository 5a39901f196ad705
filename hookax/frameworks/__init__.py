"""Framework adapters: one module per framework (``_nnx``, ``_linen``, ``_equinox``).

Each makes its framework's module methods call sites: it wraps them once so every call goes
through the dispatcher (:mod:`hookax._engine.dispatch`), walks a model's submodules, and says which
outer modules a module stands for inside the framework's transforms. The registry that loads an
adapter when its framework is first seen is :mod:`hookax._engine.adapters`; adding a framework
means adding one module here, one line there, and passing ``tests/test_conformance.py``.

May import: :mod:`hookax._util`, :mod:`hookax._engine`, :mod:`hookax._hooks` (Linen's own
``nn.intercept_methods`` becomes a hookax interceptor).
"""
