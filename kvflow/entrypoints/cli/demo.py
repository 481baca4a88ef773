"""`kvflow demo`: the hash-model demo (`kvflow.demo`), which checks every output against its oracle."""

from __future__ import annotations

import argparse

from kvflow.entrypoints.cli.args import HelpFormatter

DESCRIPTION = """\
Run many requests through the whole engine on the hash test model (no weights, no
tokenizer) and check every output against the model's reference. The prompts share long
prefixes, so the prefix cache is exercised too. Prints request and token counts,
throughput, prefix-cache hits and how many outputs verified."""


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "demo",
        help="run many requests through the engine on the hash test model",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--num-requests", type=int, default=400, help="requests to run")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per request")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> None:
    from kvflow.demo import main as demo_main

    demo_main(
        [
            "--num-requests",
            str(args.num_requests),
            "--max-tokens",
            str(args.max_tokens),
            "--seed",
            str(args.seed),
        ]
    )
