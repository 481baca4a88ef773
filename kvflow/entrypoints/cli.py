"""The `kvflow` command line: `generate` (one-shot completion), `chat` (interactive), `demo` (hash-model demo)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.entrypoints.llm import LLM
    from kvflow.sampling_params import SamplingParams


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    from kvflow.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    parser.add_argument("--verbose", action="store_true", help="log engine startup and progress")


def _add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=max_tokens)
    sampling.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (the default)"
    )
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument("--presence-penalty", type=float, default=0.0)
    sampling.add_argument("--frequency-penalty", type=float, default=0.0)
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow LLM inference engine")
    subcommands = parser.add_subparsers(dest="command", required=True)

    generate = subcommands.add_parser(
        "generate",
        help="complete one or more prompts and print the text",
        description="Complete each PROMPT and print the generated text.",
    )
    generate.add_argument("prompts", nargs="+", metavar="PROMPT")
    generate.add_argument("-n", type=int, default=1, help="samples per prompt")
    generate.add_argument(
        "--show-stats", action="store_true", help="print token counts and throughput to stderr"
    )
    _add_engine_arguments(generate)
    _add_sampling_arguments(generate, max_tokens=64)

    chat = subcommands.add_parser(
        "chat",
        help="interactive chat using the model's chat template",
        description="Chat on stdin/stdout; the checkpoint's chat template formats the "
        "conversation. Type /exit (or end input) to leave, /reset to forget.",
    )
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_arguments(chat)
    _add_sampling_arguments(chat, max_tokens=256)

    demo = subcommands.add_parser(
        "demo", help="run many requests through the engine on the hash test model"
    )
    demo.add_argument("--num-requests", type=int, default=400)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    return parser


def _make_llm(args: argparse.Namespace) -> LLM:
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.entrypoints.llm import LLM

    return LLM.from_engine_args(EngineArgs.from_cli_args(args))


def _sampling_params(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    from kvflow.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        **overrides,
    )


def run_generate(args: argparse.Namespace) -> None:
    params = _sampling_params(args, n=args.n)  # validate before the model loads
    llm = _make_llm(args)
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, use_tqdm=args.verbose)
    elapsed = time.perf_counter() - start
    for output in outputs:
        for completion in output.outputs:
            print(output.prompt + completion.text if output.prompt is not None else completion.text)
    if args.show_stats:
        num_prompt = sum(len(output.prompt_token_ids) for output in outputs)
        num_output = sum(len(c.token_ids) for output in outputs for c in output.outputs)
        print(
            f"prompt tokens: {num_prompt}, output tokens: {num_output}, {elapsed:.2f} s, "
            f"{num_output / max(elapsed, 1e-9):.1f} output tok/s",
            file=sys.stderr,
        )


def run_chat(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    llm = _make_llm(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            break
        user_text = line.rstrip("\n")
        if user_text.strip() == "/reset":
            history = list(system)
            continue
        if not user_text.strip():
            continue
        history.append({"role": "user", "content": user_text})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from kvflow.demo import main as run_demo

        run_demo(
            [
                "--num-requests",
                str(args.num_requests),
                "--max-tokens",
                str(args.max_tokens),
                "--seed",
                str(args.seed),
            ]
        )
        return
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "generate":
            run_generate(args)
        else:
            run_chat(args)
    except (
        ValueError,
        FileNotFoundError,
    ) as error:  # bad arguments or checkpoint files: no traceback
        print(f"kvflow {args.command}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from error


if __name__ == "__main__":
    main()
