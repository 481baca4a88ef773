"""`kvflow generate`: complete prompts (arguments, or stdin lines with `-`) and print the samples."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, TextIO

from kvflow.entrypoints.cli.args import (
    LOGGING_EPILOG,
    HelpFormatter,
    add_engine_arguments,
    add_sampling_arguments,
    parse_token_ids,
    sampling_params,
)
from kvflow.entrypoints.cli.engine import CommandError, make_llm
from kvflow.entrypoints.cli.render import format_logprobs, format_token_ids, sample_header

if TYPE_CHECKING:
    from kvflow.outputs import CompletionOutput, RequestOutput

STDIN_PROMPTS = "-"

EPILOG = f"""\
output:
  Each sample prints as the prompt followed by its completion. When a run prints more
  than one sample (several prompts, or -n > 1), a header line comes before each one:
      [prompt P, sample S]
  P is the prompt's 0-based position (stdin's blank lines are skipped), S the sample's.
  With --prompt-token-ids, a sample prints as its generated token ids, comma-separated.
  With --logprobs N, a table follows each sample: one line per generated token (position,
  token text and id, logprob, rank, then the N most likely tokens with their logprobs)
  and a last line "cumulative logprob: X".
  Statistics (--show-stats) and logs go to stderr.

{LOGGING_EPILOG}"""


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "generate",
        help="complete one or more prompts and print the text",
        description="Complete each PROMPT and print the generated text (greedy unless --temperature > 0).",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "prompts",
        nargs="+",
        metavar="PROMPT",
        help=f"text to complete; '{STDIN_PROMPTS}' reads prompts from stdin, one per line",
    )
    parser.add_argument("-n", type=int, default=1, help="samples per prompt")
    parser.add_argument(
        "--prompt-token-ids",
        action="store_true",
        help="each PROMPT is comma-separated token ids (e.g. 1,2,3), as --skip-tokenizer-init needs; "
        "samples print as token ids",
    )
    parser.add_argument(
        "--show-stats", action="store_true", help="print token counts and throughput to stderr"
    )
    add_engine_arguments(parser)
    add_sampling_arguments(parser, max_tokens=64)
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> None:
    params = sampling_params(args, n=args.n)  # validated before the model loads
    prompts = read_prompts(args.prompts, args.prompt_token_ids, sys.stdin)
    if args.skip_tokenizer_init and not args.prompt_token_ids:
        raise CommandError("--skip-tokenizer-init loads no tokenizer: pass --prompt-token-ids")
    llm = make_llm(args)
    if llm.get_tokenizer() is None and not args.prompt_token_ids:
        raise CommandError(
            f"model {llm.model_info.name!r} has no tokenizer: give prompts as token ids with "
            "--prompt-token-ids"
        )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - start
    print_outputs(outputs, args.prompt_token_ids, args.logprobs, sys.stdout)
    if args.show_stats:
        print(stats_line(outputs, elapsed), file=sys.stderr)


def read_prompts(
    items: list[str], token_ids: bool, stdin: TextIO
) -> list[str | dict[str, list[int]]]:
    """The prompts in order: each argument, with `-` replaced by stdin's non-blank lines; with `token_ids`, each
    parsed as comma-separated ids (CommandError for a bad one, or when there are none)."""
    texts: list[str] = []
    for item in items:
        if item == STDIN_PROMPTS:
            texts += [line.rstrip("\r\n") for line in stdin if line.strip()]
        else:
            texts.append(item)
    if not texts:
        raise CommandError("no prompts: stdin had no non-blank line")
    if not token_ids:
        return list(texts)
    try:
        return [{"prompt_token_ids": parse_token_ids(text)} for text in texts]
    except argparse.ArgumentTypeError as error:
        raise CommandError(f"--prompt-token-ids: {error}") from error


def print_outputs(
    outputs: list[RequestOutput], token_ids: bool, num_logprobs: int | None, out: TextIO
) -> None:
    """Each sample in prompt order (format: the --help epilog); headers when there is more than one sample."""
    labelled = sum(len(output.outputs) for output in outputs) > 1
    for prompt_index, output in enumerate(outputs):
        for completion in output.outputs:
            if labelled:
                print(sample_header(prompt_index, completion.index), file=out)
            print(sample_text(output, completion, token_ids), file=out)
            if num_logprobs is not None and completion.logprobs is not None:
                lines = format_logprobs(
                    completion.token_ids,
                    completion.logprobs,
                    num_logprobs,
                    completion.cumulative_logprob,
                )
                print("\n".join(lines), file=out)
    out.flush()


def sample_text(output: RequestOutput, completion: CompletionOutput, token_ids: bool) -> str:
    """The prompt and its completion, or the generated ids for token-id prompts."""
    if token_ids:
        return format_token_ids(completion.token_ids)
    return (output.prompt or "") + completion.text


def stats_line(outputs: list[RequestOutput], elapsed: float) -> str:
    num_prompt = sum(len(output.prompt_token_ids) for output in outputs)
    num_output = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return (
        f"prompt tokens: {num_prompt}, output tokens: {num_output}, {elapsed:.2f} s, "
        f"{num_output / max(elapsed, 1e-9):.1f} output tok/s"
    )
