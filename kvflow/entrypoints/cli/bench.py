"""`kvflow bench serve`: benchmark any OpenAI-compatible server (`kvflow.benchmarks.serve`)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from kvflow.entrypoints.cli import bench_offline
from kvflow.entrypoints.cli.args import HelpFormatter, SubcommandParser

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
# vLLM's `--backend` values and the endpoint each loads.
BACKEND_ENDPOINTS = {
    "openai": "/v1/completions",
    "vllm": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
    "openai-embeddings": "/v1/embeddings",
}

DESCRIPTION = """\
Send random prompts to an OpenAI-compatible server (kvflow serve, vLLM, ...) and print
vLLM's serving benchmark table: successful and failed requests, duration, request and
token throughput, and TTFT / TPOT / ITL / E2EL mean, median and P99 in ms. Prompts are
random tokens: with --tokenizer, text that encodes to exactly --random-input-len tokens
(the tokenizer's BOS included; for the chat endpoint, the message content alone);
without one, token-id prompts (e.g. against `kvflow serve hash`). "Total input tokens"
counts what the server says it processed (its usage), so a chat request's template
counts too. Requests arrive as a Poisson process at --request-rate (inf: all at
once), at most --max-concurrency at a time, all streamed.
With --backend openai-embeddings (/v1/embeddings, e.g. against `kvflow serve MODEL
--runner pooling`) each prompt is one embedding request, and the table has what a
pooling request has: input tokens, request and token throughput, and E2EL."""


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    bench = subcommands.add_parser(
        "bench",
        help="benchmark a running server, or the offline engine's throughput and latency",
        description="Benchmarks, as vLLM's `vllm bench`: serve (a running server), throughput and latency "
        "(the offline engine). `kvflow bench BENCHMARK --help` describes each.",
        formatter_class=HelpFormatter,
    )
    kinds = bench.add_subparsers(
        dest="bench_command", required=True, metavar="BENCHMARK", parser_class=SubcommandParser
    )
    serve = kinds.add_parser(
        "serve",
        help="load an OpenAI-compatible server and report latencies and throughput",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    serve.add_argument(
        "--base-url",
        default=None,
        help="the server, e.g. http://127.0.0.1:8000 (default: from --host and --port)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="the server's host (vLLM's spelling)")
    serve.add_argument("--port", type=int, default=8000, help="the server's port (vLLM's spelling)")
    serve.add_argument(
        "--endpoint",
        default=None,
        choices=list(ENDPOINTS),
        help="the API path to load (default: the backend's, /v1/completions)",
    )
    serve.add_argument(
        "--backend",
        default=None,
        choices=list(BACKEND_ENDPOINTS),
        help="vLLM's spelling of the endpoint: openai and vllm load /v1/completions, openai-chat "
        "/v1/chat/completions, openai-embeddings /v1/embeddings",
    )
    serve.add_argument("--model", default=None, help="model name (default: the server's first)")
    serve.add_argument("--tokenizer", default=None, help="tokenizer folder: send text prompts")
    serve.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        default="random",
        choices=["random"],
        help="prompt source (--dataset-name: vLLM's spelling)",
    )
    serve.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    serve.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="tokens to generate (unused by /v1/embeddings)",
    )
    serve.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are drawn from [len * (1 - r), len * (1 + r)]",
    )
    serve.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="tokens of one random prefix every prompt starts with (before its --random-input-len)",
    )
    serve.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    serve.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (inf: at once)",
    )
    serve.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most"
    )
    serve.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    serve.add_argument("--save-result", type=Path, default=None, help="write the results as JSON")
    serve.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="draw TTFT, TPOT, ITL and E2E latency CDFs and throughput over time with the request rate "
        "marked (PNG)",
    )
    serve.set_defaults(handler=run_bench_serve)
    bench_offline.add_parsers(kinds)


def run_bench_serve(args: argparse.Namespace) -> None:
    from kvflow.benchmarks.datasets import random_requests
    from kvflow.benchmarks.request import is_embedding_endpoint
    from kvflow.benchmarks.serve import (
        BenchmarkConfig,
        format_embedding_table,
        format_table,
        run_benchmark,
        save_result,
        summarize,
    )

    base_url, endpoint = resolve_target(args)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    tokenizer = None
    if args.tokenizer is not None:
        from kvflow.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    samples = random_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.seed,
        tokenizer,
        prefix_len=args.random_prefix_len,
        # A chat message's content gets the chat template's tokens around it, not the tokenizer's BOS.
        add_special_tokens=not endpoint.endswith("/chat/completions"),
    )
    model = args.model or _first_model(base_url)
    config = BenchmarkConfig(
        base_url=base_url,
        endpoint=endpoint,
        model=model,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
    )
    results, duration = asyncio.run(run_benchmark(config, samples))
    summary = summarize(results, duration)
    table = format_embedding_table if is_embedding_endpoint(endpoint) else format_table
    print(table(summary), flush=True)
    if summary["errors"]:
        print("errors: " + "; ".join(summary["errors"]), flush=True)
    if args.save_result is not None:
        save_result(args.save_result, config, summary, results)
    if args.plot is not None:
        from kvflow.benchmarks.plot import plot_results, rate_text

        plot_results(
            args.plot,
            results,
            f"{model}, request rate {rate_text(args.request_rate)}, {endpoint}",
            request_rate=args.request_rate,
            achieved_rate=summary["request_throughput"],
        )


def resolve_target(args: argparse.Namespace) -> tuple[str, str]:
    """(base URL, endpoint) from kvflow's flags or vLLM's: `--base-url` or `--host`/`--port`; `--endpoint` or
    `--backend`. An endpoint that contradicts the backend is a ValueError naming both."""
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint
    if args.backend is not None:
        backend_endpoint = BACKEND_ENDPOINTS[args.backend]
        if endpoint is not None and endpoint != backend_endpoint:
            raise ValueError(
                f"--endpoint {endpoint} contradicts --backend {args.backend} ({backend_endpoint}); "
                "give one of them"
            )
        endpoint = backend_endpoint
    return base_url, endpoint or ENDPOINTS[0]


def _first_model(base_url: str) -> str:
    """The first model `GET /v1/models` lists (an unreachable server is a clear error)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise ValueError(f"cannot list the models at {url} ({error}); pass --model") from error
