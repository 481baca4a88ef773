"""`kvflow`'s entry point: the parser, and the one place that turns user mistakes into exit statuses.

Exit statuses: 0 success; 2 a usage error or a mistake the user can fix (bad flag values, missing files, an
unusable cache folder or device, a configuration the machine cannot hold), printed as one line
`kvflow <command>: error: ...`; 130 interrupted (Ctrl-C); 1 stdout closed early (`kvflow generate ... | head`).
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvflow.entrypoints.cli import bench, chat, demo, generate, serve
from kvflow.entrypoints.cli.args import HelpFormatter, SubcommandParser
from kvflow.entrypoints.cli.engine import CommandError
from kvflow.logger import logging_level_error
from kvflow.version import __version__

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_BROKEN_PIPE = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvflow",
        description="kvflow: a vLLM-V1-style LLM inference engine.",
        epilog="`kvflow COMMAND --help` describes each command.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvflow {__version__}")
    subcommands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=SubcommandParser
    )
    generate.add_parser(subcommands)
    chat.add_parser(subcommands)
    demo.add_parser(subcommands)
    serve.add_parser(subcommands)
    bench.add_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` (default: sys.argv[1:]) and run the command; SystemExit carries a non-zero status."""
    status = _main(argv)
    if status:
        raise SystemExit(status)


def _main(argv: list[str] | None) -> int:
    command = "kvflow"
    try:
        args = build_parser().parse_args(argv)
        command = f"kvflow {args.command}"
        level_error = logging_level_error()
        if level_error is not None:
            raise CommandError(level_error)
        args.handler(args)
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except (CommandError, ValueError, OSError) as error:
        print(f"{command}: error: {one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def one_line(error: BaseException) -> str:
    """The error's message on one line (lines joined by '; '), or its type's name when it has none."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def _discard_stdout() -> None:
    """The reader of stdout went away: point stdout at /dev/null so the interpreter's final flush cannot fail
    (the recipe in Python's signal module documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
