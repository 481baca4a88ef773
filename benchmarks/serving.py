"""Serving benchmarks: what `kvflow serve` costs over the engine, and its latencies under load.

    python benchmarks/serving.py            # the full run (~10 minutes on 2 cores)
    python benchmarks/serving.py --quick    # a smoke run (tests use it)

Every figure is measured in the same run on the same machine, against a baseline beside it:

1. **Serving overhead** on the built-in default model: the same random prompts (token ids, `--input-len` /
   `--output-len`, greedy, `ignore_eos`) at concurrency 64, through `kvflow serve` (HTTP + the engine-core process)
   and through an in-process `AsyncLLM`; output tokens/s of each and their ratio.
2. **The API process's cost**, on `kvflow serve hash` (the hash model costs ~nothing, so the API process and the
   client are what limit it): 1,024 requests x 64 in / 128 out at concurrency 64 and 256, streamed and not, with
   one API process and with `--api-server-count 2`: output tokens/s through the server, the API processes' CPU
   time per output token (from /proc/<pid>/stat; the engine core's and the client's beside it), and the same
   requests through an in-process `AsyncLLM` (its default layout: the engine core on a thread; and with
   `engine_process=True`, the server's layout without HTTP), with the ratio serve / in-process.
3. **Latency under load** on the default model: TTFT and TPOT (mean / median / P99) at request rates 1, 4, 16 and
   inf (`kvflow bench serve`'s client, Poisson arrivals).

The client (`kvflow bench serve`'s, on aiohttp) runs in this process, on the same cores as the server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
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
    cwd: str | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`command` (an HTTP server) started with its output in a temporary file, yielded once `base_url`/health
    answers 200; stopped with SIGINT (then killed) on exit. A RuntimeError with the output's tail when it exits
    first or is not healthy within `start_timeout_s`."""
    with tempfile.TemporaryFile() as output:
        server = subprocess.Popen(
            command, env=env, stdout=output, stderr=subprocess.STDOUT, cwd=cwd
        )

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


# `--server-source DIR`: the kvflow source tree `kvflow serve` runs from (None: this one).
SERVER_SOURCE: str | None = None
ENGINE_THREADS: int | None = None  # OMP_NUM_THREADS for the server only (None: its own policy)


@contextmanager
def running_server(model_args: list[str], engine_args: list[str]) -> Iterator[tuple[str, int]]:
    """`kvflow serve` on a free port (from `SERVER_SOURCE` when set); yields (base URL, its pid); stops it
    (SIGINT, then kill)."""
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
    if SERVER_SOURCE is not None:
        env["PYTHONPATH"] = SERVER_SOURCE
    if ENGINE_THREADS is not None:
        env["OMP_NUM_THREADS"] = str(ENGINE_THREADS)
    base_url = f"http://127.0.0.1:{port}"
    with healthy_process(command, base_url, env, cwd=SERVER_SOURCE) as server:
        yield base_url, server.pid


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in map(int, (task / "children").read_text().split()):
            found += [child, *descendants(child)]
    return found


def server_processes(pid: int) -> tuple[list[int], list[int]]:
    """The API processes and engine-core processes of the `kvflow serve` at `pid`: with `--api-server-count`
    above 1 they are named `kvflow-api-<i>` / `kvflow-engine-<i>`; with one API process, it is `pid` itself and
    its engine cores are its spawned children (not multiprocessing's resource tracker)."""
    below = descendants(pid)
    names = {child: _comm(child) for child in below}
    api = [child for child, name in names.items() if name.startswith("kvflow-api-")]
    engines = [child for child, name in names.items() if name.startswith("kvflow-engine-")]
    if api:
        return api, engines
    spawned = [
        child
        for child in below
        if "resource_tracker" not in Path(f"/proc/{child}/cmdline").read_text()
    ]
    return [pid], engines or spawned


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench_server(
    base_url: str,
    samples: list[SampleRequest],
    rate: float,
    concurrency: int | None,
    stream: bool = True,
) -> dict:
    config = BenchmarkConfig(
        base_url, "/v1/completions", _model_name(base_url), rate, concurrency, seed=0, stream=stream
    )
    results, duration = asyncio.run(run_benchmark(config, samples))
    return summarize(results, duration)


def _model_name(base_url: str) -> str:
    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def bench_in_process(
    model: str | None,
    engine_kwargs: dict,
    samples: list[SampleRequest],
    concurrency: int,
    stream: bool = True,
) -> dict:
    """The same prompts through an in-process AsyncLLM, `concurrency` at a time, each consumed as a stream of
    delta outputs (or, not streamed, as its final output only): output tokens/s, requests/s."""
    from kvflow import AsyncLLM, SamplingParams

    async def main() -> dict:
        async with AsyncLLM(model, disable_log_stats=True, **engine_kwargs) as llm:
            limit = asyncio.Semaphore(concurrency)

            async def one(index: int, sample: SampleRequest) -> int:
                params = SamplingParams(
                    temperature=0.0,
                    max_tokens=sample.expected_output_len,
                    ignore_eos=True,
                    output_kind="delta" if stream else "final_only",
                )
                async with limit:
                    num_tokens = 0
                    async for output in llm.generate(
                        {"prompt_token_ids": list(sample.prompt)}, params, f"bench-{index}"
                    ):
                        num_tokens += len(output.outputs[0].token_ids)
                return num_tokens

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


HASH_ENGINE = {"max_num_seqs": 256, "num_kv_blocks": 16384, "max_model_len": 1024}


def hash_overhead(args: argparse.Namespace) -> None:
    samples = random_requests(args.hash_prompts, 64, args.hash_output_len, 0.0, seed=1)
    engine = [f"--{name.replace('_', '-')}={value}" for name, value in HASH_ENGINE.items()]
    cases = [(c, stream) for c in args.hash_concurrency for stream in (True, False)]
    in_process = {
        (c, stream, layout): bench_in_process(
            "hash", {**HASH_ENGINE, "engine_process": layout == "process"}, samples, c, stream
        )["output_throughput"]
        for c, stream in cases
        for layout in ("thread", "process")
    }
    print(
        f"\n2. Hash model (model cost ~0), {args.hash_prompts} requests x 64 in / "
        f"{args.hash_output_len} out; in-process AsyncLLM: engine core on a thread (its default) / in its own "
        "process"
    )
    print(
        f"{'API procs':>9}{'conc':>6}{'stream':>8}{'serve tok/s':>13}{'in-proc':>10}{'ratio':>7}"
        f"{'in-proc (proc)':>16}{'ratio':>7}{'API us/tok':>12}{'engine':>8}{'client':>8}"
    )
    for api_server_count in args.api_server_counts:
        extra = [] if api_server_count == 1 else ["--api-server-count", str(api_server_count)]
        with running_server(["hash"], [*engine, *extra]) as (base_url, pid):
            api_pids, engine_pids = server_processes(pid)
            for concurrency, stream in cases:
                api_before = sum(map(process_cpu_seconds, api_pids))
                engine_before = sum(map(process_cpu_seconds, engine_pids))
                client_before = own_cpu_seconds()
                served = bench_server(base_url, samples, float("inf"), concurrency, stream)
                tokens = max(served["total_output_tokens"], 1)
                api_us = 1e6 * (sum(map(process_cpu_seconds, api_pids)) - api_before) / tokens
                engine_us = (
                    1e6 * (sum(map(process_cpu_seconds, engine_pids)) - engine_before) / tokens
                )
                client_us = 1e6 * (own_cpu_seconds() - client_before) / tokens
                thread = in_process[(concurrency, stream, "thread")]
                process = in_process[(concurrency, stream, "process")]
                throughput = served["output_throughput"]
                failed = f"  ({served['failed']} FAILED)" if served["failed"] else ""
                print(
                    f"{api_server_count:>9}{concurrency:>6}{'yes' if stream else 'no':>8}"
                    f"{throughput:>13.0f}{thread:>10.0f}{throughput / thread:>7.2f}{process:>16.0f}"
                    f"{throughput / process:>7.2f}{api_us:>12.1f}{engine_us:>8.1f}{client_us:>8.1f}"
                    f"{failed}"
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


SECTIONS = {"overhead": overhead, "hash": hash_overhead, "latency": latency_sweep}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run with tiny workloads")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="which sections to run (default: all, in order)",
    )
    parser.add_argument(
        "--api-server-counts",
        nargs="+",
        type=int,
        default=[1, 2],
        help="section 2: the --api-server-count values to serve with (default: 1 2)",
    )
    parser.add_argument(
        "--server-source",
        help="run `kvflow serve` from this kvflow source tree (e.g. `git worktree add /tmp/before <commit>`), "
        "to compare servers before and after a change with the same client and baselines",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        help="torch threads of the server's engine process (OMP_NUM_THREADS for the server only; default: the "
        "server's own policy, every core); in-process baselines keep this process's",
    )
    args = parser.parse_args(argv)
    global SERVER_SOURCE, ENGINE_THREADS
    SERVER_SOURCE = args.server_source
    ENGINE_THREADS = args.engine_threads
    args.input_len, args.output_len = (16, 8) if args.quick else (128, 128)
    args.num_prompts = 16 if args.quick else 256
    args.hash_prompts = 32 if args.quick else 1024
    args.hash_output_len = 16 if args.quick else 128
    args.hash_concurrency = [8] if args.quick else [64, 256]
    args.sweep_prompts = 8 if args.quick else 64
    args.kv_blocks = 1024 if args.quick else 4096
    args.rates = [float("inf")] if args.quick else [1.0, 4.0, 16.0, float("inf")]
    for name in args.sections:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
