"""int8 weights on AMX tiles (`int8_linear_amx`, csrc/amx.cpp): x quantized per row, exact int32 dots (TDPBSSD),
then y = dot * (d_x * scale) + bias in float32. Every step is exact or one float32 rounding in a fixed order, so the
output must equal a PyTorch computation of the same quantities bit for bit: on the scalar tile emulation (every CPU)
and on the hardware where this CPU and process can use AMX tiles (skipped elsewhere, saying so). On AVX-512 VNNI
builds int8_linear's own W8A8 product (what it runs above its GEMV rows where there is no AMX) must agree too, so
switching a machine's int8 prefill to AMX changes no output.

Shapes: N and K off the 16-row / 64-byte tile grid (staging tiles), odd tile counts both ways (the 2 x 2 blocking's
edges), M below one tile and across several, a zero x row (d_x = 0), strided x rows, bfloat16 and float32 x.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kvflow.kernels.quant import int8_quantize


@pytest.fixture(params=["emulated", "hardware"])
def emulated(request: pytest.FixtureRequest, ops: ModuleType) -> bool:
    if request.param == "hardware" and not ops.amx_usable():
        pytest.skip(
            "no AMX here (not in CPUID, or the kernel refused the tile state): emulated only"
        )
    return request.param == "emulated"


def _exact_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    rows = x.float()
    x_scales = rows.abs().amax(dim=-1, keepdim=True) / 127.0
    quants = torch.where(x_scales > 0, torch.round(rows / x_scales), 0.0).clamp_(-127, 127)
    dots = quants.to(torch.int64) @ qweight.to(torch.int64).T  # exact
    out = dots.float() * (x_scales * scale[None, :])
    return out + bias if bias is not None else out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    ("num_rows", "output_size", "input_size"),
    [(1, 7, 13), (9, 65, 300), (34, 130, 1030), (17, 48, 128), (40, 33, 64)],
)
def test_amx_int8_equals_the_exact_product(
    ops: ModuleType,
    emulated: bool,
    dtype: torch.dtype,
    num_rows: int,
    output_size: int,
    input_size: int,
) -> None:
    generator = torch.Generator().manual_seed(num_rows + 7 * output_size + input_size)
    qweight, scale = int8_quantize(torch.randn(output_size, input_size, generator=generator))
    bias = torch.randn(output_size, generator=generator)
    wide = torch.randn(num_rows, input_size + 3, generator=generator).to(dtype)
    x = wide[:, 2 : 2 + input_size]
    if num_rows > 2:
        x[1] = 0  # d_x = 0: the row's outputs are the bias
    for with_bias in (bias, None):
        out = ops.int8_linear_amx(x, qweight, scale, with_bias, emulated)
        assert out.dtype == torch.float32 and out.shape == (num_rows, output_size)
        assert torch.equal(out, _exact_reference(x, qweight, scale, with_bias))
        if ops.has_w8a8_kernels():  # int8_linear above its GEMV rows: VNNI (or AMX where usable)
            assert torch.equal(ops.int8_linear(x, qweight, scale, with_bias, 0), out)


def test_two_threads_equal_one(ops: ModuleType, emulated: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    qweight, scale = int8_quantize(torch.randn(100, 200, generator=generator))
    x = torch.randn(50, 200, generator=generator)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.int8_linear_amx(x, qweight, scale, None, emulated)
        torch.set_num_threads(2)
        two = ops.int8_linear_amx(x, qweight, scale, None, emulated)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_hardware_tiles_are_refused_where_amx_is_not_usable(ops: ModuleType) -> None:
    qweight, scale = int8_quantize(torch.randn(8, 16))
    if ops.amx_usable():
        assert ops.int8_linear_amx(torch.randn(20, 16), qweight, scale, None, False).shape == (
            20,
            8,
        )
        return
    with pytest.raises(RuntimeError, match="int8_linear_amx: this CPU"):
        ops.int8_linear_amx(torch.randn(20, 16), qweight, scale, None, False)
