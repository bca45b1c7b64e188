"""`python -m servelab.cli`: the `servelab` command."""

from servelab.cli import main

if __name__ == "__main__":
    main()
