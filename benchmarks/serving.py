"""Serving benchmarks: what `kvflow serve` costs over the engine, and its latencies under load.

    python benchmarks/serving.py            # the full run (~10 minutes on 2 cores)
    python benchmarks/serving.py --quick    # a smoke run (tests use it)

Every figure is measured in the same run on the same machine, against a baseline beside it:

1. **Serving overhead** on the built-in default model: the same random prompts (token ids, `--input-len` /
   `--output-len`, greedy, `ignore_eos`) at concurrency 64, through `kvflow serve` (HTTP + the engine-core process)
   and through an in-process `AsyncLLM`; output tokens/s of each and their ratio.
2. **Where the overhead goes**, on `kvflow serve hash` (the hash model costs ~nothing): requests/s through the
   server and in-process, and the API server process's CPU time per output token (from /proc/<pid>/stat).
3. **Latency under load** on the default model: TTFT and TPOT (mean / median / P99) at request rates 1, 4, 16 and
   inf (`kvflow bench serve`'s client, Poisson arrivals).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvflow.benchmarks.datasets import SampleRequest, random_requests
from kvflow.benchmarks.serve import BenchmarkConfig, run_benchmark, summarize

SERVER_START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def healthy_process(
    command: list[str],
    base_url: str,
    env: dict[str, str] | None = None,
    start_timeout_s: float = SERVER_START_TIMEOUT_S,
) -> Iterator[subprocess.Popen[bytes]]:
    """`command` (an HTTP server) started with its output in a temporary file, yielded once `base_url`/health
    answers 200; stopped with SIGINT (then killed) on exit. A RuntimeError with the output's tail when it exits
    first or is not healthy within `start_timeout_s`."""
    with tempfile.TemporaryFile() as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)

        def failure(what: str) -> RuntimeError:
            output.seek(0)
            tail = output.read()[-3000:].decode(errors="replace")
            return RuntimeError(f"{shlex.join(command)} {what}:\n{tail}")

        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if server.poll() is not None:
                    raise failure("exited")
                try:
                    if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise failure("did not become healthy")
                time.sleep(0.2)
            yield server
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


@contextmanager
def running_server(model_args: list[str], engine_args: list[str]) -> Iterator[tuple[str, int]]:
    """`kvflow serve` on a free port; yields (base URL, API process pid); stops it (SIGINT, then kill)."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "kvflow",
        "serve",
        *model_args,
        "--port",
        str(port),
        *engine_args,
    ]
    env = {**os.environ, "KVFLOW_LOGGING_LEVEL": "WARNING"}
    base_url = f"http://127.0.0.1:{port}"
    with healthy_process(command, base_url, env) as server:
        yield base_url, server.pid


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_server(
    base_url: str, samples: list[SampleRequest], rate: float, concurrency: int | None
) -> dict:
    config = BenchmarkConfig(
        base_url, "/v1/completions", _model_name(base_url), rate, concurrency, seed=0
    )
    results, duration = asyncio.run(run_benchmark(config, samples))
    return summarize(results, duration)


def _model_name(base_url: str) -> str:
    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def bench_in_process(
    model: str | None, engine_kwargs: dict, samples: list[SampleRequest], concurrency: int
) -> dict:
    """The same prompts through an in-process AsyncLLM, `concurrency` at a time: output tokens/s, requests/s."""
    from kvflow import AsyncLLM, SamplingParams

    async def main() -> dict:
        async with AsyncLLM(model, disable_log_stats=True, **engine_kwargs) as llm:
            limit = asyncio.Semaphore(concurrency)

            async def one(index: int, sample: SampleRequest) -> int:
                params = SamplingParams(
                    temperature=0.0, max_tokens=sample.expected_output_len, ignore_eos=True
                )
                async with limit:
                    outputs = [
                        output
                        async for output in llm.generate(
                            {"prompt_token_ids": list(sample.prompt)}, params, f"bench-{index}"
                        )
                    ]
                return len(outputs[-1].outputs[0].token_ids)

            start = time.perf_counter()
            tokens = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
            elapsed = time.perf_counter() - start
        return {
            "output_throughput": sum(tokens) / elapsed,
            "request_throughput": len(samples) / elapsed,
            "duration": elapsed,
        }

    return asyncio.run(main())


def overhead(args: argparse.Namespace) -> None:
    samples = random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, seed=0)
    engine = ["--max-num-seqs", "64", "--num-kv-blocks", str(args.kv_blocks)]
    with running_server([], engine) as (base_url, _):
        served = bench_server(base_url, samples, float("inf"), 64)
    local = bench_in_process(
        None, {"max_num_seqs": 64, "num_kv_blocks": args.kv_blocks}, samples, 64
    )
    print(
        "\n1. Serving overhead, default model, concurrency 64, "
        f"{args.num_prompts} requests x {args.input_len} in / {args.output_len} out"
    )
    print(f"{'system':<28}{'output tok/s':>14}{'req/s':>10}")
    print(
        f"{'kvflow serve':<28}{served['output_throughput']:>14.1f}{served['request_throughput']:>10.2f}"
    )
    print(
        f"{'in-process AsyncLLM':<28}{local['output_throughput']:>14.1f}{local['request_throughput']:>10.2f}"
    )
    print(f"serve / in-process: {served['output_throughput'] / local['output_throughput']:.3f}x")


def hash_overhead(args: argparse.Namespace) -> None:
    samples = random_requests(args.hash_prompts, 64, 32, 0.0, seed=1)
    engine = ["--max-num-seqs", "64", "--num-kv-blocks", "8192", "--max-model-len", "1024"]
    with running_server(["hash"], engine) as (base_url, pid):
        cpu_before = process_cpu_seconds(pid)
        served = bench_server(base_url, samples, float("inf"), 64)
        api_cpu = process_cpu_seconds(pid) - cpu_before
    local = bench_in_process(
        "hash", {"max_num_seqs": 64, "num_kv_blocks": 8192, "max_model_len": 1024}, samples, 64
    )
    tokens = served["total_output_tokens"]
    print(
        f"\n2. Hash model (model cost ~0), concurrency 64, {args.hash_prompts} requests x 64 in / 32 out"
    )
    print(f"{'system':<28}{'req/s':>10}{'output tok/s':>14}")
    print(
        f"{'kvflow serve hash':<28}{served['request_throughput']:>10.1f}{served['output_throughput']:>14.1f}"
    )
    print(
        f"{'in-process AsyncLLM':<28}{local['request_throughput']:>10.1f}{local['output_throughput']:>14.1f}"
    )
    print(
        f"API server process CPU: {api_cpu:.2f} s, {1e6 * api_cpu / max(tokens, 1):.0f} us per output token"
    )


def latency_sweep(args: argparse.Namespace) -> None:
    samples = random_requests(args.sweep_prompts, args.input_len, args.output_len, 0.0, seed=2)
    engine = ["--max-num-seqs", "64", "--num-kv-blocks", str(args.kv_blocks)]
    print(
        f"\n3. Latency by request rate, default model, {args.sweep_prompts} requests x "
        f"{args.input_len} in / {args.output_len} out"
    )
    print(
        f"{'rate':>6}{'req/s':>8}{'TTFT mean':>11}{'median':>9}{'P99':>9}{'TPOT mean':>11}{'median':>9}{'P99':>9}  (ms)"
    )
    with running_server([], engine) as (base_url, _):
        for rate in args.rates:
            summary = bench_server(base_url, samples, rate, None)
            print(
                f"{rate:>6g}{summary['request_throughput']:>8.2f}{summary['mean_ttft_ms']:>11.1f}"
                f"{summary['median_ttft_ms']:>9.1f}{summary['p99_ttft_ms']:>9.1f}{summary['mean_tpot_ms']:>11.1f}"
                f"{summary['median_tpot_ms']:>9.1f}{summary['p99_tpot_ms']:>9.1f}"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run with tiny workloads")
    args = parser.parse_args(argv)
    args.input_len, args.output_len = (16, 8) if args.quick else (128, 128)
    args.num_prompts = 16 if args.quick else 256
    args.hash_prompts = 32 if args.quick else 1024
    args.sweep_prompts = 8 if args.quick else 64
    args.kv_blocks = 1024 if args.quick else 4096
    args.rates = [float("inf")] if args.quick else [1.0, 4.0, 16.0, float("inf")]
    overhead(args)
    hash_overhead(args)
    latency_sweep(args)


if __name__ == "__main__":
    main()
