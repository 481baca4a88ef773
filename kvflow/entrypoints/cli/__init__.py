"""The `kvflow` command line: `generate`, `chat` and `demo` (see `kvflow --help`)."""

from kvflow.entrypoints.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
