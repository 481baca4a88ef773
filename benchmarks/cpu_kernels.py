"""kvflow's C++ CPU kernels against the PyTorch ops they replace, and the GEMV against the memory-read floor.

Reproduce with `python benchmarks/cpu_kernels.py` (`--quick` for a seconds-long smoke run; `--threads N`).

What is measured, all in one process, each kernel interleaved with its PyTorch counterpart (median of `--repeats`
calls each, so a busy machine slows both alike):
* **GEMV** on the Qwen2-0.5B shapes (K, N) = (896, 1152) QKV, (896, 896) o, (896, 9728) gate_up, (4864, 896)
  down, (896, 32000) LM head, bfloat16, M = 1, 4, 8 rows: `kvflow.kernels.linear` vs `F.linear`, and the
  **memory floor**: the weight's bytes divided by the read bandwidth the kernels' `stream_read` reaches on a
  buffer larger than the caches, i.e. the time just reading the weight once takes.
* **GEMM** (bfloat16, M > 8: prefill and batched decode) on the same shapes, M = 16, 64, 256, plus the full
  Qwen2-0.5B LM head (896, 151936) at M = 16: the kernel (`ops.gemm`, whether or not `kvflow.kernels.linear`
  dispatches to it on this CPU; the header says) vs `F.linear` in bfloat16, and vs `F.linear` in float32 on weights
  converted beforehand (a reference ceiling: torch's fp32 GEMM without any conversion cost).
* **GEMM kernels** on the same shapes, M = 16, 64, 256: each kernel of `ops.gemm_with` this CPU runs (widened_fp32;
  avx512_bf16 wherever the CPU executes vdpbf16ps, even with its CPUID flag hidden; amx_bf16 where AMX is usable),
  GFLOP/s and the ratio to widened_fp32; the header names the kernel `kvflow.kernels.linear` uses here.
* **Elementwise** at batch 1: add + RMSNorm (896), SiLU-and-mul (2 x 4864), RoPE (16 heads of 64), against the
  PyTorch expressions of `RMSNorm.forward_with_residual`, `silu_and_mul` and `RotaryEmbedding.apply`.
* **Decode attention**: one decode row over 160 cached tokens (14 query / 2 KV heads of 64, blocks of 16, K/V write
  included), the "cpu" backend against the "torch" backend.
Ratios > 1 mean the kernel is faster. The kernels are built (or loaded from the cache) first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvflow.batch import BatchInputs
from kvflow.kernels import (
    bf16_gemm_kernel,
    cpu_executes_avx512_bf16,
    cpu_feature_flags,
    gemm_kernel_wins,
    load_cpu_kernels,
)
from kvflow.models.attention import TorchPagedAttention
from kvflow.models.attention.cpu_paged import CpuPagedAttention

GEMV_SHAPES = {
    "qkv": (896, 1152),
    "o": (896, 896),
    "gate_up": (896, 9728),
    "down": (4864, 896),
    "lm_head": (896, 32000),
}


def interleaved(*fns: Callable[[], object], repeats: int) -> tuple[float, ...]:
    """Median seconds of each of `fns`, called in turn `repeats` times each after a warm-up."""
    for _ in range(3):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for index, fn in enumerate(fns):
            started = time.perf_counter()
            fn()
            times[index].append(time.perf_counter() - started)
    return tuple(statistics.median(series) for series in times)


def read_bandwidth(ops: object, num_bytes: int, repeats: int) -> float:
    """Bytes per second `stream_read` reaches over a `num_bytes` buffer (median of `repeats` passes)."""
    buffer = torch.ones(num_bytes, dtype=torch.uint8)
    ops.stream_read(buffer)  # type: ignore[attr-defined]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        ops.stream_read(buffer)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - started)
    return num_bytes / statistics.median(times)


def bench_gemv(ops: object, rows: list[int], repeats: int, bandwidth: float) -> None:
    print(
        f"{'GEMV (bf16)':<12} {'M':>2} {'torch us':>9} {'kernel us':>9} {'speedup':>8} "
        f"{'kernel GB/s':>11} {'floor us':>9} {'floor/kernel':>12}"
    )
    generator = torch.Generator().manual_seed(0)
    for name, (input_size, output_size) in GEMV_SHAPES.items():
        weight = torch.randn(output_size, input_size, generator=generator).bfloat16()
        floor = weight.numel() * 2 / bandwidth
        for num_rows in rows:
            x = torch.randn(num_rows, input_size, generator=generator).bfloat16()
            torch_s, kernel_s = interleaved(
                lambda x=x, weight=weight: F.linear(x, weight),
                lambda x=x, weight=weight: ops.linear(x, weight, None, False),  # type: ignore[attr-defined]
                repeats=repeats,
            )
            print(
                f"{name:<12} {num_rows:>2} {torch_s * 1e6:>9.0f} {kernel_s * 1e6:>9.0f} "
                f"{torch_s / kernel_s:>7.2f}x {weight.numel() * 2 / kernel_s / 1e9:>11.1f} "
                f"{floor * 1e6:>9.0f} {floor / kernel_s:>12.2f}"
            )


def bench_gemm(
    ops: object, rows: list[int], head_rows: list[int], head_size: int, repeats: int
) -> None:
    dispatch = (
        "kernel" if gemm_kernel_wins(cpu_feature_flags()) else "torch (native bf16 or no AVX-512)"
    )
    print(f"\nGEMM (bf16, M > 8): kernels.linear dispatches to {dispatch} on this CPU")
    print(
        f"{'GEMM (bf16)':<12} {'M':>4} {'torch us':>9} {'kernel us':>9} {'speedup':>8} "
        f"{'fp32 us':>9} {'fp32/kernel':>11} {'kernel GFLOP/s':>14}"
    )
    generator = torch.Generator().manual_seed(1)
    shapes = [(name, shape, rows) for name, shape in GEMV_SHAPES.items() if name != "lm_head"]
    shapes.append(("lm_head", (GEMV_SHAPES["lm_head"][0], head_size), head_rows))
    for name, (input_size, output_size), row_counts in shapes:
        weight = torch.randn(output_size, input_size, generator=generator).bfloat16()
        weight_fp32 = weight.float()
        for num_rows in row_counts:
            x = torch.randn(num_rows, input_size, generator=generator).bfloat16()
            x_fp32 = x.float()
            torch_s, kernel_s, fp32_s = interleaved(
                lambda x=x, weight=weight: F.linear(x, weight),
                lambda x=x, weight=weight: ops.gemm(x, weight, None, False),  # type: ignore[attr-defined]
                lambda x=x_fp32, weight=weight_fp32: F.linear(x, weight),
                repeats=repeats,
            )
            flops = 2.0 * num_rows * input_size * output_size
            print(
                f"{name:<12} {num_rows:>4} {torch_s * 1e6:>9.0f} {kernel_s * 1e6:>9.0f} "
                f"{torch_s / kernel_s:>7.2f}x {fp32_s * 1e6:>9.0f} {fp32_s / kernel_s:>10.2f} "
                f"{flops / kernel_s / 1e9:>14.0f}"
            )


def bench_gemm_kernels(ops: object, rows: list[int], repeats: int) -> None:
    kernels = ["widened_fp32"]
    if cpu_executes_avx512_bf16():
        kernels.append("avx512_bf16")
    if ops.amx_usable():  # type: ignore[attr-defined]
        kernels.append("amx_bf16")
    bf16_in_cpuid = "avx512_bf16" in cpu_feature_flags()
    print(
        f"\nGEMM kernels (bf16): kernels.linear uses {bf16_gemm_kernel() or 'torch'} here; AVX512_BF16 "
        f"{'in CPUID' if bf16_in_cpuid else 'not in CPUID'}"
        + (", vdpbf16ps executed anyway" if "avx512_bf16" in kernels and not bf16_in_cpuid else "")
        + f"; AMX {'usable' if 'amx_bf16' in kernels else 'not usable'}"
    )
    header = "".join(f" {name + ' GF/s':>18}" for name in kernels)
    ratios = "".join(f" {name + '/widened':>20}" for name in kernels[1:])
    print(f"{'GEMM (bf16)':<12} {'M':>4}{header}{ratios}")
    generator = torch.Generator().manual_seed(2)
    for name, (input_size, output_size) in GEMV_SHAPES.items():
        if name == "lm_head":
            continue
        weight = torch.randn(output_size, input_size, generator=generator).bfloat16()
        for num_rows in rows:
            x = torch.randn(num_rows, input_size, generator=generator).bfloat16()
            seconds = interleaved(
                *[
                    lambda x=x, weight=weight, kernel=kernel: ops.gemm_with(
                        x, weight, None, False, kernel
                    )  # type: ignore[attr-defined]
                    for kernel in kernels
                ],
                repeats=repeats,
            )
            flops = 2.0 * num_rows * input_size * output_size
            rates = "".join(f" {flops / s / 1e9:>18.0f}" for s in seconds)
            versus = "".join(f" {seconds[0] / s:>19.2f}x" for s in seconds[1:])
            print(f"{name:<12} {num_rows:>4}{rates}{versus}")


def bench_elementwise(ops: object, repeats: int) -> None:
    print(f"\n{'op (batch 1)':<28} {'torch us':>9} {'kernel us':>9} {'speedup':>8}")
    hidden = torch.randn(1, 896).bfloat16()
    residual = torch.randn(1, 896).bfloat16()
    weight = torch.randn(896).bfloat16()

    def torch_norm() -> object:
        summed = hidden + residual
        as_float = summed.float()
        variance = as_float.pow(2).mean(-1, keepdim=True)
        return weight * (as_float * torch.rsqrt(variance + 1e-6)).to(torch.bfloat16), summed

    gate_up = torch.randn(1, 2 * 4864).bfloat16()
    qk = torch.randn(1, 18, 64).bfloat16()[:, :16]
    cos, sin = torch.randn(1, 1, 32).bfloat16(), torch.randn(1, 1, 32).bfloat16()

    def torch_rope() -> object:
        first, second = qk[..., :32], qk[..., 32:]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    cases = {
        "add + RMSNorm (896)": (
            torch_norm,
            lambda: ops.add_rms_norm(hidden, residual, weight, 1e-6),  # type: ignore[attr-defined]
        ),
        "SiLU-and-mul (2 x 4864)": (
            lambda: F.silu(gate_up[..., :4864]) * gate_up[..., 4864:],
            lambda: ops.silu_and_mul(gate_up),  # type: ignore[attr-defined]
        ),
        "RoPE (16 heads x 64)": (torch_rope, lambda: ops.rotary(qk, cos, sin)),  # type: ignore[attr-defined]
    }
    for name, (torch_fn, kernel_fn) in cases.items():
        torch_s, kernel_s = interleaved(torch_fn, kernel_fn, repeats=repeats)
        print(
            f"{name:<28} {torch_s * 1e6:>9.1f} {kernel_s * 1e6:>9.1f} {torch_s / kernel_s:>7.2f}x"
        )


def bench_attention(repeats: int, context: int = 160) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 14, 2, 64, 16
    num_blocks = context // block_size + 4
    dims = dict(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=head_dim**-0.5
    )
    cache = torch.randn(
        TorchPagedAttention.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    ).bfloat16()
    batch = BatchInputs(
        req_ids=["a"],
        block_size=block_size,
        input_ids=torch.zeros(1, dtype=torch.int64),
        positions=torch.tensor([context - 1]),
        slot_mapping=torch.tensor([context - 1]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([context], dtype=torch.int32),
        block_tables=torch.randperm(num_blocks, dtype=torch.int32)[None],
        logits_indices=torch.zeros(1, dtype=torch.int64),
        sampled_req_indices=torch.zeros(1, dtype=torch.int64),
    )
    query = torch.randn(1, num_heads, head_dim).bfloat16()
    key = torch.randn(1, num_kv_heads, head_dim).bfloat16()
    value = torch.randn(1, num_kv_heads, head_dim).bfloat16()
    torch_backend, cpu_backend = TorchPagedAttention(**dims), CpuPagedAttention(**dims)
    torch_plan, cpu_plan = torch_backend.build_metadata(batch), cpu_backend.build_metadata(batch)
    torch_s, kernel_s = interleaved(
        lambda: torch_backend.forward(query, key, value, cache, torch_plan),
        lambda: cpu_backend.forward(query, key, value, cache, cpu_plan),
        repeats=repeats,
    )
    name = f"decode attention ({context} tok)"
    print(f"{name:<28} {torch_s * 1e6:>9.1f} {kernel_s * 1e6:>9.1f} {torch_s / kernel_s:>7.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="M = 1 only, few repeats")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per op (default 30)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (5 if args.quick else 30)
    ops = load_cpu_kernels()
    if ops is None:
        raise SystemExit(
            "the CPU kernels are not available (KVFLOW_CPU_KERNELS=0 or the build failed)"
        )
    bandwidth = read_bandwidth(ops, (64 if args.quick else 512) * 2**20, repeats)
    print(
        f"threads {torch.get_num_threads()}, torch {torch.__version__}, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s (stream_read)\n"
    )
    with torch.inference_mode():
        bench_gemv(ops, [1] if args.quick else [1, 4, 8], repeats, bandwidth)
        if args.quick:  # the 272 MB LM head would dominate a smoke run
            bench_gemm(ops, [16], [16], GEMV_SHAPES["lm_head"][1], repeats)
        else:
            bench_gemm(ops, [16, 64, 256], [16], 151936, max(5, repeats // 3))
        bench_gemm_kernels(ops, [16] if args.quick else [16, 64, 256], max(5, repeats // 3))
        bench_elementwise(ops, repeats * 10)
        bench_attention(repeats * 10)


if __name__ == "__main__":
    main()
