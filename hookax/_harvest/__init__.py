"""``hx.harvest``: activations of many batches appended to a zarr v3 store. ``harvest`` runs the
loop; ``step`` is the jitted step on the device; ``write`` the writer thread; ``store`` the on-disk
layout and its commit protocol; ``chunks`` one process's direct chunk-file appends. For training
on a store: ``tokens`` (batches of token files), ``opened`` (``hx.open_store``), ``reader``
(``hx.StoreReader``, shuffled batches on grain) and ``splice`` (``hx.splice_eval``).

May import: :mod:`hookax._util`, :mod:`hookax._engine`, :mod:`hookax._transforms`,
:mod:`hookax._hooks`, :mod:`hookax.frameworks`, :mod:`hookax._capture`.
"""
