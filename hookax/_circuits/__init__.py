"""Circuits: the residual graph's edges, scored (EAP, EAP-IG) and rewired (circuits).

May import: :mod:`hookax._util`, :mod:`hookax._engine`, :mod:`hookax._transforms`,
:mod:`hookax._hooks`, :mod:`hookax.frameworks`, :mod:`hookax._capture`,
:mod:`hookax._patching`, :mod:`hookax._interp` (the components whose edges it scores).
"""
