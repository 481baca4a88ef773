"""`python -m kvflow ...` is the `kvflow` command."""

from kvflow.entrypoints.cli import main

if __name__ == "__main__":
    main()
