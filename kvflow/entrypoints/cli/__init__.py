"""The `kvflow` command line: `generate`, `chat`, `demo` and `serve` (see `kvflow --help`)."""

from kvflow.entrypoints.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
