"""``python -m mcd_helpers``: the command line of :mod:`mcd_helpers.experiments.cli`."""

import sys

from .experiments.cli import main

if __name__ == "__main__":
    sys.exit(main())
