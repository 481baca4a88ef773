"""Offline throughput of two kvflow checkouts, same run: `throughput.py`'s kvflow system, alternating A and B.

Reproduce with, e.g. (B = this checkout, A = the commit before a change):

    git worktree add /tmp/kvflow-a <commit>
    python benchmarks/throughput_ab.py --a /tmp/kvflow-a --rounds 3

Each round runs `throughput.run_kvflow` (LLM over the Qwen2-0.5B-shaped checkpoint, 64 requests, async
scheduling, no compute floor) once for A and once for B, each in a fresh interpreter whose `kvflow` and
`benchmarks` come from that checkout; the order alternates between rounds so that a machine that slows down or
speeds up during the run favours neither. Reported: each run's seconds and output tokens/s, the median per
checkout, and B's median tokens/s over A's (the same-run ratio RESULTS.md quotes).
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
import json, os, sys
from pathlib import Path
from benchmarks import throughput as t
path = t.ensure_checkpoint(Path(sys.argv[1]), t.QWEN2_05B_SHAPE)
workload = t.make_workload(64, (32, 256), (32, 128), t.QWEN2_05B_SHAPE["vocab_size"], seed=0)
kwargs = {"max_num_seqs": 64, "max_model_len": 512, "async_scheduling": True, "disable_log_stats": True}
result, _, _ = t.run_kvflow(path, workload, kwargs)
print(json.dumps({"elapsed_s": result.elapsed_s, "tokens": result.output_tokens}))
"""


def run_one(tree: Path, checkpoint: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    completed = subprocess.run(
        [sys.executable, "-c", _RUN_ONE, str(checkpoint)],
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
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    cache_root = Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
    checkpoint = args.checkpoint_dir or cache_root / "bench-qwen2-0.5b-shape"
    rates: dict[str, list[float]] = {"A": [], "B": []}
    for round_index in range(args.rounds):
        order = [("A", args.a), ("B", args.b)]
        for name, tree in order if round_index % 2 == 0 else order[::-1]:
            result = run_one(tree, checkpoint)
            rate = result["tokens"] / result["elapsed_s"]
            rates[name].append(rate)
            print(
                f"round {round_index} {name}: {result['elapsed_s']:.2f} s, {rate:.1f} output tok/s",
                flush=True,
            )
    median_a, median_b = statistics.median(rates["A"]), statistics.median(rates["B"])
    print(f"# python benchmarks/throughput_ab.py --a {args.a} --rounds {args.rounds}")
    print(
        f"median A {median_a:.1f} tok/s, median B {median_b:.1f} tok/s, B/A {median_b / median_a:.3f}"
    )


if __name__ == "__main__":
    main()
