"""The C++ GEMV and fused elementwise kernels against their PyTorch references (kvflow's own layer code with the
kernels switched off), over random shapes (tails shorter than a 16-lane vector included) and dtypes.

Tolerances: RoPE and the residual sum are bitwise (the kernel rounds every intermediate the PyTorch expression
rounds); GEMV and SiLU may differ from PyTorch by one bfloat16 ulp, where a different summation order (or exp's
last float32 ulp) lands on the other side of a rounding boundary, RMSNorm by two (a one-ulp difference of the
normalised value, then the weight product's rounding), and float32 results by float32 rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvflow import kernels
from kvflow.models.attention import resolve_attention_backend
from kvflow.models.layers import Linear, LMHead, RMSNorm, RotaryEmbedding, silu_and_mul
from tests.kernels.conftest import kernels_disabled

BF16_ULP = 2.0**-7  # relative spacing of bfloat16 values (8 significant bits)


def _within_one_ulp(
    actual: torch.Tensor, expected: torch.Tensor, slack: float = 0.0, ulps: int = 1
) -> None:
    difference = (actual.float() - expected.float()).abs()
    bound = expected.float().abs() * BF16_ULP * ulps + slack
    assert bool((difference <= bound).all()), float((difference - bound).max())


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("input_size", "output_size"), [(13, 7), (40, 33), (896, 1152), (300, 65)])
def test_linear_matches_f_linear(
    ops: object, input_size: int, output_size: int, with_bias: bool
) -> None:
    generator = torch.Generator().manual_seed(input_size * output_size)
    weight = torch.randn(output_size, input_size, generator=generator).bfloat16()
    bias = torch.randn(output_size, generator=generator).bfloat16() if with_bias else None
    for num_rows in range(1, kernels.MAX_GEMV_ROWS + 1):
        rows = torch.randn(num_rows, input_size, generator=generator).bfloat16()
        out = linear_kernel(ops, rows, weight, bias)
        assert out.dtype == torch.bfloat16
        exact = F.linear(rows.float(), weight.float(), None if bias is None else bias.float())
        _within_one_ulp(out, exact, slack=1e-5 * input_size)
        _within_one_ulp(out, F.linear(rows, weight, bias), slack=1e-5 * input_size)
        as_float = linear_kernel(ops, rows, weight, bias, float_output=True)
        assert as_float.dtype == torch.float32
        assert torch.equal(as_float, out.float())  # the bf16 result, upcast


def linear_kernel(
    ops: object,
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    float_output: bool = False,
) -> torch.Tensor:
    """The GEMV kernel's product: through `kernels.linear` where the dispatch uses it (AVX-512 and AVX2 builds),
    else straight from the portable build, which the dispatch leaves to PyTorch (it is not measured to win)."""
    out = kernels.linear(rows, weight, bias, float_output=float_output)
    if ops.has_avx2():  # type: ignore[attr-defined]
        assert out is not None
        return out
    assert out is None
    return ops.linear(rows, weight, bias, float_output)  # type: ignore[attr-defined]


def test_linear_dispatch(ops: object) -> None:
    """Decode-sized bf16 rows go to the GEMV; prefill-sized rows (see test_gemm.py), float32 and strided 3-D inputs
    are handled."""
    torch.manual_seed(0)  # the same inputs whatever ran before
    layer = Linear(64, (48, 16), bias=True, dtype=torch.bfloat16, device="cpu")
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    small = torch.randn(2, 3, 64).bfloat16()  # 6 rows, leading dims kept
    if (
        ops.has_avx2()
    ):  # the layer dispatches decode rows to the GEMV kernel: bit for bit its output
        expected = ops.linear(small.reshape(6, 64), layer.weight, layer.bias, False).view(2, 3, 64)
        assert torch.equal(layer(small), expected)
    else:  # the portable build's kernels are not used by the layers: torch's linear, within rounding
        _within_one_ulp(layer(small), F.linear(small, layer.weight, layer.bias), slack=1e-3)
    large = torch.randn(kernels.MAX_GEMV_ROWS + 1, 64).bfloat16()
    _within_one_ulp(layer(large), F.linear(large, layer.weight, layer.bias), slack=1e-3)
    strided = torch.randn(3, 128).bfloat16()[:, ::2]
    _within_one_ulp(layer(strided), F.linear(strided, layer.weight, layer.bias), slack=1e-3)
    # float32: a few rows (speculative verification, small batches) through the GEMV, else torch.
    weight32 = layer.weight.float().contiguous()
    low, high = kernels.FLOAT32_GEMV_ROWS
    for num_rows in (low - 1, low, high, high + 1):
        rows32 = torch.randn(num_rows, 64)
        out = kernels.linear(rows32, weight32)
        if low <= num_rows <= high and ops.has_avx2():
            assert out is not None and torch.equal(out, ops.linear(rows32, weight32, None, False))
            torch.testing.assert_close(out, F.linear(rows32, weight32), rtol=1e-5, atol=1e-4)
        else:
            assert out is None
    head = LMHead(96, 64, dtype=torch.bfloat16, device="cpu")
    torch.nn.init.normal_(head.weight)
    logits = head(small[0])
    assert logits.dtype == torch.float32
    _within_one_ulp(logits, F.linear(small[0], head.weight).float(), slack=1e-3)


@pytest.mark.parametrize("hidden_size", [7, 64, 896, 1000])
def test_add_rms_norm(ops: object, hidden_size: int) -> None:
    generator = torch.Generator().manual_seed(hidden_size)
    norm = RMSNorm(hidden_size, 1e-6, dtype=torch.bfloat16, device="cpu")
    norm.weight.data.copy_(torch.randn(hidden_size, generator=generator))
    for num_rows in (1, 3, 70):
        hidden = torch.randn(num_rows, hidden_size, generator=generator).bfloat16()
        residual = torch.randn(num_rows, hidden_size, generator=generator).bfloat16()
        fused = kernels.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        assert fused is not None
        normed, new_residual = fused
        assert torch.equal(new_residual, hidden + residual)
        _within_one_ulp(normed, norm(hidden + residual), ulps=2)
        alone, same = kernels.add_rms_norm(hidden, None, norm.weight, norm.eps)
        assert same is hidden
        _within_one_ulp(alone, norm(hidden), ulps=2)
        # the layer uses the kernel and leaves its inputs alone
        hidden_before = hidden.clone()
        layer_normed, _ = norm.forward_with_residual(hidden, residual)
        assert torch.equal(layer_normed, normed) and torch.equal(hidden, hidden_before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [5, 64, 4864])
def test_silu_and_mul(ops: object, dtype: torch.dtype, width: int) -> None:
    gate_up = (torch.randn(4, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(
        dtype
    )
    fused = kernels.silu_and_mul(gate_up)
    half = gate_up[:, :width]
    expected = F.silu(half) * gate_up[:, width:]
    assert fused is not None and fused.shape == (4, width)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, expected, atol=1e-6, rtol=1e-6)
    else:
        _within_one_ulp(fused, expected)
        assert float((fused == expected).float().mean()) > 0.99
    assert torch.equal(silu_and_mul(gate_up), fused)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_heads", "head_dim"), [(3, 8), (16, 64), (4, 40)])
def test_rotary_is_bitwise(ops: object, dtype: torch.dtype, num_heads: int, head_dim: int) -> None:
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None, device="cpu")
    positions = torch.tensor([0, 5, 77, 200, 31])
    cos, sin = rotary.cos_sin(positions, dtype)
    fused_qkv = torch.randn(5, num_heads + 2, head_dim).to(dtype)
    heads = fused_qkv[:, :num_heads]  # a strided view, as the attention layer passes it
    half = head_dim // 2
    first, second = heads[..., :half], heads[..., half:]
    expected = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    fused = RotaryEmbedding.apply(heads, cos, sin)
    assert fused.is_contiguous()
    assert torch.equal(fused, expected)
    assert torch.equal(ops.rotary(heads, cos, sin), expected)


def _same_bits_or_both_nan(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit where `expected` is a number (a denormal's bits included), NaN where it is NaN (the quiet NaN's
    payload is not torch's either way)."""
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    assert torch.equal(actual[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_bfloat16_results_keep_denormals_next_to_nans(ops: Any) -> None:
    """Results that round to bfloat16 denormals come out as torch's, bit for bit, in vectors that also hold normal
    lanes, infinities and NaNs (AVX512_BF16's conversion, which the kernels take where it is exact, reads denormal
    inputs as zero); rows of 40 elements put them in a full and a masked tail vector."""
    generator = torch.Generator().manual_seed(7)
    tiny = torch.tensor([1e-39, -3e-40, 5e-41, 2e-39, -1.1e-38, 9e-41]).bfloat16()  # all denormal
    assert bool((tiny.float().abs() < torch.finfo(torch.float32).tiny).all())
    hidden = torch.randn(4, 40, generator=generator).bfloat16()
    residual = torch.randn(4, 40, generator=generator).bfloat16()
    hidden[0, :6], residual[0, :6] = tiny, tiny  # denormal sums, lanes 0-5
    hidden[1, 34:40], residual[1, 34:40] = tiny, torch.zeros(6).bfloat16()  # in the tail vector
    hidden[2, 3], residual[2, 9], hidden[2, 20] = float("nan"), float("inf"), 1e-39
    weight = torch.randn(40, generator=generator).bfloat16()
    _, summed = ops.add_rms_norm(hidden, residual, weight, 1e-6)
    _same_bits_or_both_nan(summed, hidden + residual)
    # RoPE's products round to bfloat16 one by one: denormal heads times cos/sin stay denormal
    heads = torch.randn(4, 2, 40, generator=generator).bfloat16()
    # both halves of a rotated pair tiny: denormal results (lanes 0-5 of token 0, the tail of token 1)
    heads[0, 0, :6], heads[0, 0, 20:26], heads[2, 0, 7] = tiny, tiny.flip(0), float("nan")
    heads[1, 1, 14:20], heads[1, 1, 34:40] = tiny, tiny
    cos = torch.rand(4, 1, 20, generator=generator).bfloat16()
    sin = torch.rand(4, 1, 20, generator=generator).bfloat16()
    first, second = heads[..., :20], heads[..., 20:]
    expected = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    assert bool(
        (expected.float().abs() < torch.finfo(torch.float32).tiny).logical_and(expected != 0).any()
    )
    _same_bits_or_both_nan(ops.rotary(heads, cos, sin), expected)


def test_setting_forces_pytorch_paths(ops: object, kernels_off: None) -> None:
    """KVFLOW_CPU_KERNELS=0: no kernel module, every dispatch declines, "auto" attention is the torch backend."""
    assert kernels.load_cpu_kernels() is None and not kernels.cpu_kernels_available()
    rows = torch.randn(1, 32).bfloat16()
    weight = torch.randn(16, 32).bfloat16()
    assert kernels.linear(rows, weight) is None
    assert kernels.add_rms_norm(rows, rows, weight[0].repeat(2), 1e-6) is None
    assert kernels.silu_and_mul(rows) is None
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("cpu", torch.device("cpu")) == "cpu"  # explicit names stay


def test_forcing_kernels_off_leaves_no_cached_choice_behind(ops: object) -> None:
    """The GEMM choice made while the kernels were forced off (torch's path) is forgotten with the setting: a test
    run after one that forced them off, in the same process, gets this CPU's own choice (an xdist worker once
    skipped the GEMM tests that way)."""
    kernels.forget_bf16_gemm_plan()
    own_choice = kernels.bf16_gemm_kernel()
    with kernels_disabled():
        assert kernels.bf16_gemm_kernel() is None and not kernels.gemm_kernel_wins_here()
    assert kernels.load_cpu_kernels() is ops
    assert kernels.bf16_gemm_kernel() == own_choice


def test_kernels_on_by_default(ops: object) -> None:
    assert kernels.cpu_kernels_available()
    assert resolve_attention_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_attention_backend("auto", torch.device("meta")) == "torch"
