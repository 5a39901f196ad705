"""``python -m hookax``: the same as the ``hookax`` command."""

import sys

from ._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
