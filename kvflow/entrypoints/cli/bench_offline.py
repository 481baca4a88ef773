"""`kvflow bench throughput` and `kvflow bench latency`: the offline engine's benchmarks, with vLLM's flags and
summary lines (`kvflow.benchmarks.throughput`, `kvflow.benchmarks.latency`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.entrypoints.cli.args import LOGGING_EPILOG, HelpFormatter, add_engine_arguments
from kvflow.entrypoints.cli.engine import CommandError, make_llm

if TYPE_CHECKING:
    from kvflow.benchmarks.datasets import SampleRequest
    from kvflow.entrypoints.llm import LLM

DATASETS = ("random", "sharegpt")
# vLLM's random dataset lengths when --input-len / --output-len are not given.
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128

THROUGHPUT_DESCRIPTION = """\
Offline throughput of the engine (vLLM's `bench throughput`): --num-prompts requests
go to one LLM.generate call, each sampled (temperature 1) with EOS ignored, so every
sample is exactly its output length. Prompts: --dataset-name random (the default
without --dataset-path): --input-len tokens each (random token ids; text that encodes
to exactly that many tokens, BOS included, when the model has a tokenizer), or sharegpt:
the first turns of a ShareGPT-style JSON file (--dataset-path), each with its reply's
token count as output length unless --output-len is given. Prints:
  Throughput: X requests/s, Y total tokens/s, Z output tokens/s
  Total num prompt tokens:  P
  Total num output tokens:  O"""

LATENCY_DESCRIPTION = """\
End-to-end latency of one batch through the engine (vLLM's `bench latency`):
--batch-size prompts of --input-len random token ids, each generating --output-len
tokens (EOS ignored, --n samples); --num-iters-warmup untimed runs, then --num-iters
timed ones. Prefix caching is off unless --enable-prefix-caching (every iteration
repeats the batch). Prints "Avg latency: X seconds", "Std latency: X seconds" and
"P% percentile latency: X seconds" for P in 10, 25, 50, 75, 90, 99."""


def add_parsers(kinds: argparse._SubParsersAction) -> None:
    """The `throughput` and `latency` subcommands of `kvflow bench`."""
    _add_throughput_parser(kinds)
    _add_latency_parser(kinds)


def _add_throughput_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "throughput",
        help="offline engine throughput on a batch of prompts",
        description=THROUGHPUT_DESCRIPTION,
        epilog=LOGGING_EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--backend",
        default="vllm",
        choices=["vllm"],
        help="accepted for vLLM's command lines: kvflow's offline engine is the one backend",
    )
    parser.add_argument(
        "--dataset-name",
        default=None,
        choices=list(DATASETS),
        help="prompt source (default: sharegpt with --dataset-path, else random)",
    )
    parser.add_argument(
        "--dataset-path", type=Path, default=None, help="ShareGPT-style JSON file (sharegpt)"
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=None,
        help=f"prompt tokens per request (random; default {DEFAULT_INPUT_LEN})",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help=f"tokens to generate per sample (default: {DEFAULT_OUTPUT_LEN} for random, the "
        "reply's length for sharegpt)",
    )
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests to run")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="tokens of one random prefix every random prompt starts with, before its --input-len",
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random lengths are drawn from [len * (1 - r), len * (1 + r)]",
    )
    parser.add_argument(
        "--output-json", type=Path, default=None, help="write the results as JSON (vLLM's keys)"
    )
    add_engine_arguments(parser)
    parser.set_defaults(handler=run_bench_throughput)


def _add_latency_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "latency",
        help="offline engine latency of one batch",
        description=LATENCY_DESCRIPTION,
        epilog=LOGGING_EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument(
        "--num-iters-warmup", type=int, default=10, help="untimed runs of the batch first"
    )
    parser.add_argument("--num-iters", type=int, default=30, help="timed runs of the batch")
    parser.add_argument(
        "--output-json", type=Path, default=None, help="write the results as JSON (vLLM's keys)"
    )
    # Every iteration repeats the same prompts: cached prefixes would make later ones prefill-free.
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="reuse the KV blocks of prompts seen before (default: off, so every iteration prefills "
        "its batch)",
    )
    add_engine_arguments(parser, exclude=("enable_prefix_caching",))
    parser.set_defaults(handler=run_bench_latency)


def run_bench_throughput(args: argparse.Namespace) -> None:
    from kvflow.benchmarks.throughput import format_summary, run_throughput

    dataset = _check_throughput_args(args)
    llm = make_llm(args)
    samples = _throughput_samples(args, dataset, llm)
    result = run_throughput(llm, samples, args.n, use_tqdm=sys.stderr.isatty())
    print("\n".join(format_summary(result)), flush=True)
    if args.output_json is not None:
        _write_json(args.output_json, result.as_json())


def _check_throughput_args(args: argparse.Namespace) -> str:
    """The dataset to sample (ValueError naming a flag out of range or a contradiction, before the model loads)."""
    dataset = args.dataset_name or ("sharegpt" if args.dataset_path is not None else "random")
    if dataset == "sharegpt" and args.dataset_path is None:
        raise ValueError(
            "--dataset-name sharegpt needs --dataset-path (a ShareGPT-style JSON file)"
        )
    if dataset == "random" and args.dataset_path is not None:
        raise ValueError(
            "--dataset-path is read by --dataset-name sharegpt; --dataset-name random makes its prompts"
        )
    for flag, value in (
        ("--num-prompts", args.num_prompts),
        ("--n", args.n),
        ("--input-len", args.input_len),
        ("--output-len", args.output_len),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.prefix_len < 0:
        raise ValueError(f"--prefix-len must be >= 0, got {args.prefix_len}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if dataset == "sharegpt" and not args.dataset_path.is_file():
        raise ValueError(f"--dataset-path {args.dataset_path}: no such file")
    return dataset


def _throughput_samples(args: argparse.Namespace, dataset: str, llm: LLM) -> list[SampleRequest]:
    from kvflow.benchmarks.datasets import random_requests, sharegpt_requests

    tokenizer = llm.get_tokenizer()
    if dataset == "sharegpt":
        if tokenizer is None:
            raise CommandError(
                f"model {llm.model_info.name!r} has no tokenizer: --dataset-name sharegpt needs one "
                "(--dataset-name random sends token ids)"
            )
        return sharegpt_requests(
            args.dataset_path, args.num_prompts, tokenizer, args.seed, args.output_len
        )
    return random_requests(
        args.num_prompts,
        args.input_len or DEFAULT_INPUT_LEN,
        args.output_len or DEFAULT_OUTPUT_LEN,
        args.random_range_ratio,
        args.seed,
        tokenizer,
        prefix_len=args.prefix_len,
        token_id_range=(0, llm.vocab_size),
    )


def run_bench_latency(args: argparse.Namespace) -> None:
    from kvflow.benchmarks.latency import (
        LatencySettings,
        format_summary,
        latency_record,
        measure_latencies,
    )

    settings = LatencySettings(
        input_len=args.input_len,
        output_len=args.output_len,
        batch_size=args.batch_size,
        n=args.n,
        num_iters_warmup=args.num_iters_warmup,
        num_iters=args.num_iters,
        seed=args.seed,
    )
    settings.validate()  # before the model loads
    llm = make_llm(args)
    print("Warming up...", file=sys.stderr, flush=True)
    latencies = measure_latencies(llm, settings)
    record = latency_record(latencies)
    print("\n".join(format_summary(record)), flush=True)
    if args.output_json is not None:
        _write_json(args.output_json, record)


def _write_json(path: Path, record: dict[str, Any]) -> None:
    path.write_text(json.dumps(record, indent=4) + "\n")
