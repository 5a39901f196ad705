"""The call-site engine: what runs on every intercepted module method call.

``context`` holds the per-thread state (the active entries, the call stack, frames and the public
``hx.Context``); ``select`` parses and matches ``where=`` selectors; ``dispatch`` is the one
function every wrapped method goes through (interceptors outermost first, then the hooks layer and
the method); ``adapters`` is the registry that loads a framework's adapter the first time its
modules are seen. Higher layers plug into the engine through the named
slots of ``plugins`` (``plugins.SLOTS`` lists them and who filled each) instead of being imported
by it.

May import: :mod:`hookax._util`.
"""
