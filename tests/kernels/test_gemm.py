"""The C++ bf16 GEMM (M > 8 rows) against float32 `F.linear` of the same bfloat16 inputs, and the CPU predicate that
decides where `kernels.linear` uses it.

Tolerance: the kernel rounds a float32 sum once to bfloat16, so with `ref` the float32 reference and
`sum_abs = |x| @ |w|.T (+ |bias|)`: `|out - ref| <= 2^-8 |ref| + 2 K 2^-24 sum_abs` (half a bfloat16 ulp of the
rounding, plus float32 rounding of two sums taken in different orders). `float_output` must be that bfloat16
result, upcast, bit for bit.

Shapes cover the kernel's edges: K not a multiple of 16 and wider than one K block (1024), N not a multiple of the
4-row group or the 64-row block, every last-tile height 1..6 of the 6-row x tiles, M above the 512-row pass,
strided x rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from kvflow import kernels
from kvflow.kernels import cpu_feature_flags, gemm_kernel_wins
from kvflow.models.layers import Linear

ICE_LAKE_SERVER = frozenset(
    {"fpu", "sse2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
    | {"avx512_vnni", "avx512vbmi"}
)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def _assert_close_to_reference(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    float_bias = None if bias is None else bias.float()
    reference = F.linear(x.float(), weight.float(), float_bias)
    sum_abs = F.linear(
        x.float().abs(), weight.float().abs(), None if bias is None else float_bias.abs()
    )
    bound = reference.abs() * 2.0**-8 + 2 * x.shape[-1] * 2.0**-24 * sum_abs
    excess = (out.float() - reference).abs() - bound
    assert float(excess.max()) <= 0.0, float(excess.max())


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(
    ("num_rows", "output_size", "input_size"),
    [(9, 7, 13), (17, 65, 300), (34, 130, 1030), (13, 200, 2100), (515, 70, 40)],
)
def test_gemm_matches_float32_linear(
    ops: object, threads: int, num_rows: int, output_size: int, input_size: int, with_bias: bool
) -> None:
    generator = torch.Generator().manual_seed(num_rows * output_size + input_size)
    weight = torch.randn(output_size, input_size, generator=generator).bfloat16()
    bias = torch.randn(output_size, generator=generator).bfloat16() if with_bias else None
    wide = torch.randn(num_rows, input_size + 5, generator=generator).bfloat16()
    x = wide[:, 3 : 3 + input_size]  # rows input_size + 5 apart
    out = ops.gemm(x, weight, bias, False)  # type: ignore[attr-defined]
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, output_size)
    _assert_close_to_reference(out, x, weight, bias)
    as_float = ops.gemm(x, weight, bias, True)  # type: ignore[attr-defined]
    assert as_float.dtype == torch.float32 and torch.equal(as_float, out.float())
    assert torch.equal(ops.gemm(x.contiguous(), weight, bias, False), out)  # type: ignore[attr-defined]


def test_gemm_checks_its_arguments(ops: object) -> None:
    weight = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        ops.gemm(torch.randn(9, 16), weight, None, False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.gemm(torch.randn(9, 16).bfloat16(), weight.t().contiguous().t(), None, False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="bias must be contiguous"):
        ops.gemm(torch.randn(9, 16).bfloat16(), weight, torch.zeros(7).bfloat16(), False)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("flags", "wins"),
    [
        (ICE_LAKE_SERVER, True),  # this project's CI CPU: AVX-512 without native bf16 matmul
        (ICE_LAKE_SERVER | {"avx512_bf16"}, False),  # Zen 4, Cooper Lake: oneDNN's bf16 path
        (ICE_LAKE_SERVER | {"avx512_bf16", "amx_bf16", "amx_tile"}, False),  # Sapphire Rapids
        (ICE_LAKE_SERVER - {"avx512bw"}, False),  # the kernel needs AVX512BW/VL
        (frozenset(["fpu", "sse2", "avx", "avx2", "fma"]), False),  # AVX2 only
        (frozenset(), False),  # flags unknown (not Linux)
    ],
)
def test_gemm_kernel_wins_only_without_native_bf16(flags: frozenset[str], wins: bool) -> None:
    assert gemm_kernel_wins(flags) is wins


def test_linear_dispatches_rows_above_the_gemv_to_the_gemm_where_it_wins(ops: object) -> None:
    layer = Linear(64, (48, 16), bias=True, dtype=torch.bfloat16, device="cpu")
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    hidden = torch.randn(3, kernels.MAX_GEMV_ROWS, 64).bfloat16()  # 24 rows, leading dims kept
    out = kernels.linear(hidden, layer.weight, layer.bias)
    if gemm_kernel_wins(cpu_feature_flags()) and ops.has_avx512():  # type: ignore[attr-defined]
        expected = ops.gemm(hidden.reshape(-1, 64), layer.weight, layer.bias, False)  # type: ignore[attr-defined]
        assert out is not None and torch.equal(out, expected.view(3, kernels.MAX_GEMV_ROWS, 64))
        as_float = kernels.linear(hidden, layer.weight, layer.bias, float_output=True)
        assert as_float is not None and torch.equal(as_float, out.float())
        assert torch.equal(layer(hidden), out)
    else:
        assert out is None
        assert torch.equal(layer(hidden), F.linear(hidden, layer.weight, layer.bias))
    assert kernels.linear(hidden.float(), layer.weight.float()) is None  # float32: torch's own GEMM


def test_setting_off_keeps_f_linear_for_many_rows(ops: object, kernels_off: None) -> None:
    weight = torch.randn(32, 64).bfloat16()
    assert kernels.linear(torch.randn(64, 64).bfloat16(), weight) is None
