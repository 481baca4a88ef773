"""`python -m kvflow.entrypoints.cli ...` is the `kvflow` command."""

from kvflow.entrypoints.cli.main import main

if __name__ == "__main__":
    main()
