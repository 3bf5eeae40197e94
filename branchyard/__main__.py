"""``python -m branchyard`` -- see :mod:`branchyard.cli`."""

import sys

from branchyard.cli import main

if __name__ == "__main__":
    sys.exit(main())
