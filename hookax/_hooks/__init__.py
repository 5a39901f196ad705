"""Hooks and interceptors: ``hx.intercept`` (``intercept``), per-module and scoped PyTorch-style
hooks (``hooks``), the hooks layer the dispatcher runs around a method (``hookrun``), the checks of
what a hook returned (``hookcheck``) and the gradient identities behind backward hooks and
``hx.hook_grad`` (``grad``).

May import: :mod:`hookax._util`, :mod:`hookax._engine`, :mod:`hookax._transforms`.
"""
