"""The `kvflow` command line. Subcommands: `demo` (the hash-model demo; real-model commands come next)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow LLM inference engine")
    subcommands = parser.add_subparsers(dest="command", required=True)
    demo = subcommands.add_parser("demo", help="run many requests through the engine on the hash test model")
    demo.add_argument("--num-requests", type=int, default=400)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kvflow.demo import main as run_demo

        run_demo(["--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens),
                  "--seed", str(args.seed)])


if __name__ == "__main__":
    main()
