"""Bidirectional attention over packed variable-length sequences on the CPU kernels (`encoder_attention.cpp`), for
the encoders of the pooling runner (`kvflow.models.bert`).

`varlen_attention` returns None where the kernel does not apply (not a CPU tensor, a dtype other than float32 /
bfloat16, the kernels off or built without AVX-512, head_dim not a multiple of 16 in [16, 256]); the caller then
runs PyTorch's attention per sequence, which is also the reference the kernel is tested against.
"""

from __future__ import annotations

import torch

from kvflow.kernels.build import load_cpu_kernels

__all__ = ["varlen_attention", "varlen_attention_uses_dpbf16"]

_DTYPES = (torch.float32, torch.bfloat16)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """`[tokens, heads * head_dim]`: each token of `query` / `key` / `value` (`[tokens, heads, head_dim]`, views with
    one set of strides, head_dim contiguous, e.g. of one qkv product) attends to every token of its sequence and to
    no other; sequence s holds tokens `cu_seqlens[s]:cu_seqlens[s + 1]` (int64, from 0 to tokens). Scores are
    `scale * q.k` under an exact softmax.

    A row's result depends only on its query row and its sequence's keys and values (bit for bit the same alone or
    in any batch). float32 is within 2e-5 of float64 (cosine >= 0.9999999); bfloat16 on a CPU with AVX512_BF16
    multiplies the bf16 inputs exactly with float32 sums and the probabilities rounded to bfloat16 against the
    values (as PyTorch's bf16 flash attention does): within 3 * (2^-8 relative + 1e-3) of float64 on the same bf16
    inputs, cosine >= 0.99997 per (token, head), about twice the error of float32 attention on the widened inputs
    rounded once (invisible in an encoder's embeddings: tests/kernels/test_encoder_attention.py, RESULTS.md);
    without AVX512_BF16 bfloat16 runs the float32 arithmetic on widened inputs.
    """
    if query.device.type != "cpu" or query.dtype not in _DTYPES:
        return None
    ops = load_cpu_kernels()
    if ops is None:
        return None
    return ops.varlen_attention(query, key, value, cu_seqlens, scale)


def varlen_attention_uses_dpbf16() -> bool:
    """Whether bfloat16 `varlen_attention` runs vdpbf16ps here (AVX512_BF16 in CPUID, an AVX-512 build)."""
    ops = load_cpu_kernels()
    return ops is not None and bool(ops.varlen_attention_uses_dpbf16())
