"""The batched LoRA delta kernel (`kvflow.kernels.lora_add`, csrc/lora.cpp) against its PyTorch reference
(`kvflow.lora.punica.lora_add_reference`) and against the base layer's own matmul.

Reproduce with `python benchmarks/lora_kernel.py` (`--threads N`, `--dtype float32`, `--repeats R`).

Shapes: every LoRA-targeted layer of kvflow's built-in default model (hidden 384, intermediate 1024, 6 heads x 64,
2 KV heads: qkv 384 -> 384 + 128 + 128, o 384 -> 384, gate_up 384 -> 2 x 1024, down 1024 -> 384) and of a
Qwen2-0.5B-like model (hidden 896, intermediate 4864: qkv 896 -> 896 + 128 + 128, o 896 -> 896, gate_up
896 -> 2 x 4864, down 4864 -> 896); rank 16, 8 adapter slots, n rows spread round-robin over the slots (n = 1: one
slot). Timed, interleaved call by call (median of `--repeats` each, after a warm-up): the base product
`F.linear(x, W)`, the kernel and the reference, each adding to the same y. The ratio that matters is delta / base:
what LoRA adds to the layer's cost. ref / kernel > 1: the kernel is faster.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvflow.kernels import load_cpu_kernels, lora_add
from kvflow.lora.punica import lora_add_reference

RANK, NUM_SLOTS = 16, 8
# model -> [(layer, in_features, part sizes)]
LAYERS: dict[str, list[tuple[str, int, tuple[int, ...]]]] = {
    "default": [
        ("qkv", 384, (384, 128, 128)),
        ("o", 384, (384,)),
        ("gate_up", 384, (1024, 1024)),
        ("down", 1024, (384,)),
    ],
    "qwen2-0.5b": [
        ("qkv", 896, (896, 128, 128)),
        ("o", 896, (896,)),
        ("gate_up", 896, (4864, 4864)),
        ("down", 4864, (896,)),
    ],
}


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


def time_layer(
    in_features: int, parts: tuple[int, ...], num_rows: int, dtype: torch.dtype, repeats: int
) -> tuple[float, float, float]:
    """(base, kernel, reference) median seconds for one layer shape and `num_rows` rows."""
    generator = torch.Generator().manual_seed(num_rows + in_features)
    out_features = sum(parts)
    offsets = [0]
    for size in parts:
        offsets.append(offsets[-1] + size)
    x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype)
    lora_a = (
        torch.randn(NUM_SLOTS, len(parts) * RANK, in_features, generator=generator) * 0.02
    ).to(dtype)
    lora_b = (torch.randn(NUM_SLOTS, out_features, RANK, generator=generator) * 0.02).to(dtype)
    token_slots = (torch.arange(num_rows) % NUM_SLOTS).to(torch.int32)
    y = F.linear(x, weight)

    def kernel() -> None:
        assert lora_add(y, x, lora_a, lora_b, token_slots, offsets)

    return tuple(  # type: ignore[return-value]
        interleaved(
            lambda: F.linear(x, weight),
            kernel,
            lambda: lora_add_reference(y, x, lora_a, lora_b, token_slots, offsets),
            repeats=repeats,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64, 512])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if load_cpu_kernels() is None:
        raise SystemExit("the CPU kernels are off or unavailable: nothing to compare")
    dtype = getattr(torch, args.dtype)
    print(
        f"{args.dtype}, rank {RANK}, {NUM_SLOTS} slots, {args.threads} threads; times in microseconds"
    )
    header = (
        f"{'model':<11} {'layer':<8} {'rows':>5} {'base':>9} {'kernel':>9} {'ref':>9} "
        f"{'kernel/base':>11} {'ref/base':>9} {'ref/kernel':>10}"
    )
    print(header)
    for model, layers in LAYERS.items():
        for layer, in_features, parts in layers:
            for num_rows in args.rows:
                repeats = max(5, args.repeats // max(1, num_rows // 64))
                base, kernel, reference = time_layer(in_features, parts, num_rows, dtype, repeats)
                print(
                    f"{model:<11} {layer:<8} {num_rows:>5} {base * 1e6:>9.1f} {kernel * 1e6:>9.1f} "
                    f"{reference * 1e6:>9.1f} {kernel / base:>11.2f} {reference / base:>9.2f} "
                    f"{reference / kernel:>10.2f}"
                )


if __name__ == "__main__":
    main()
