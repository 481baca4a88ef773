"""Q8_0 GEMV on quantized activations (the default) against float32 activations (`KVFLOW_Q8_0_ACTIVATIONS=float32`),
alternated in one run on Llama-3.2-1B's decode shapes (M=1), at each thread count given: per shape the best of
`--rounds` rounds of `--calls` calls per setting, and the new / old time ratio.

    python benchmarks/q8_0_activations.py --threads 1,2
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kvflow.kernels.build import load_cpu_kernels
from kvflow.kernels.quant_choice import synthetic_weight
from kvflow.kernels.quant_plan import Q8_0_ACTIVATIONS_ENV

# (name, out features, in features): Llama-3.2-1B's products.
SHAPES = (
    ("qkv", 3072, 2048),
    ("o", 2048, 2048),
    ("gate_up", 16384, 2048),
    ("down", 2048, 8192),
    ("lm_head", 128256, 2048),
)


def _time(ops, x, weight, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        ops.ggml_linear(x, weight, 0, None, 8)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    ops = load_cpu_kernels()
    generator = torch.Generator().manual_seed(0)
    saved = os.environ.get(Q8_0_ACTIVATIONS_ENV)
    print(
        f"{'threads':>7} {'shape':>8} {'N x K':>13} {'int8 ms':>9} {'fp32 ms':>9} {'int8 GB/s':>9} {'ratio':>6}"
    )
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, rows, columns in SHAPES:
            weight = synthetic_weight("Q8_0", rows, columns, generator).data
            x = torch.randn(1, columns, generator=generator)
            calls = max(2, args.calls * 3072 // rows)
            best = {"int8": float("inf"), "float32": float("inf")}
            for _ in range(args.rounds):
                for setting in best:
                    os.environ[Q8_0_ACTIVATIONS_ENV] = setting
                    _time(ops, x, weight, 1)
                    best[setting] = min(best[setting], _time(ops, x, weight, calls))
            gbs = weight.numel() / best["int8"] / 1e9
            print(
                f"{threads:>7} {name:>8} {rows:>6}x{columns:<6} {best['int8'] * 1e3:>9.3f} "
                f"{best['float32'] * 1e3:>9.3f} {gbs:>9.1f} {best['float32'] / best['int8']:>5.2f}x"
            )
    if saved is None:
        os.environ.pop(Q8_0_ACTIVATIONS_ENV, None)
    else:
        os.environ[Q8_0_ACTIVATIONS_ENV] = saved


if __name__ == "__main__":
    main()
