"""Same-run A/B of Q8_0 decode on quantized activations (the default) against float32 activations
(`KVFLOW_Q8_0_ACTIVATIONS=float32`): one model of `benchmarks/quantized.py`'s Llama-3.2-1B-shaped Q8_0 file (made by
that script first), 128 greedy tokens of one request at a time, the setting switched in the worker between rounds
(the kernels read the variable at each call, the fused decode layer's too), alternated `--rounds` times; the
median ms per token per setting and the new / old speed ratio.

    python benchmarks/q8_0_activations_decode.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

# Run as a script: the repo root in place of this folder on sys.path (as benchmarks/quantized.py does).
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import latency
from kvflow.kernels.quant_plan import Q8_0_ACTIVATIONS_ENV

BENCH_DIR = Path(".cache/quantized-bench/llama-h2048-i8192-l16-a32-kv8-d64-v128256")


def set_activations(value: str):
    def switch(worker: Any) -> str:
        os.environ[Q8_0_ACTIVATIONS_ENV] = value
        return value

    return switch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    from kvflow import LLM

    llm = LLM(
        model=str(BENCH_DIR / "q8_0.gguf"),
        tokenizer=str(BENCH_DIR / "checkpoint"),
        max_model_len=512,
        num_kv_blocks=64,
        max_num_seqs=1,
        disable_log_stats=True,
    )
    times: dict[str, list[float]] = {"int8": [], "float32": []}
    try:
        for _ in range(args.rounds):
            for value in times:
                llm.collective_rpc(set_activations(value))
                times[value] += latency.measure_decode(
                    llm, 128256, 32, args.output_len, 1
                ).ms_per_token
    finally:
        llm.shutdown()
    medians = {value: statistics.median(ms) for value, ms in times.items()}
    for value, ms in times.items():
        rates = ", ".join(f"{1000 / t:.2f}" for t in ms)
        print(f"{value:>8}: median {1000 / medians[value]:.2f} tok/s (rounds: {rates})")
    print(f"int8 / float32 decode speed: {medians['float32'] / medians['int8']:.2f}x")


if __name__ == "__main__":
    main()
