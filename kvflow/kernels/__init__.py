"""C++ CPU kernels for decode (built on first use, see `build.py`) and the dispatch helpers the layers call.

Each helper returns the kernel's result when the kernel applies (a CPU tensor of a supported dtype and shape, the
extension loaded) and None otherwise, so the caller runs its PyTorch code: that code is both the fallback and the
reference the kernels are tested against. `KVFLOW_CPU_KERNELS=0` makes every helper return None.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Sequence

import torch

from kvflow.kernels.bf16_gemm import (
    BF16_GEMM_CHOICES,
    BF16_GEMM_ENV,
    MAX_GEMV_ROWS,
    Bf16GemmPlan,
    bf16_gemm_kernel,
    bf16_gemm_plan,
    choose_bf16_gemm_plan,
    forget_bf16_gemm_plan,
    gemm_kernel_wins,
    use_bf16_gemm_plan,
)
from kvflow.kernels.build import (
    CPU_KERNELS_ENV,
    cpu_feature_flags,
    cpu_kernels_requested,
    load_cpu_kernels,
)

__all__ = [
    "BF16_GEMM_CHOICES",
    "BF16_GEMM_ENV",
    "CPU_KERNELS_ENV",
    "MAX_GEMV_ROWS",
    "Bf16GemmPlan",
    "add_rms_norm",
    "bf16_gemm_kernel",
    "bf16_gemm_plan",
    "bf16_kernel_max_rows",
    "choose_bf16_gemm_plan",
    "cpu_executes_avx512_bf16",
    "cpu_feature_flags",
    "cpu_kernels_available",
    "cpu_kernels_requested",
    "decode_layer_max_rows",
    "forget_bf16_gemm_plan",
    "fused_moe",
    "gemm_kernel_wins",
    "gemm_kernel_wins_here",
    "linear",
    "load_cpu_kernels",
    "lora_add",
    "rotary",
    "silu_and_mul",
    "use_bf16_gemm_plan",
]

# float32 row counts (inclusive) the GEMV takes over from torch (`_float32_linear`).
FLOAT32_GEMV_ROWS = (2, MAX_GEMV_ROWS)
_ELEMENTWISE_DTYPES = (torch.bfloat16, torch.float32)


def cpu_kernels_available() -> bool:
    """Whether the compiled kernels are in use in this process (built, loaded and not disabled)."""
    return load_cpu_kernels() is not None


def decode_layer_max_rows() -> int:
    """The most rows one `decode_layer` call takes: the extension's `kMaxDecodeLayerRows` (kernels.h, the one source
    of truth), or 0 when the kernels are not in use (no fused decode at all)."""
    ops = load_cpu_kernels()
    return 0 if ops is None else int(ops.MAX_DECODE_LAYER_ROWS)


@functools.cache
def cpu_executes_avx512_bf16() -> bool:
    """Whether this CPU executes vdpbf16ps, asked of a child process (an illegal instruction kills only it): true
    on every CPU with AVX512_BF16 in CPUID and also where a hypervisor hides the flag of a CPU that has it. Tests
    and benchmarks use it to run the `avx512_bf16` kernel; `bf16_gemm_kernel` trusts only CPUID."""
    if load_cpu_kernels() is None:
        return False
    probe = (
        "from kvflow.kernels import load_cpu_kernels; print(load_cpu_kernels().avx512_bf16_probe())"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, check=False
    )
    return completed.returncode == 0 and completed.stdout.strip().endswith("32.0")


def gemm_kernel_wins_here() -> bool:
    """Whether `linear` sends bfloat16 products just above `MAX_GEMV_ROWS` rows to kvflow's GEMM in this process
    (the plan's first band, `bf16_gemm_plan`)."""
    return bf16_gemm_plan().bands[0][2] is not None


def bf16_kernel_max_rows() -> int | None:
    """The most bfloat16 rows the fused decode layer runs on the kernels in this process: `MAX_GEMV_ROWS` (the GEMV)
    where torch takes the rows just above it, else the last row of the plan's first run of bands on one GEMM kernel
    (None: every M; `Bf16GemmPlan.first_kernel_rows`)."""
    kernel, last_row = bf16_gemm_plan().first_kernel_rows()
    return MAX_GEMV_ROWS if kernel is None else last_row


def linear(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    float_output: bool = False,
) -> torch.Tensor | None:
    """`F.linear(hidden_states, weight, bias)` on the CPU where a kernel wins, else None: bfloat16 rows, and
    float32 rows in `FLOAT32_GEMV_ROWS` (`_float32_linear`).

    At most `MAX_GEMV_ROWS` rows: the decode GEMV (AVX-512 or AVX2 builds). More rows: the GEMM kernel
    `bf16_gemm_kernel` picks (none: torch). With `float_output` the bfloat16-rounded result comes back as float32 (what
    `F.linear(...).float()` gives).
    """
    if hidden_states.device.type != "cpu" or weight.dtype is not hidden_states.dtype:
        return None
    if weight.dtype is torch.float32:
        return _float32_linear(hidden_states, weight, bias)
    if weight.dtype is not torch.bfloat16:
        return None
    input_size = weight.shape[1]
    num_rows = hidden_states.numel() // input_size if input_size else 0
    if num_rows <= 0 or not weight.is_contiguous():
        return None
    use_gemm = num_rows > MAX_GEMV_ROWS
    gemm = bf16_gemm_plan().kernel_for(num_rows) if use_gemm else None
    if use_gemm and gemm is None:
        return None  # torch's product wins these rows here
    ops = load_cpu_kernels()
    # The GEMV runs with AVX-512 or AVX2 + FMA (bf16 widened in registers); the GEMM only with AVX-512
    # (`gemm_kernel_wins`).
    if ops is None or not (ops.has_avx512() if use_gemm else ops.has_avx2()):
        return None
    rows = hidden_states.reshape(num_rows, input_size)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if gemm is not None:
        out = ops.gemm_with(rows, weight, bias, float_output, gemm)
    else:
        out = ops.linear(rows, weight, bias, float_output)
    return out.view(*hidden_states.shape[:-1], weight.shape[0])


def _float32_linear(
    hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """float32 rows `FLOAT32_GEMV_ROWS[0]..[1]` through the GEMV (AVX2 or AVX-512 builds): torch's float32 GEMM
    for a few rows costs a multiple of its one-row GEMV, while the kernel streams each weight row once for all of them
    (speculative verification steps, small decode batches; benchmarks/cpu_kernels.py). Else None."""
    input_size = weight.shape[1]
    num_rows = hidden_states.numel() // input_size if input_size else 0
    low, high = FLOAT32_GEMV_ROWS
    if not low <= num_rows <= high or not weight.is_contiguous():
        return None
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
        return None
    ops = load_cpu_kernels()
    if ops is None or not ops.has_avx2():
        return None
    rows = hidden_states.reshape(num_rows, input_size)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    return ops.linear(rows, weight, bias, False).view(*hidden_states.shape[:-1], weight.shape[0])


def add_rms_norm(
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(rms_norm(hidden + residual), hidden + residual)` in one pass (residual None: `(rms_norm(hidden), hidden)`)
    for contiguous CPU bfloat16 tensors (and float32 ones when `float32`), else None. Inputs are not modified.

    bfloat16 by default: float32 RMSNorm must equal transformers bit for bit, and its mean's summation order is
    torch's. `float32` is for models whose per-op layers must equal the fused decode layer instead.
    """
    if (
        hidden_states.device.type != "cpu"
        or hidden_states.dtype
        not in ((torch.bfloat16, torch.float32) if float32 else (torch.bfloat16,))
        or weight.dtype is not hidden_states.dtype
        or not hidden_states.is_contiguous()
        or (
            residual is not None
            and (
                residual.dtype is not hidden_states.dtype
                or residual.shape != hidden_states.shape
                or not residual.is_contiguous()
            )
        )
    ):
        return None
    ops = load_cpu_kernels()
    return None if ops is None else ops.add_rms_norm(hidden_states, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` of a `[..., 2 * d]` CPU bfloat16/float32 tensor in one pass, else None."""
    if (
        gate_up.device.type != "cpu"
        or gate_up.dtype not in _ELEMENTWISE_DTYPES
        or gate_up.dim() < 1
        or gate_up.shape[-1] % 2
        or gate_up.stride(-1) != 1
    ):
        return None
    ops = load_cpu_kernels()
    if ops is None:
        return None
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    return ops.silu_and_mul(rows).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def rotary(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Neox rotary embedding of `[tokens, heads, head_dim]` (head_dim contiguous) by `[tokens, 1, head_dim / 2]`
    cos/sin of the same dtype, into a new contiguous tensor (CPU bfloat16/float32), else None."""
    if (
        heads.device.type != "cpu"
        or heads.dtype not in _ELEMENTWISE_DTYPES
        or heads.dim() != 3
        or heads.stride(2) != 1
        or cos.dtype is not heads.dtype
        or sin.dtype is not heads.dtype
        or cos.shape != (heads.shape[0], 1, heads.shape[2] // 2)
        or sin.shape != cos.shape
        or not cos.is_contiguous()
        or not sin.is_contiguous()
    ):
        return None
    ops = load_cpu_kernels()
    return None if ops is None else ops.rotary(heads, cos, sin)


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor | None:
    """A mixture-of-experts layer's experts (`FusedMoE.experts_torch`'s result) on the CPU kernel, else None.

    `hidden_states [T, H]`, stacked `w13 [E, 2I, H]` and `w2 [E, H, I]` (contiguous, hidden_states' dtype:
    bfloat16 or float32), the routing's `topk_weights` (cast to float32) and `topk_ids [T, k]`. Every group size
    runs on one product kernel, the GEMM kernel's (bfloat16: `gemm_kernel`, vdpbf16ps on AMD CPUs with AVX512_BF16;
    float32: its blocking on copied weights), which beat the GEMV kernel there from one row up
    (benchmarks/moe_kernel.py); so a token's result is bitwise the same in any batch (csrc/fused_moe.cpp).
    """
    if (
        hidden_states.device.type != "cpu"
        or hidden_states.dtype not in _ELEMENTWISE_DTYPES
        or hidden_states.dim() != 2
        or w13.dtype is not hidden_states.dtype
        or w2.dtype is not hidden_states.dtype
        or not (w13.is_contiguous() and w2.is_contiguous())
    ):
        return None
    ops = load_cpu_kernels()
    if ops is None or not ops.has_avx2():
        return None
    if hidden_states.stride(1) != 1:
        hidden_states = hidden_states.contiguous()
    return ops.fused_moe(
        hidden_states,
        w13,
        w2,
        topk_weights.to(torch.float32).contiguous(),
        topk_ids.to(torch.int64).contiguous(),
        True,  # the GEMM kernel's products (benchmarks/moe_kernel.py)
    )


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    part_offsets: Sequence[int] | torch.Tensor,
) -> bool:
    """Adds each row's LoRA delta to `y` in place on the CPU kernel (csrc/lora.cpp; the operation and its
    invariants: kvflow/lora/punica.py) and returns True; returns False, touching nothing, when the kernel does not
    apply (a non-CPU or non-bfloat16/float32 `y`, the extension off or unavailable): the caller then runs
    `kvflow.lora.punica.lora_add_reference`. Unlike the helpers above it has no result to return, hence a bool.

    `token_slots` is int32 (other integer dtypes are converted, a copy); inconsistent operands (another device
    than `y`'s included) raise RuntimeError naming the argument. A row's result is bitwise independent of the other
    rows and of the thread count.
    """
    if y.device.type != "cpu" or y.dtype not in _ELEMENTWISE_DTYPES:
        return False
    ops = load_cpu_kernels()
    if ops is None:
        return False
    if token_slots.dtype is not torch.int32:
        token_slots = token_slots.to(torch.int32)
    if isinstance(part_offsets, torch.Tensor):
        part_offsets = part_offsets.tolist()
    ops.lora_add(y, x, lora_a, lora_b, token_slots, part_offsets)
    return True
