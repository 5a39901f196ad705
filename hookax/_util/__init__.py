"""Leaf utilities every layer uses: the error family (``errors``), the missing-extra error
(``extras``), value-stable keys of functions for jit caches (``fnkey``) and array specs such as
``"f32[8,784]"`` (``specs``).

May import: nothing of hookax.
"""
