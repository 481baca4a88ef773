"""Quantized weights (kvflow/kernels/quant.py, csrc/quant.cpp): the pure-PyTorch GGUF decoding against the gguf
package, the test-file quantizer's round trip, and the C++ dequantization, GEMV and tiled products against the
reference over odd shapes, both activation dtypes, with and without bias, on 1 and 2 threads.

Tolerances: dequantization is exact (the same float32 operations as gguf). Products differ from
`F.linear(x.float(), dequantized, bias)` only by float32 summation order, bounded by 1e-5 of sum |x| |w| per
output (1e-4 for the bound's own rounding slack below); bfloat16 outputs additionally by one bfloat16 rounding.
A wrong nibble order, scale or a missing min term is off by a large fraction of that sum, so the checks catch it.
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import quant
from kvflow.testing.ggml_quants import quantize

QTYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
# Columns per type: whole blocks, several blocks, and for the 32-element types short rows.
COLUMNS = {
    "Q8_0": (32, 96, 768),
    "Q4_0": (32, 96, 768),
    "Q4_K": (256, 512, 768),
    "Q6_K": (256, 512, 768),
}
# Round-trip relative RMS error of `quantize` on Gaussian weights (the format's resolution for a min/max fit).
ROUND_TRIP_RMS = {"Q8_0": 0.01, "Q4_0": 0.1, "Q4_K": 0.09, "Q6_K": 0.025}
BF16_ROUNDING = 2.0**-8  # bfloat16 round-to-nearest: relative error at most half its 2^-7 spacing


def _blocks(qtype: str, rows: int, columns: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    weights = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    return weights, torch.from_numpy(quantize(qtype, weights))


@pytest.fixture
def two_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


# ---- reference decoding and the test-file maker (always run) ----


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_reference_matches_gguf(qtype: str) -> None:
    for columns in COLUMNS[qtype]:
        for rows in (1, 3, 17):
            _, blocks = _blocks(qtype, rows, columns, seed=rows * columns)
            assert blocks.shape == (rows, quant.ggml_row_bytes(qtype, columns))
            expected = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
            decoded = quant.dequantize_reference(qtype, blocks)
            assert decoded.dtype == torch.float32 and decoded.shape == (rows, columns)
            assert torch.equal(decoded, torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_round_trip(qtype: str) -> None:
    weights, blocks = _blocks(qtype, 9, 512, seed=1)
    weights[2] = 0.0
    weights[3] = np.abs(weights[3]) + 0.5  # all positive: the Q4_K min term is zero
    blocks = torch.from_numpy(quantize(qtype, weights))
    decoded = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    assert not decoded[2].any()
    relative_rms = np.sqrt(((decoded - weights) ** 2).mean() / (weights**2).mean())
    assert relative_rms < ROUND_TRIP_RMS[qtype], relative_rms


def test_row_bytes_and_errors() -> None:
    assert quant.ggml_row_bytes("Q4_K", 512) == 288
    assert quant.ggml_row_bytes("Q8_0", 64) == 68
    assert quant.GGML_BLOCK_SIZES["Q6_K"] == (256, 210)
    with pytest.raises(ValueError, match="Q4_K"):
        quant.ggml_row_bytes("Q4_K", 300)
    with pytest.raises(ValueError, match="Q5_K"):
        quant.ggml_row_bytes("Q5_K", 256)
    with pytest.raises(ValueError, match="Q4_0"):
        quant.dequantize_reference("Q4_0", torch.zeros(2, 17, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_quantize_round_trip(dtype: torch.dtype) -> None:
    weight = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
    weight[4] = 0
    qweight, scale = quant.int8_quantize(weight)
    assert qweight.dtype == torch.int8 and qweight.is_contiguous() and qweight.shape == (6, 40)
    assert scale.dtype == torch.float32 and scale.shape == (6,)
    assert int(qweight.abs().max()) == 127
    assert scale[4] == 1.0 and not qweight[4].any()  # an all-zero row: scale 1.0, quants 0
    error = (qweight.float() * scale[:, None] - weight.float()).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-6)).all())


def test_kernels_off_gives_reference(kernels_off: None) -> None:
    _, blocks = _blocks("Q4_K", 5, 256, seed=2)
    x = torch.randn(3, 256)
    linear = quant.ggml_linear_for("Q4_K")
    assert linear.path == "reference" and "reference" in linear.__name__  # type: ignore[attr-defined]
    expected = F.linear(x, quant.dequantize_reference("Q4_K", blocks))
    assert torch.equal(linear(x, blocks, None), expected)
    assert torch.equal(quant.ggml_linear(x, "Q4_K", blocks), expected)
    assert torch.equal(quant.dequantize("Q4_K", blocks), quant.dequantize_reference("Q4_K", blocks))
    qweight, scale = quant.int8_quantize(torch.randn(5, 256))
    int8_linear = quant.int8_linear_for()
    assert int8_linear.path == "reference"  # type: ignore[attr-defined]
    assert torch.equal(
        int8_linear(x, qweight, scale, None), F.linear(x, qweight.float() * scale[:, None])
    )


# ---- the C++ kernels ----


def _check_product(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """out (x's dtype) against the float32 reference within fp32 summation error (+ bf16 output rounding)."""
    assert out.dtype == x.dtype
    expected = F.linear(x.float(), weight, None if bias is None else bias.float())
    bound = 1e-4 * (x.float().abs() @ weight.abs().T + (0 if bias is None else bias.float().abs()))
    if x.dtype is torch.bfloat16:
        bound = bound + expected.abs() * BF16_ROUNDING
    difference = (out.float() - expected).abs()
    assert bool((difference <= bound + 1e-30).all()), float((difference - bound).max())


def _on_threads(fn, *args) -> torch.Tensor:
    """fn(*args) on 1 and on 2 threads, which must agree bit for bit."""
    torch.set_num_threads(1)
    single = fn(*args)
    torch.set_num_threads(2)
    double = fn(*args)
    assert torch.equal(single, double)
    return double


@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_dequantize_is_exact(ops: object, qtype: str, two_threads: None) -> None:
    for rows, columns in ((1, COLUMNS[qtype][0]), (17, COLUMNS[qtype][-1])):
        _, blocks = _blocks(qtype, rows, columns, seed=rows)
        decoded = _on_threads(quant.dequantize, qtype, blocks)
        assert torch.equal(decoded, quant.dequantize_reference(qtype, blocks))
        assert torch.equal(quant.dequantize(qtype, blocks, torch.bfloat16), decoded.bfloat16())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ggml_linear_matches_reference(
    ops: object, qtype: str, dtype: torch.dtype, two_threads: None
) -> None:
    generator = torch.Generator().manual_seed(7)
    # Columns crossing the tiled kernel's 512-column tiles, with a partial last tile.
    columns = 1280 if qtype in ("Q4_K", "Q6_K") else 1120
    linear = quant.ggml_linear_for(qtype)
    assert linear.path == ("kernel" if ops.has_avx2() else "reference")  # type: ignore[attr-defined]
    for num_rows in (7, 67):
        _, blocks = _blocks(qtype, num_rows, columns, seed=num_rows)
        weight = quant.dequantize_reference(qtype, blocks)
        bias = torch.randn(num_rows, generator=generator).to(dtype)
        for m in (1, 2, 3, 8, 9, 33, 70):
            x = torch.randn(m, columns, generator=generator).to(dtype)
            for b in (None, bias):
                _check_product(_on_threads(linear, x, blocks, b), x, weight, b)
        x = torch.randn(2, 3, columns, generator=generator).to(dtype)  # leading dims kept
        out = quant.ggml_linear(x, qtype, blocks, bias.float())
        assert out.shape == (2, 3, num_rows)
        _check_product(out.view(6, -1), x.view(6, -1), weight, bias.float())


@pytest.mark.parametrize("qtype", QTYPES)
def test_gemv_and_tiled_kernels(ops: object, qtype: str, two_threads: None) -> None:
    """Both C++ products on the same rows whatever the dispatch thresholds: the GEMV (any M, in groups of 8) and
    the tiled kernel (gemv_max_rows=0), float32 out."""
    code = quant._GGML_TYPE_CODES[qtype]
    _, blocks = _blocks(qtype, 37, 512, seed=11)
    weight = quant.dequantize_reference(qtype, blocks)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(37)
    for gemv_max_rows in (0, 64):
        for rows in (x[:1], x[:4], x):
            out = _on_threads(ops.ggml_linear, rows, blocks, code, bias, gemv_max_rows)  # type: ignore[attr-defined]
            _check_product(out, rows, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("columns", [40, 1100])
def test_int8_linear_matches_reference(
    ops: object, dtype: torch.dtype, columns: int, two_threads: None
) -> None:
    generator = torch.Generator().manual_seed(columns)
    linear = quant.int8_linear_for()
    assert linear.path == ("kernel" if ops.has_avx2() else "reference")  # type: ignore[attr-defined]
    for num_rows in (7, 67):
        qweight, scale = quant.int8_quantize(torch.randn(num_rows, columns, generator=generator))
        weight = qweight.float() * scale[:, None]
        bias = torch.randn(num_rows, generator=generator).to(dtype)
        for m in (1, 2, 3, 8, 9, 33, 70):
            x = torch.randn(m, columns, generator=generator).to(dtype)
            for b in (None, bias):
                _check_product(_on_threads(linear, x, qweight, scale, b), x, weight, b)
        for gemv_max_rows in (0, 64):  # both C++ products directly, whatever the thresholds
            x = torch.randn(10, columns, generator=generator).to(dtype)
            out = _on_threads(ops.int8_linear, x, qweight, scale, None, gemv_max_rows)  # type: ignore[attr-defined]
            _check_product(out.to(dtype), x, weight, None)
