"""``python -m hookax``: the same as the ``hookax`` command."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
