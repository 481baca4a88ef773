"""AsyncLLM with its engine core in-process vs in its own process (`engine_process=True`), same run, same workload.

Reproduce with `python benchmarks/engine_process.py` (`--quick` for a seconds-long smoke run).

What is measured
----------------
Two workloads, each run on both clients, alternating (in-process, engine process, in-process, ...) for
`--repeats` rounds; the table reports the median and the spread (min..max) of the rounds:

1. **Hash model, short requests: requests/s.** `--hash-requests` requests (default 512), each a distinct
   `--hash-prompt-len`-token prompt (16) asking for `--hash-max-tokens` tokens (16), all submitted at once with
   `asyncio.gather` and streamed to the end (`output_kind="delta"`). The hash model's forward pass costs almost
   nothing, so this measures the per-request and per-step overhead of the front end, the client and the engine
   loop: for the engine process, msgspec encoding, the ZMQ hops, and the two processes working in parallel.
2. **Default model, long outputs: output tokens/s.** `--text-requests` concurrent requests (64), each a distinct
   short text prompt generating exactly `--text-max-tokens` tokens (128; greedy, `ignore_eos`), streamed. Here the
   model's forward pass dominates; on CPU the engine process runs torch on every core, like the in-process engine
   (see `kvflow.engine.core_proc.share_the_cores_between_engine_cores`).

Each engine is built and warmed up (a few requests) before its timed rounds; building is not timed. Wall time runs
from submitting the first request to the last output. Stats logging is off for both. The machine's load is not
controlled: on a shared machine compare the two columns of one run, not runs with each other. A second table gives
each round's CPU seconds (median): this process's, and for the engine process also the engine-core process's (from
/proc). They measure the work of each layout independently of the load; the engine process can overlap its two
parts when two cores are free.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow import SamplingParams
from kvflow.engine.async_llm import AsyncLLM

COMMAND = "python benchmarks/engine_process.py"
MODES = (("in-process", False), ("engine process", True))
HASH_OPTIONS: dict[str, Any] = dict(
    max_num_seqs=128, num_kv_blocks=4096, block_size=16, max_model_len=512, disable_log_stats=True
)
TEXT_OPTIONS: dict[str, Any] = dict(
    max_num_seqs=64, num_kv_blocks=1024, max_model_len=256, disable_log_stats=True
)
WORDS = (
    "the quick brown fox jumps over a lazy dog",
    "while seven tired cats watch from far away",
)


@dataclass(frozen=True)
class Workload:
    """One workload: the engine to build and the requests to time."""

    name: str
    unit: str  # "req/s" or "tok/s"
    model: str | None
    options: dict[str, Any]
    prompts: list[Any]
    params: SamplingParams


@dataclass
class Result:
    """Per client label: the rate of each round, and its CPU seconds (this process, the engine process)."""

    workload: str
    unit: str
    rates: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def hash_workload(num_requests: int, prompt_len: int, max_tokens: int) -> Workload:
    prompts = [
        {"prompt_token_ids": [(i * 131 + j * 17) % 30000 + 1 for j in range(prompt_len)]}
        for i in range(num_requests)
    ]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind="delta")
    return Workload("hash model, short requests", "req/s", "hash", HASH_OPTIONS, prompts, params)


def text_workload(num_requests: int, max_tokens: int) -> Workload:
    words = " ".join(WORDS).split()
    prompts = [
        " ".join(words[(i + j) % len(words)] for j in range(6)) + f" {i}"
        for i in range(num_requests)
    ]
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind="delta"
    )
    return Workload("default model, long outputs", "tok/s", None, TEXT_OPTIONS, prompts, params)


async def stream_all(llm: AsyncLLM, prompts: Sequence[Any], params: SamplingParams) -> int:
    """Submit every prompt at once, stream each to its end; returns the output tokens received."""

    async def one(prompt: Any) -> int:
        return sum(
            [len(output.outputs[0].token_ids) async for output in llm.generate(prompt, params)]
        )

    return sum(await asyncio.gather(*(one(prompt) for prompt in prompts)))


def engine_process_cpu_s(llm: AsyncLLM) -> float:
    """CPU seconds the engine-core process has used (user + system; Linux /proc), 0 for an in-process engine."""
    pid = getattr(llm.engine_core_client, "pid", None)
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_round(llm: AsyncLLM, workload: Workload) -> tuple[float, float, float]:
    """(rate, CPU seconds of this process, CPU seconds of the engine process) of one round."""
    core_cpu_start = engine_process_cpu_s(llm)
    cpu_start = time.process_time()
    start = time.perf_counter()
    num_tokens = asyncio.run(stream_all(llm, workload.prompts, workload.params))
    elapsed = time.perf_counter() - start
    front_end_cpu = time.process_time() - cpu_start
    core_cpu = engine_process_cpu_s(llm) - core_cpu_start
    expected = len(workload.prompts) * workload.params.max_tokens
    assert num_tokens == expected, f"{num_tokens} tokens, expected {expected}"
    rate = (len(workload.prompts) if workload.unit == "req/s" else num_tokens) / elapsed
    return rate, front_end_cpu, core_cpu


def run_workload(workload: Workload, repeats: int) -> Result:
    engines = {
        label: AsyncLLM(workload.model, engine_process=engine_process, **workload.options)
        for label, engine_process in MODES
    }
    result = Result(
        workload.name,
        workload.unit,
        {label: [] for label in engines},
        {label: [] for label in engines},
    )
    try:
        for llm in engines.values():  # warm-up: first steps, allocations, lazy imports
            asyncio.run(stream_all(llm, workload.prompts[:4], workload.params))
        for _ in range(repeats):
            for label, llm in engines.items():
                rate, front_end_cpu, core_cpu = timed_round(llm, workload)
                result.rates[label].append(rate)
                result.cpu[label].append((front_end_cpu, core_cpu))
    finally:
        for llm in engines.values():
            llm.shutdown()
    return result


def format_report(results: Sequence[Result], argv: Sequence[str]) -> str:
    lines = [
        f"$ {COMMAND} {shlex.join(argv)}".rstrip(),
        f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {' '.join(f'{load:.2f}' for load in os.getloadavg())}",
        "",
        f"{'workload':<30} {'unit':>6} {'in-process':>22} {'engine process':>22} {'ratio':>7}",
    ]
    for result in results:
        cells = []
        for label, _ in MODES:
            rates = result.rates[label]
            cells.append(f"{statistics.median(rates):9.1f} ({min(rates):.0f}..{max(rates):.0f})")
        ratio = statistics.median(result.rates[MODES[1][0]]) / statistics.median(
            result.rates[MODES[0][0]]
        )
        lines.append(
            f"{result.workload:<30} {result.unit:>6} {cells[0]:>22} {cells[1]:>22} {ratio:>6.2f}x"
        )
    lines.append("")
    lines.append(
        "ratio: engine process / in-process, medians (higher is better for the engine process)"
    )
    lines += [
        "",
        f"{'CPU seconds per round (median)':<37} {'in-process':>22} {'engine process':>22}",
    ]
    for result in results:
        cells = []
        for label, engine_process in MODES:
            front_end = statistics.median(cpu[0] for cpu in result.cpu[label])
            core = statistics.median(cpu[1] for cpu in result.cpu[label])
            cells.append(f"{front_end:.2f} + {core:.2f}" if engine_process else f"{front_end:.2f}")
        lines.append(f"{result.workload:<37} {cells[0]:>22} {cells[1]:>22}")
    lines.append(
        "engine process: this process + the engine-core process (CPU time is load-independent)"
    )
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per client")
    parser.add_argument("--hash-requests", type=int, default=512)
    parser.add_argument("--hash-prompt-len", type=int, default=16)
    parser.add_argument("--hash-max-tokens", type=int, default=16)
    parser.add_argument("--text-requests", type=int, default=64)
    parser.add_argument("--text-max-tokens", type=int, default=128)
    return parser


def main(argv: Sequence[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    if args.quick:
        args.repeats, args.hash_requests, args.text_requests, args.text_max_tokens = 1, 32, 4, 8
    workloads = [
        hash_workload(args.hash_requests, args.hash_prompt_len, args.hash_max_tokens),
        text_workload(args.text_requests, args.text_max_tokens),
    ]
    report = format_report([run_workload(each, args.repeats) for each in workloads], argv)
    print(report)
    return report


if __name__ == "__main__":
    main()
