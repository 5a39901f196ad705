"""The ``hookax`` command line: ``main`` (the parser, model loading shared by every subcommand,
``summary`` and ``gradflow``), ``harvest`` and ``ops`` (their subcommands), ``failures`` (how a
failure of the model's run is worded).

May import: every other part of hookax (it is the top layer), and :mod:`hookax.examples`.
"""
