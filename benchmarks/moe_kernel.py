"""The mixture-of-experts kernel (`kvflow.kernels.fused_moe`) against FusedMoE's PyTorch experts path.

Reproduce with `python benchmarks/moe_kernel.py` (`--quick`: E = 32 only, fewer repeats; `--threads N`).

Qwen3-MoE-like shapes: hidden 2048, expert intermediate 768, top_k 8, E experts (32 and 128), decode T = 1 and
T = 16 tokens and a prefill of T = 512, bfloat16 and float32. The routing is `softmax_topk` on random router logits
(random weights, N(0, 0.02)); both paths get the same weights and (ids, weights). Timed: the experts only
(`FusedMoE.experts_torch` vs `kvflow.kernels.fused_moe`; the router is the same torch code on both), interleaved
call by call, median of `--repeats` each, so a busy machine slows both alike. The kernel also runs with its
products on the GEMV kernel (`gemm=False`: the alternative to the GEMM kernel it uses).
Ratio > 1: the kernel is faster.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from kvflow.distributed.parallel_state import TensorParallelGroup
from kvflow.kernels import cpu_feature_flags, fused_moe, load_cpu_kernels
from kvflow.models.layers.fused_moe import FusedMoE, softmax_topk

HIDDEN, INTERMEDIATE, TOP_K = 2048, 768, 8


def interleaved(*fns: Callable[[], object], repeats: int) -> list[float]:
    """Median seconds of each of `fns`, called in turn `repeats` times each after one warm-up call each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times, strict=True):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
    return [statistics.median(samples) for samples in times]


def build_layer(num_experts: int, dtype: torch.dtype) -> FusedMoE:
    layer = FusedMoE(
        num_experts,
        TOP_K,
        HIDDEN,
        INTERMEDIATE,
        dtype=dtype,
        device=torch.device("cpu"),
        tp=TensorParallelGroup.single(),
    )
    generator = torch.Generator().manual_seed(num_experts)
    for param in (layer.gate.weight, layer.w13_weight, layer.w2_weight):
        param.data.normal_(0.0, 0.02, generator=generator)
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--experts", type=int, nargs="*", default=None)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 512])
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_kernels()
    assert ops is not None, "the CPU kernels are off or failed to build"
    experts_list = args.experts or ([32] if args.quick else [32, 128])
    flags = cpu_feature_flags()
    print(
        f"threads {args.threads}; avx512f {'avx512f' in flags}, avx512_bf16 {'avx512_bf16' in flags}, "
        f"amx {'amx_tile' in flags}; gemm kernel {ops.gemm_kernel()}"
    )
    print(
        "| dtype | E | T | torch ms | kernel ms | torch/kernel | kernel(gemv) ms | torch/kernel(gemv) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for num_experts in experts_list:
            layer = build_layer(num_experts, dtype)
            for num_tokens in args.tokens:
                repeats = args.repeats or (
                    (3 if args.quick else 7) if num_tokens >= 256 else (5 if args.quick else 21)
                )
                x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
                x = x.to(dtype)
                weights, ids = softmax_topk(torch.nn.functional.linear(x, layer.gate.weight), TOP_K)
                w13, w2 = layer.w13_weight, layer.w2_weight
                args_ = (x, w13, w2, weights, ids)
                times = interleaved(
                    partial(layer.experts_torch, x, weights, ids),
                    partial(fused_moe, *args_),
                    partial(ops.fused_moe, *args_, False),
                    repeats=repeats,
                )
                row = (
                    f"| {dtype_name} | {num_experts} | {num_tokens} | {times[0] * 1e3:.2f} | "
                    f"{times[1] * 1e3:.2f} | {times[0] / times[1]:.2f} |"
                )
                row += f" {times[2] * 1e3:.2f} | {times[0] / times[2]:.2f} |"
                print(row, flush=True)
            del layer


if __name__ == "__main__":
    main()
