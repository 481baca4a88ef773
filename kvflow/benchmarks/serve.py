"""`kvflow bench serve`: load an OpenAI-compatible server with random prompts and print vLLM's result table.

Requests go out on a Poisson process at `request_rate` (or all at once for `inf`), at most `max_concurrency` in
flight, each streamed; the table reports throughput and TTFT / TPOT / ITL / E2EL mean, median and P99 in ms. An
embeddings endpoint (`/v1/embeddings`, vLLM's `openai-embeddings` backend) gets one whole-response request per
prompt, and its table (`format_embedding_table`) has what a pooling request has: input tokens, throughput, E2EL.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.benchmarks.request import (
    RequestResult,
    embedding_request_body,
    is_embedding_endpoint,
    request_body,
    send_embedding_request,
    send_request,
)

if TYPE_CHECKING:
    from kvflow.benchmarks.datasets import SampleRequest

PERCENTILES = (50, 99)  # the median and P99 of every latency


@dataclass
class BenchmarkConfig:
    """Where to send what: the server, the endpoint, the model name, and the load shape."""

    base_url: str
    endpoint: str
    model: str
    request_rate: float  # requests per second; inf sends everything at once
    max_concurrency: int | None
    seed: int
    ignore_eos: bool = True
    timeout_s: float = 600.0
    stream: bool = True  # False: whole responses (their TTFT is their latency)


async def run_benchmark(
    config: BenchmarkConfig, samples: list[SampleRequest]
) -> tuple[list[RequestResult], float]:
    """Send every sample and wait for all of them; returns the results (in sample order) and the duration."""
    import aiohttp

    url = config.base_url.rstrip("/") + config.endpoint
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    rng = random.Random(config.seed)
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or len(samples))
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        embeddings = is_embedding_endpoint(config.endpoint)
        send = send_embedding_request if embeddings else send_request

        async def one(sample: SampleRequest) -> RequestResult:
            if embeddings:
                body = embedding_request_body(config.model, sample)
            else:
                body = request_body(
                    config.endpoint, config.model, sample, config.ignore_eos, config.stream
                )
            if limit is None:
                return await send(client, url, body, sample)
            async with limit:
                return await send(client, url, body, sample)

        start = time.perf_counter()
        tasks = []
        for sample in samples:
            tasks.append(asyncio.create_task(one(sample)))
            if config.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """vLLM's benchmark metrics: counts, throughputs, and mean / median / P99 latencies in milliseconds."""
    done = [result for result in results if result.success]
    total_input = sum(result.prompt_len for result in done)
    total_output = sum(result.output_tokens for result in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "errors": sorted({result.error for result in results if not result.success})[:10],
    }
    latencies = {
        "ttft": [result.ttft for result in done],
        "tpot": [tpot for result in done if (tpot := result.tpot) is not None],
        "itl": [gap for result in done for gap in result.itl],
        "e2el": [result.latency for result in done],
    }
    for name, values in latencies.items():
        summary[f"mean_{name}_ms"] = 1000 * statistics.fmean(values) if values else 0.0
        for percentile in PERCENTILES:
            key = "median" if percentile == 50 else f"p{percentile}"
            summary[f"{key}_{name}_ms"] = 1000 * percentile_of(values, percentile)
    return summary


def percentile_of(values: list[float], percentile: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * percentile / 100
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


_SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def format_table(summary: dict[str, Any]) -> str:
    """The result table as vLLM's `bench serve` prints it."""
    rows = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        _row("Successful requests:", summary["completed"]),
        _row("Failed requests:", summary["failed"]),
        _row("Benchmark duration (s):", summary["duration"]),
        _row("Total input tokens:", summary["total_input_tokens"]),
        _row("Total generated tokens:", summary["total_output_tokens"]),
        _row("Request throughput (req/s):", summary["request_throughput"]),
        _row("Output token throughput (tok/s):", summary["output_throughput"]),
        _row("Total Token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for key, title, short in _SECTIONS:
        rows.append("{s:{c}^50}".format(s=title, c="-"))
        rows.append(_row(f"Mean {short} (ms):", summary[f"mean_{key}_ms"]))
        rows.append(_row(f"Median {short} (ms):", summary[f"median_{key}_ms"]))
        rows.append(_row(f"P99 {short} (ms):", summary[f"p99_{key}_ms"]))
    rows.append("=" * 50)
    return "\n".join(rows)


def format_embedding_table(summary: dict[str, Any]) -> str:
    """The result table vLLM's `bench serve` prints for a pooling (embedding) run: no output tokens, so no TTFT,
    TPOT or ITL; throughput in requests and input tokens, and the end-to-end latency."""
    rows = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        _row("Successful requests:", summary["completed"]),
        _row("Failed requests:", summary["failed"]),
        _row("Benchmark duration (s):", summary["duration"]),
        _row("Total input tokens:", summary["total_input_tokens"]),
        _row("Request throughput (req/s):", summary["request_throughput"]),
        _row("Total Token throughput (tok/s):", summary["total_token_throughput"]),
        "{s:{c}^50}".format(s="End-to-end Latency", c="-"),
        _row("Mean E2EL (ms):", summary["mean_e2el_ms"]),
        _row("Median E2EL (ms):", summary["median_e2el_ms"]),
        _row("P99 E2EL (ms):", summary["p99_e2el_ms"]),
        "=" * 50,
    ]
    return "\n".join(rows)


def _row(label: str, value: float) -> str:
    return f"{label:<40}{value:<10}" if isinstance(value, int) else f"{label:<40}{value:<10.2f}"


def save_result(
    path: Path, config: BenchmarkConfig, summary: dict[str, Any], results: list[RequestResult]
) -> None:
    """The summary, the settings and every request's measurements, as JSON."""
    record = {
        **asdict(config),
        "request_rate": str(config.request_rate),
        **summary,
        "input_lens": [result.prompt_len for result in results],
        "output_lens": [result.output_tokens for result in results],
        "ttfts": [result.ttft for result in results],
        "itls": [result.itl for result in results],
        "e2els": [result.latency for result in results],
        "start_times": [result.start_time for result in results],
        "errors_by_request": [result.error for result in results],
    }
    path.write_text(json.dumps(record, indent=2))
