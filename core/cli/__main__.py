"""`python -m servelab.cli`: the `servelab` command."""

import sys

from servelab.cli import main

if __name__ == "__main__":
    sys.exit(main())
