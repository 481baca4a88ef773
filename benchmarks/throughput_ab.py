"""Offline throughput of two kvflow checkouts, same run: `throughput.py`'s kvflow system, alternating A and B.

Reproduce with, e.g. (B = this checkout, A = the commit before a change):

    git worktree add /tmp/kvflow-a <commit>
    python benchmarks/throughput_ab.py --a /tmp/kvflow-a --rounds 3

Each round generates `throughput.py`'s workload (seed 0: prompts of 32-256 random tokens, 32-128 output tokens,
greedy, `ignore_eos`) with `LLM(model, dtype="bfloat16", max_num_seqs=64, max_model_len=512,
async_scheduling=True)` after an untimed warm-up, once for A and once for B, each in a fresh interpreter whose
`kvflow` and `benchmarks` come from that checkout; the order alternates between rounds so that a machine that
slows down or speeds up during the run favours neither. The default model is the built-in one, where the engine's
per-step CPU work weighs most against the forward pass. `--single-stream` sends the requests one at a time, each
alone in the engine (one stream's prefill and decode). Reported: each run's seconds and output tokens/s, the
median per checkout, and B's median tokens/s over A's (the same-run ratio RESULTS.md quotes); also each run's
process CPU time per output token, steadier than wall time on a machine whose neighbours take its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_RUN_ONE = """
import json, sys, time
from pathlib import Path
from benchmarks import throughput as t
from kvflow import LLM, SamplingParams
model, num_requests, single_stream = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
path = t._model_path(model) if model == "default" else t.ensure_checkpoint(Path(model), t.QWEN2_05B_SHAPE)
vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
workload = t.make_workload(num_requests, (32, 256), (32, 128), vocab_size, seed=0)
llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=64, max_model_len=512,
          async_scheduling=True, disable_log_stats=True)
greedy = dict(ignore_eos=True, temperature=0.0)
llm.generate([{"prompt_token_ids": workload.prompts[0]}], SamplingParams(max_tokens=4, **greedy), use_tqdm=False)
llm.reset_prefix_cache()
params = [SamplingParams(max_tokens=n, **greedy) for n in workload.output_lens]
prompts = [{"prompt_token_ids": p} for p in workload.prompts]
start, start_cpu = time.perf_counter(), time.process_time()
if single_stream:
    outputs = [llm.generate([p], [q], use_tqdm=False)[0] for p, q in zip(prompts, params)]
else:
    outputs = llm.generate(prompts, params, use_tqdm=False)
elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
assert tokens == workload.num_output_tokens
print(json.dumps({"elapsed_s": elapsed, "cpu_s": cpu, "tokens": tokens}))
"""


def run_one(
    tree: Path, model: str, num_requests: int, single_stream: bool = False
) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    completed = subprocess.run(
        [sys.executable, "-c", _RUN_ONE, model, str(num_requests), "1" if single_stream else "0"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    parser.add_argument("--b", type=Path, default=REPO, help="checkout B (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (the built-in model: per-step engine overhead shows most) or a folder for the "
        "Qwen2-0.5B-shaped checkpoint (created there if missing)",
    )
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument(
        "--single-stream",
        action="store_true",
        help="run the requests one at a time, each alone in the engine (decode speed of one stream)",
    )
    args = parser.parse_args(argv)
    rates: dict[str, list[float]] = {"A": [], "B": []}
    cpu_costs: dict[str, list[float]] = {"A": [], "B": []}
    for round_index in range(args.rounds):
        order = [("A", args.a), ("B", args.b)]
        for name, tree in order if round_index % 2 == 0 else order[::-1]:
            result = run_one(tree, args.model, args.num_requests, args.single_stream)
            rate = result["tokens"] / result["elapsed_s"]
            rates[name].append(rate)
            cpu_ms = 1000 * result["cpu_s"] / result["tokens"]
            cpu_costs[name].append(cpu_ms)
            print(
                f"round {round_index} {name}: {result['elapsed_s']:.2f} s, {rate:.1f} output tok/s, "
                f"{cpu_ms:.3f} CPU ms per token",
                flush=True,
            )
    median_a, median_b = statistics.median(rates["A"]), statistics.median(rates["B"])
    print(
        f"# python benchmarks/throughput_ab.py --a {args.a} --rounds {args.rounds} --model {args.model} "
        f"--num-requests {args.num_requests}{' --single-stream' if args.single_stream else ''}"
    )
    print(
        f"median A {median_a:.1f} tok/s, median B {median_b:.1f} tok/s, B/A {median_b / median_a:.3f}"
    )
    cpu_a, cpu_b = statistics.median(cpu_costs["A"]), statistics.median(cpu_costs["B"])
    print(
        f"median CPU ms per token: A {cpu_a:.3f}, B {cpu_b:.3f}, B/A {cpu_b / cpu_a:.3f} (the process's CPU "
        "time: what a neighbour's load on a shared machine changes least)"
    )


if __name__ == "__main__":
    main()
