"""Parallel engines on CPU: tensor parallelism (TP=2 vs TP=1 per-step decode time, and the bytes each step sends
to the workers), and with `--dp` data parallelism (DP=2 vs DP=1 serving throughput; see benchmarks/parallel_dp.py).

Reproduce with `python benchmarks/parallel.py` (`--quick` for a seconds-long smoke run on a tiny shape).

TP part. The checkpoint is benchmarks/throughput.py's random-weight Qwen2-0.5B-shaped model (hidden 896, 24 layers,
14 heads, 2 KV heads, intermediate 4864, vocab 32000, bfloat16; created locally on first use). Workload: 8 requests
of 64 prompt tokens each, 64 greedy output tokens (`ignore_eos`), all decoding together. Each TP size runs in
its own engine with synchronous scheduling (so a step's time is the executor's `execute_model` call) and
`tensor_parallel_size` ranks that split this machine's cores between them (TP=1: one process using every core;
TP=2: two worker processes with half the cores each, joined by gloo). Reported per TP size:
  * the median time of a pure decode step (every request decoding one token), over the steps after the first 4;
  * the bytes each step sends to the workers: the step's `SchedulerOutput`, serialized once and published once
    for all ranks (the `mp` executor's broadcast), at the first and the last decode step: it does not grow with the
    requests' history, nor with the number of ranks.
On 2 cores TP cannot win: both ranks still share the same two cores and memory bus as TP=1 did, and every layer
adds two all-reduces through gloo; what TP buys (a model split over devices' memory and compute) needs devices.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.throughput import QUICK_SHAPE, QWEN2_05B_SHAPE, ensure_checkpoint

COMMAND = "python benchmarks/parallel.py"


@dataclass
class TPResult:
    """One TP size's decode steps: their times (s) and the bytes sent to the workers per step (None: in-process)."""

    tp_size: int
    threads_per_rank: int
    decode_step_s: list[float]
    first_decode_bytes: int | None
    last_decode_bytes: int | None

    @property
    def median_step_ms(self) -> float:
        return 1000 * statistics.median(self.decode_step_s[4:] or self.decode_step_s)


def run_tp(
    path: Path,
    tp_size: int,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    num_threads: int | None = None,
) -> TPResult:
    """Generate the workload at `tp_size` and time every pure decode step's `execute_model`. `num_threads` (TP=1
    only) runs the in-process worker on that many threads instead of every core."""
    default_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _run_tp(path, tp_size, num_requests, prompt_len, max_tokens)
    finally:
        torch.set_num_threads(default_threads)


def _run_tp(
    path: Path, tp_size: int, num_requests: int, prompt_len: int, max_tokens: int
) -> TPResult:
    from kvflow import LLM, SamplingParams

    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        tensor_parallel_size=tp_size,
        async_scheduling=False,
        max_num_seqs=num_requests,
        max_model_len=prompt_len + max_tokens + 16,
        num_kv_blocks=num_requests * ((prompt_len + max_tokens) // 16 + 2),
    )
    executor = llm.run_in_engine(lambda core: core.executor)
    execute_model = executor.execute_model
    step_s: list[float] = []
    step_bytes: list[int] = []

    def timed(scheduler_output: Any, non_block: bool = False) -> Any:
        started = time.perf_counter()
        output = execute_model(scheduler_output, non_block)
        is_pure_decode = (
            not scheduler_output.scheduled_new_reqs
            and scheduler_output.total_num_scheduled_tokens == num_requests
        )
        if is_pure_decode:
            step_s.append(time.perf_counter() - started)
            if hasattr(executor, "last_broadcast_bytes"):
                step_bytes.append(executor.last_broadcast_bytes)
        return output

    prompts = [
        {"prompt_token_ids": [(seed * 131 + j * 17) % 30000 + 2 for j in range(prompt_len)]}
        for seed in range(num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    executor.execute_model = timed  # type: ignore[method-assign]
    llm.generate(prompts, params, use_tqdm=False)
    infos = llm.collective_rpc(lambda worker: torch.get_num_threads())
    llm.shutdown()
    return TPResult(
        tp_size,
        infos[0],
        step_s,
        step_bytes[0] if step_bytes else None,
        step_bytes[-1] if step_bytes else None,
    )


def print_tp(results: list[TPResult]) -> None:
    print(
        f"{'TP':>3}{'threads/rank':>14}{'decode steps':>14}{'median step ms':>16}{'bytes/step first':>18}"
        f"{'bytes/step last':>17}"
    )
    for result in results:
        first = (
            "in-process" if result.first_decode_bytes is None else str(result.first_decode_bytes)
        )
        last = "in-process" if result.last_decode_bytes is None else str(result.last_decode_bytes)
        print(
            f"{result.tp_size:>3}{result.threads_per_rank:>14}{len(result.decode_step_s):>14}"
            f"{result.median_step_ms:>16.2f}{first:>18}{last:>17}"
        )
    base = results[0]
    for result in results[1:]:
        print(
            f"TP={result.tp_size} ({result.threads_per_rank} threads/rank) / TP={base.tp_size} "
            f"({base.threads_per_rank} threads/rank) median decode step time: "
            f"{result.median_step_ms / base.median_step_ms:.2f}x"
        )


# ------------------------------------------------------------------------------------------------ DP part
def run_dp_part(args: argparse.Namespace) -> None:
    """DP=2 vs DP=1 serving throughput: real `kvflow serve` processes loaded by `kvflow bench serve`
    (benchmarks/parallel_dp.py, which says what 2 cores can and cannot show)."""
    from benchmarks.parallel_dp import run_dp_benchmark

    print("# DP part: kvflow serve --data-parallel-size 2 vs 1, same prompts, kvflow bench serve")
    for row in run_dp_benchmark(quick=args.quick):
        print(row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny shape and workload (smoke run)")
    parser.add_argument(
        "--tp-sizes", default="1,2", help="comma-separated TP sizes, the first is the base"
    )
    parser.add_argument("--num-requests", type=int, default=None, help="default 8 (quick: 4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 64 (quick: 12)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--skip-tp", action="store_true", help="skip the tensor-parallel part")
    parser.add_argument(
        "--tp1-one-thread",
        action="store_true",
        help="also run TP=1 on one thread (one rank's share of the cores): separates what TP costs or buys "
        "from what PyTorch's thread team does on a busy machine",
    )
    parser.add_argument(
        "--dp",
        action="store_true",
        help="also run the data-parallel part (benchmarks/parallel_dp.py)",
    )
    args = parser.parse_args(argv)

    shape = QUICK_SHAPE if args.quick else QWEN2_05B_SHAPE
    num_requests, prompt_len, max_tokens = (4, 16, 12) if args.quick else (8, 64, 64)
    num_requests = args.num_requests or num_requests
    max_tokens = args.max_tokens or max_tokens
    cache_root = Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
    name = "bench-quick" if args.quick else "bench-qwen2-0.5b-shape"
    print(f"# {COMMAND} {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{len(os.sched_getaffinity(0))} cores; shape {shape}"
    )
    if not args.skip_tp:
        path = ensure_checkpoint(args.checkpoint_dir or cache_root / name, shape)
        print(
            f"# TP part: {num_requests} requests x {prompt_len} prompt tokens, {max_tokens} output tokens, "
            "synchronous scheduling"
        )
        tp_sizes = [int(size) for size in args.tp_sizes.split(",")]
        results = [run_tp(path, size, num_requests, prompt_len, max_tokens) for size in tp_sizes]
        if args.tp1_one_thread:
            results.append(run_tp(path, 1, num_requests, prompt_len, max_tokens, num_threads=1))
        print_tp(results)
    if args.dp:
        run_dp_part(args)


if __name__ == "__main__":
    main()
