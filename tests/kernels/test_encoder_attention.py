"""The encoders' bidirectional varlen attention kernel (`kvflow.kernels.encoder_attention`, encoder_attention.cpp)
against a float64 reference on the same inputs, its row and batch invariance (bit for bit), and what it declines.

Tolerances: float32 within 2e-5 of float64, cosine >= 0.9999999 per (token, head). bfloat16: the kernel multiplies
the bf16 q, k exactly with float32 sums and the probabilities rounded to bfloat16 against v (as PyTorch's bf16
flash attention does), so an output is within 3 * 2^-8 relative + 3e-3 of float64 (measured: 2.6x (2^-8 + 1e-3)
at worst over 4 seeds) and the cosine per (token, head) >= 0.99997 (measured >= 0.999985); float32 attention on
the widened inputs, rounded once to bfloat16, is within 2^-8 relative + 1e-3. Sequence lengths cross the kernel's
16-key vectors, its 4-row blocks and its 256-row work items.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels.encoder_attention import varlen_attention

LENGTHS = [1, 2, 3, 15, 16, 17, 33, 64, 130, 300]


def _inputs(
    lengths: list[int], num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv `[tokens, 3, heads, head_dim]` (as the encoder's fused product lays it out) and cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    qkv = torch.randn(int(cu_seqlens[-1]), 3, num_heads, head_dim, generator=generator)
    return qkv.to(dtype), cu_seqlens


def _reference(qkv: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention per sequence, `[tokens, heads, head_dim]`."""
    query, key, value = qkv.double().unbind(1)
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
        probs = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (probs @ v).transpose(0, 1)
    return out


def _attend(qkv: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    out = varlen_attention(*qkv.unbind(1), cu_seqlens, scale)
    assert out is not None
    assert out.shape == (qkv.shape[0], qkv.shape[2] * qkv.shape[3]) and out.dtype == qkv.dtype
    return out


@pytest.mark.parametrize("head_dim", [16, 32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64(ops: object, head_dim: int, dtype: torch.dtype) -> None:
    qkv, cu_seqlens = _inputs(LENGTHS, 3, head_dim, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out = _attend(qkv, cu_seqlens, scale).view(-1, 3, head_dim).double()
    expected = _reference(qkv, cu_seqlens, scale)
    cosine = F.cosine_similarity(out, expected, dim=-1).min().item()
    if dtype is torch.float32:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
        assert cosine >= 0.9999999
    else:
        assert ((out - expected).abs() <= 3 * (expected.abs() * 2.0**-8 + 1e-3)).all()
        assert cosine >= 0.99997


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_is_bit_identical_alone_in_any_batch_and_on_any_threads(
    ops: object, dtype: torch.dtype
) -> None:
    qkv, cu_seqlens = _inputs(LENGTHS, 4, 32, dtype, seed=1)
    scale = 0.125
    batched = _attend(qkv, cu_seqlens, scale)
    bounds = cu_seqlens.tolist()
    order = list(range(len(LENGTHS)))[::-1]
    reordered_qkv = torch.cat([qkv[bounds[i] : bounds[i + 1]] for i in order])
    reordered_cu = torch.tensor([0, *torch.tensor([LENGTHS[i] for i in order]).cumsum(0).tolist()])
    reordered = _attend(reordered_qkv, reordered_cu, scale)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = _attend(qkv, cu_seqlens, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batched)
    start_in_reordered = dict(zip(order, reordered_cu.tolist(), strict=False))
    for i, length in enumerate(LENGTHS):
        start = bounds[i]
        # alone, in a fresh buffer (other addresses, other alignment)
        alone = _attend(qkv[start : start + length].clone(), torch.tensor([0, length]), scale)
        assert torch.equal(alone, batched[start : start + length])
        other = start_in_reordered[i]
        assert torch.equal(reordered[other : other + length], alone)


def test_declines_what_it_does_not_run(ops: object) -> None:
    cu_seqlens = torch.tensor([0, 5], dtype=torch.int64)
    for head_dim in (24, 8, 272):  # not a multiple of 16 in [16, 256]
        qkv = torch.randn(5, 3, 2, head_dim)
        assert varlen_attention(*qkv.unbind(1), cu_seqlens, 0.1) is None
    half = torch.randn(5, 3, 2, 32, dtype=torch.float16)
    assert varlen_attention(*half.unbind(1), cu_seqlens, 0.1) is None


def test_errors_name_the_argument(ops: object) -> None:
    qkv = torch.randn(6, 3, 2, 32)
    query, key, value = qkv.unbind(1)
    with pytest.raises(RuntimeError, match="share their strides"):
        varlen_attention(query.contiguous(), key, value, torch.tensor([0, 6]), 0.1)
    with pytest.raises(RuntimeError, match="run from 0 to tokens = 6"):
        varlen_attention(query, key, value, torch.tensor([0, 5]), 0.1)
    with pytest.raises(RuntimeError, match="must not decrease"):
        varlen_attention(query, key, value, torch.tensor([0, 4, 3, 6]), 0.1)
    with pytest.raises(RuntimeError, match="int64"):
        varlen_attention(query, key, value, torch.tensor([0, 6], dtype=torch.int32), 0.1)


def test_kernels_off_declines(kernels_off: None) -> None:
    qkv = torch.randn(4, 3, 2, 32)
    assert varlen_attention(*qkv.unbind(1), torch.tensor([0, 4]), 0.1) is None
