"""``python -m distload``: the command line (distload.cli.main)."""

import sys

from distload.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
