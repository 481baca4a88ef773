"""Quantized weights (kvflow/kernels/quant.py, csrc/quant_*.cpp): the pure-PyTorch GGUF decoding against the gguf
package, the test-file quantizer's round trip, the activation quantization of the Q4_0 / Q4_K / Q6_K products,
and the C++ dequantization, GEMV and tiled products against the reference over odd shapes, both activation
dtypes, with and without bias, on 1 and 2 threads.

Tolerances: dequantization and the activation quantization are exact (the same float32 operations as gguf, and
as the C++ kernels). Products differ from `F.linear(fake_quantize_activations(qtype, x), dequantized, bias)` (x
itself for Q8_0 and int8) only by float32 summation order, bounded by 1e-5 of sum |x| |w| per output (1e-4 for
the bound's own rounding slack below); bfloat16 outputs additionally by one bfloat16 rounding. A wrong nibble
order, scale or a missing min term is off by a large fraction of that sum, so the checks catch it (asserted for
the Q4_K min term and the Q6_K -32 offset in `test_integer_gemv_keeps_the_min_term_and_the_offset`).
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import quant
from kvflow.models.quantization.ggml_quantize import quantize
from tests.kernels.quant_static import static_quant_plans  # noqa: F401

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
    xq = quant.fake_quantize_activations("Q4_K", x)
    assert not torch.equal(xq, x)
    expected = F.linear(xq, quant.dequantize_reference("Q4_K", blocks))
    assert torch.equal(linear(x, blocks, None), expected)
    assert torch.equal(quant.ggml_linear(x, "Q4_K", blocks), expected)
    assert torch.equal(quant.dequantize("Q4_K", blocks), quant.dequantize_reference("Q4_K", blocks))
    qweight, scale = quant.int8_quantize(torch.randn(5, 256))
    int8_linear = quant.int8_linear_for()
    assert int8_linear.path == "reference"  # type: ignore[attr-defined]
    assert torch.equal(
        int8_linear(x, qweight, scale, None), F.linear(x, qweight.float() * scale[:, None])
    )


# The types whose products quantize x per block by default (Q8_0: unless KVFLOW_Q8_0_ACTIVATIONS=float32).
QUANTIZING_TYPES = (*sorted(quant.ACTIVATION_BLOCK_SIZES), "Q8_0")


@pytest.mark.parametrize("qtype", QUANTIZING_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_activations_reference(
    qtype: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a direct NumPy computation of llama.cpp's rule (d = amax / 127, q = round half to even of x / d);
    the round trip q * d is within d / 2 of x, and each nonzero block uses the full [-127, 127] range. Q8_0
    quantizes per 32 by default and not at all under KVFLOW_Q8_0_ACTIVATIONS=float32."""
    block = quant.activation_block_size(qtype)
    assert block == quant.ACTIVATION_BLOCK_SIZES.get(qtype, quant.Q8_0_ACTIVATION_BLOCK)
    x = torch.randn(2, 3, 4 * block, generator=torch.Generator().manual_seed(block)).to(dtype) * 5
    x[0, 1, block : 2 * block] = 0  # an all-zero block: d = 0, q = 0
    quants, scales = quant.quantize_activations_reference(qtype, x)
    assert quants.dtype == torch.int8 and quants.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (2, 3, 4)
    values = x.float().numpy().reshape(2, 3, 4, block)
    expected_scales = np.abs(values).max(axis=-1) / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected_quants = np.where(
            expected_scales[..., None] > 0, np.round(values / expected_scales[..., None]), 0
        )
    np.testing.assert_array_equal(scales.numpy(), expected_scales)
    np.testing.assert_array_equal(quants.numpy().reshape(values.shape), expected_quants)
    assert scales[0, 1, 1] == 0 and not quants[0, 1, block : 2 * block].any()
    assert bool((quants.view(2, 3, 4, block).abs().amax(-1) == 127).sum() == 2 * 3 * 4 - 1)
    round_trip = quant.fake_quantize_activations(qtype, x)
    error = (round_trip - x.float()).abs()
    rounding = x.float().abs() * 2.0**-23  # q * d and the difference, each rounded to float32
    bound = (scales / 2).repeat_interleave(block, dim=-1) + rounding
    assert bool((error <= bound).all())
    monkeypatch.setenv(quant.Q8_0_ACTIVATIONS_ENV, "float32")
    assert quant.activation_block_size("Q8_0") is None
    with pytest.raises(ValueError, match="Q8_0"):
        quant.quantize_activations_reference("Q8_0", x)
    assert torch.equal(quant.fake_quantize_activations("Q8_0", x), x.float())  # Q8_0: fp32 x


# ---- the C++ kernels ----


@pytest.mark.parametrize("qtype", QUANTIZING_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_activation_quantization_is_exact(
    ops: object, qtype: str, dtype: torch.dtype
) -> None:
    x = torch.randn(6, 1024, generator=torch.Generator().manual_seed(9)).to(dtype) * 3
    x[2, :256] = 0
    x[3, 7] = 1e-30  # a block of one tiny value
    x[3, 8:256] = 0
    # Halfway quotients (d = 1 exactly): round half to even, on the 16-lane path (AVX-512) as on the scalar one.
    x[5, :256] = (torch.arange(256) % 16 - 7.5).to(dtype)
    x[5, 0] = 127
    code = quant._GGML_TYPE_CODES[qtype]
    quants, scales = ops.ggml_quantize_activations(x, code)  # type: ignore[attr-defined]
    expected_quants, expected_scales = quant.quantize_activations_reference(qtype, x)
    assert torch.equal(quants, expected_quants) and torch.equal(scales, expected_scales)
    halfway = [-6, -6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6, 6, 8]  # -6.5 ... 7.5 to even
    assert scales[5, 0] == 1.0 and quants[5, 1:16].tolist() == halfway


def _check_product(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    qtype: str = "int8",
    int8_rows_quantized: bool = False,
) -> None:
    """out (x's dtype) against the float32 reference (x quantized as `qtype`'s products quantize it; int8 with
    `int8_rows_quantized`: per row, as the W8A8 kernel does) within fp32 summation error (+ bf16 output
    rounding)."""
    assert out.dtype == x.dtype
    x = (
        quant.fake_quantize_int8_rows(x)
        if int8_rows_quantized
        else quant.fake_quantize_activations(qtype, x)
    )
    expected = F.linear(x, weight, None if bias is None else bias.float())
    bound = 1e-4 * (x.abs() @ weight.abs().T + (0 if bias is None else bias.float().abs()))
    if out.dtype is torch.bfloat16:
        bound = bound + expected.abs() * BF16_ROUNDING
    difference = (out.float() - expected).abs()
    assert bool((difference <= bound + 1e-30).all()), float((difference - bound).max())


def _on_threads(fn, *args, same_bits: bool = True) -> torch.Tensor:
    """fn(*args) on 1 and on 2 threads, which must agree bit for bit; with `same_bits` False (a product that
    `_through_torch_gemm`) to within 1e-5 of the largest output (+ one bfloat16 rounding step): torch's BLAS may
    split a sum by thread count."""
    torch.set_num_threads(1)
    single = fn(*args)
    torch.set_num_threads(2)
    double = fn(*args)
    if same_bits:
        assert torch.equal(single, double)
    else:
        bound = 1e-5 * double.float().abs().max()
        if double.dtype is torch.bfloat16:
            bound = bound + double.float().abs() * 2 * BF16_ROUNDING
        assert bool(((single.float() - double.float()).abs() <= bound).all())
    return double


def _through_torch_gemm(weight_type: str, num_rows: int) -> bool:
    """Whether quant.ggml_linear / int8_linear on `num_rows` rows dequantizes and calls torch's fp32 GEMM (Q8_0 and
    int8 at prefill-sized M where the CPU has no W8A8 kernels), whose sums need not be the same on 1 and 2 threads
    (they differ on a 2-core Intel Xeon; they did not on a Zen 4 EPYC)."""
    limit = quant.INT8_TILED_MAX_ROWS if weight_type == "int8" else quant.QUANT_TILED_MAX_ROWS
    return (
        weight_type in ("int8", "Q8_0")
        and num_rows > limit
        and not quant.quantizes_activation_rows(weight_type, num_rows)
    )


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
            w8a8 = qtype == "Q8_0" and quant.quantizes_activation_rows(qtype, m)
            for b in (None, bias):
                out = _on_threads(linear, x, blocks, b, same_bits=not _through_torch_gemm(qtype, m))
                _check_product(out, x, weight, b, qtype, int8_rows_quantized=w8a8)
        x = torch.randn(2, 3, columns, generator=generator).to(dtype)  # leading dims kept
        out = quant.ggml_linear(x, qtype, blocks, bias.float())
        assert out.shape == (2, 3, num_rows)
        _check_product(out.view(6, -1), x.view(6, -1), weight, bias.float(), qtype)


@pytest.mark.parametrize("qtype", QTYPES)
def test_gemv_and_tiled_kernels(ops: object, qtype: str, two_threads: None) -> None:
    """Both C++ products on the same rows whatever the dispatch thresholds: the GEMV (any M: one pass up to 8 rows,
    above that blocked in 16-row weight tiles against 64-row blocks of x, 8 rows at a time) and the tiled kernel
    (gemv_max_rows=0), float32 out; 37 weight rows (a partial tile per thread) and up to 75 x rows (a partial
    second block). The GEMV sums each row alone, so a row's output does not depend on how many rows share the
    call: bit for bit the same in every batch, up to the rows where the Q4_0 / Q4_K / Q6_K products turn to
    interleaved weight tiles on AVX-512 VNNI builds (`test_interleaved_products_sum_each_row_alone`)."""
    code = quant._GGML_TYPE_CODES[qtype]
    _, blocks = _blocks(qtype, 37, 512, seed=11)
    weight = quant.dequantize_reference(qtype, blocks)
    x = torch.randn(75, 512, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(37)
    interleaved_above = ops.k_quant_interleaved_above_rows()  # type: ignore[attr-defined]
    for gemv_max_rows in (0, 100):
        outputs = []
        for rows in (x[:1], x[:4], x[:11], x[:16], x):
            out = _on_threads(ops.ggml_linear, rows, blocks, code, bias, gemv_max_rows)  # type: ignore[attr-defined]
            _check_product(out, rows, weight, bias, qtype)
            outputs.append(out)
        if gemv_max_rows:
            one_pass = [
                out for out in outputs if not _interleaved(qtype, out.shape[0], interleaved_above)
            ]
            for out in one_pass:
                assert torch.equal(out, one_pass[-1][: out.shape[0]])


def _interleaved(qtype: str, num_rows: int, interleaved_above: int) -> bool:
    """Whether ggml_linear's integer product on `num_rows` rows runs on interleaved weight tiles."""
    return qtype in ("Q4_0", "Q4_K", "Q6_K") and 0 <= interleaved_above < num_rows


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
def test_interleaved_products_sum_each_row_alone(
    ops: object, qtype: str, two_threads: None
) -> None:
    """Above `k_quant_interleaved_above_rows()` x rows (AVX-512 VNNI builds) the Q4_0, Q4_K and Q6_K products
    repack 16 weight rows at a time so that vector lanes are weight rows: against the reference for 37 weight rows
    (the last tile 5 rows, the rest of its lanes zero and never stored), 768 columns (3 K-quant blocks, 24 Q4_0
    ones), a bias, and row counts that leave every remainder of the 8-row passes; each x row is summed alone, so a
    row's output is the same bit for bit whatever rows share the call and on 1 or 2 threads, and the int32 dots
    stay exact at the extremes of the quants (all 15s / 63s against x of one sign: the largest sums a block can
    reach)."""
    threshold = ops.k_quant_interleaved_above_rows()  # type: ignore[attr-defined]
    if threshold < 0:
        pytest.skip("the interleaved products need an AVX-512 VNNI build")
    code = quant._GGML_TYPE_CODES[qtype]
    columns = 3 * 256
    _, blocks = _blocks(qtype, 37, columns, seed=21)
    weight = quant.dequantize_reference(qtype, blocks)
    generator = torch.Generator().manual_seed(22)
    x = torch.randn(75, columns, generator=generator)
    x[5] *= 1000.0
    bias = torch.randn(37, generator=generator)
    whole = _on_threads(ops.ggml_linear, x, blocks, code, bias, 75)  # type: ignore[attr-defined]
    _check_product(whole, x, weight, bias, qtype)
    for start, count in (
        (0, threshold + 1),
        (3, threshold + 7),
        (75 - threshold - 2, threshold + 2),
        (0, 40),
    ):
        rows = x[start : start + count]
        out = _on_threads(ops.ggml_linear, rows, blocks, code, bias, count)  # type: ignore[attr-defined]
        assert torch.equal(out, whole[start : start + count])
    # The largest quants everywhere (Q4_0 / Q4_K: nibbles 15, Q6_K: 6-bit 63), x all positive: the biggest dots.
    block_elements, block_bytes = quant.GGML_BLOCK_SIZES[qtype]
    extreme = blocks.clone().view(37, columns // block_elements, block_bytes)
    if qtype == "Q4_0":
        extreme[..., 2:] = 0xFF
    elif qtype == "Q4_K":
        extreme[..., 16:] = 0xFF
    else:
        extreme[..., :192] = 0xFF
    extreme = extreme.view(37, -1)
    positive = x[: threshold + 3].abs()
    out = _on_threads(ops.ggml_linear, positive, extreme, code, None, threshold + 3)  # type: ignore[attr-defined]
    _check_product(out, positive, quant.dequantize_reference(qtype, extreme), None, qtype)


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
        for m in (1, 2, 3, 8, 9, 33, 70, 150):
            x = torch.randn(m, columns, generator=generator).to(dtype)
            w8a8 = quant.quantizes_activation_rows("int8", m)
            for b in (None, bias):
                out = _on_threads(
                    linear, x, qweight, scale, b, same_bits=not _through_torch_gemm("int8", m)
                )
                _check_product(out, x, weight, b, int8_rows_quantized=w8a8)
        # Both C++ products directly, whatever the thresholds: the GEMV, and above gemv_max_rows the W8A8 kernel
        # (AVX-512 VNNI builds) or the tiled one.
        for gemv_max_rows in (0, 64):
            x = torch.randn(10, columns, generator=generator).to(dtype)
            out = _on_threads(ops.int8_linear, x, qweight, scale, None, gemv_max_rows)  # type: ignore[attr-defined]
            w8a8 = gemv_max_rows == 0 and ops.has_w8a8_kernels()  # type: ignore[attr-defined]
            _check_product(out.to(dtype), x, weight, None, int8_rows_quantized=w8a8)


@pytest.mark.skipif(
    not quant.quantizes_activation_rows("int8", quant.QUANT_GEMV_MAX_ROWS + 1),
    reason="the W8A8 kernels need AVX-512 VNNI",
)
@pytest.mark.parametrize("weight_type", ["int8", "Q8_0"])
def test_w8a8_kernels_sum_each_row_alone_and_quantize_x_per_row(
    weight_type: str, two_threads: None
) -> None:
    """Above their GEMV / tiled rows (AVX-512 VNNI CPUs) int8_linear and the Q8_0 product quantize each x row alone
    and sum exact int32 dots: a row's output is the same bit for bit whatever rows share the call (up to 150 rows,
    4-row weight blocks and 4- or 5-row x blocks with remainders of every size), int8's K = 1100 takes a masked
    last 64 columns and Q8_0's 35 blocks an odd last one, and the result is the product of the
    per-row fake-quantized x (a row of large values beside small ones does not coarsen them, as one scale per
    tensor would)."""
    generator = torch.Generator().manual_seed(12)
    columns = 1100 if weight_type == "int8" else 35 * 32
    if weight_type == "int8":
        qweight, scale = quant.int8_quantize(torch.randn(43, columns, generator=generator))
        weight = qweight.float() * scale[:, None]

        def product(rows: torch.Tensor) -> torch.Tensor:
            return quant.int8_linear(rows, qweight, scale, bias)

    else:
        _, blocks = _blocks(weight_type, 43, columns, seed=12)
        weight = quant.dequantize_reference(weight_type, blocks)

        def product(rows: torch.Tensor) -> torch.Tensor:
            return quant.ggml_linear(rows, weight_type, blocks, bias)

    x = torch.randn(150, columns, generator=generator)
    x[3] *= 1000.0
    bias = torch.randn(43, generator=generator)
    whole = product(x)
    _check_product(whole, x, weight, bias, int8_rows_quantized=True)
    smallest = (
        quant.QUANT_GEMV_MAX_ROWS if weight_type == "int8" else quant.QUANT_TILED_MAX_ROWS
    ) + 1
    for rows in (slice(0, smallest), slice(1, smallest + 4), slice(150 - smallest, 150)):
        assert quant.quantizes_activation_rows(weight_type, rows.stop - rows.start)
        assert torch.equal(product(x[rows]), whole[rows])
    per_tensor = quant.fake_quantize_int8_rows(x.reshape(1, -1)).view_as(x)
    assert not torch.allclose(quant.fake_quantize_int8_rows(x), per_tensor)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_integer_gemv_keeps_the_min_term_and_the_offset(
    ops: object, qtype: str, two_threads: None
) -> None:
    """x with a large mean (large sums of its quants) against Gaussian weights: the Q4_K min term (dmin * m_j per
    sub-block, against per-32 sums of x's quants) or the Q6_K -32 offset (against per-16 sums) shifts every output
    by far more than the tolerance, so an integer path that dropped it, or took the sums per the wrong group,
    fails here."""
    _, blocks = _blocks(qtype, 24, 1024, seed=4)
    weight = quant.dequantize_reference(qtype, blocks)
    per_block = blocks.view(24, 4, -1)
    if qtype == "Q4_K":  # the same blocks with dmin = 0: step * q only
        without = per_block.clone()
        without[..., 2:4] = 0
        without = quant.dequantize_reference(qtype, without.view(24, -1))
    else:  # q instead of q - 32: + 32 * d * scale_g per group of 16
        steps = per_block[..., 192:208].contiguous().view(torch.int8).float()
        steps = steps * per_block[..., 208:210].contiguous().view(torch.float16).float()
        without = weight + 32 * steps.repeat_interleave(16, dim=-1).view(24, 1024)
    generator = torch.Generator().manual_seed(6)
    linear = quant.ggml_linear_for(qtype)
    for m in (
        1,
        3,
        8,
        9,
        17,
        40,
    ):  # the GEMV, and above 8 rows the interleaved tiles on VNNI builds
        x = torch.rand(m, 1024, generator=generator) * torch.linspace(0.5, 3.0, 1024) + 1.0
        xq = quant.fake_quantize_activations(qtype, x)
        shift = (F.linear(xq, weight) - F.linear(xq, without)).abs()
        bound = 1e-4 * (xq.abs() @ weight.abs().T)
        assert bool((shift > 100 * bound).all())
        _check_product(_on_threads(linear, x, blocks, None), x, weight, None, qtype)


def test_q8_0_gemv_on_long_rows_pairs_weight_rows_and_stays_bit_for_bit(
    ops: object, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From K = 4096 on (AVX-512 builds) the one-row float32-x Q8_0 GEMV (KVFLOW_Q8_0_ACTIVATIONS=float32) runs two
    weight rows per pass sharing each x load; each row is still summed alone, so a row's output equals the one it
    gets beside other x rows (the one-row-at-a-time pass) bit for bit, with odd row counts per thread (a row left
    for the single-row pass) and a bias."""
    monkeypatch.setenv(quant.Q8_0_ACTIVATIONS_ENV, "float32")
    code = quant._GGML_TYPE_CODES["Q8_0"]
    for columns in (4096, 4096 + 32 * 3):
        _, blocks = _blocks("Q8_0", 37, columns, seed=columns)
        weight = quant.dequantize_reference("Q8_0", blocks)
        x = torch.randn(3, columns, generator=torch.Generator().manual_seed(9))
        bias = torch.randn(37)
        one = _on_threads(ops.ggml_linear, x[:1], blocks, code, bias, 8)  # type: ignore[attr-defined]
        three = _on_threads(ops.ggml_linear, x, blocks, code, bias, 8)  # type: ignore[attr-defined]
        _check_product(one, x[:1], weight, bias, "Q8_0")
        assert torch.equal(one, three[:1])


# ---- Q8_0 on quantized activations (the default) and the float32 switch ----


def _q8_0_integer_reference(
    x: torch.Tensor, blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the Q8_0 integer GEMV computes, in torch: x quantized per 32 exactly as the kernel does, each block's
    integer dot sum(q_w * q_x) exact (int64), times d_w * d_x as one float32 product per block, the blocks summed in
    float64; and the float32 summation's error scale: the magnitudes of the partial dots the kernel's lanes hold
    (4 products each) times the block scale, summed."""
    quants, x_scales = quant.quantize_activations_reference("Q8_0", x)  # [M, K], [M, K / 32]
    rows = blocks.shape[0]
    per_block = blocks.view(rows, -1, 34)
    w_quants = per_block[..., 2:].contiguous().view(torch.int8).long()  # [N, B, 32]
    w_scales = per_block[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # [N, B]
    lanes = torch.einsum(
        "mblk,nblk->mnbl", quants.long().unflatten(-1, (-1, 8, 4)), w_quants.unflatten(-1, (8, 4))
    )
    scales = (
        w_scales[None, :, :] * x_scales[:, None, :]
    ).double()  # float32, one product per block
    return (lanes.sum(-1).double() * scales).sum(-1), (
        lanes.abs().sum(-1).double() * scales.abs()
    ).sum(-1)


def test_q8_0_gemv_runs_integer_dots_on_x_quantized_per_block(
    ops: object, two_threads: None
) -> None:
    """The default Q8_0 GEMV equals the integer reference (x quantized per 32, exact int dots, one float product
    per block) within float32 summation error, on 1 and 2 threads bit for bit and for a row alone or among up to 8
    or 20 (blocked) rows; weights with quants at -128 and +127 (|q_w| = 128 needs the unsigned operand's full
    range) and an all-zero x block."""
    generator = torch.Generator().manual_seed(3)
    code = quant.ggml_type_code("Q8_0")
    for columns in (32, 96, 2048 + 32):
        _, blocks = _blocks("Q8_0", 37, columns, seed=columns)
        extremes = blocks.view(37, -1, 34)[:3, :, 2:]
        extremes[0] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
        extremes[1] = 127
        extremes[2, :, ::2] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
        x = torch.randn(20, columns, generator=generator) * 3
        x[1, :32] = 0
        x[2] = x[2].abs()  # one sign: the largest sums a block can hold
        expected, magnitude = _q8_0_integer_reference(x, blocks)
        alone = None
        for num_rows in (1, 8, 20):
            out = _on_threads(ops.ggml_linear, x[:num_rows], blocks, code, None, 20)  # type: ignore[attr-defined]
            bound = 1e-6 * magnitude[:num_rows] + 1e-30
            assert bool(((out.double() - expected[:num_rows]).abs() <= bound).all())
            if alone is None:
                alone = out
            assert torch.equal(out[:1], alone)


def test_q8_0_activations_switch_picks_the_kernel(
    ops: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVFLOW_Q8_0_ACTIVATIONS: unset or "int8" runs the integer GEMV (the block reference's numbers), "float32"
    the float32-x GEMV (the dequantized float32 model's product); the two differ by the activations' quantization
    error, far above either's float32 rounding. Any other value is a ValueError naming the variable, from the
    Python side and from the kernels (which read the variable at each call)."""
    _, blocks = _blocks("Q8_0", 64, 512, seed=4)
    weight = quant.dequantize_reference("Q8_0", blocks)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(8))
    code = quant.ggml_type_code("Q8_0")
    integer, magnitude = _q8_0_integer_reference(x, blocks)
    exact = F.linear(x.double(), weight.double())
    outputs = {}
    for value in (None, "int8", " INT8 ", "float32"):
        if value is None:
            monkeypatch.delenv(quant.Q8_0_ACTIVATIONS_ENV, raising=False)
        else:
            monkeypatch.setenv(quant.Q8_0_ACTIVATIONS_ENV, value)
        outputs[value] = ops.ggml_linear(x, blocks, code, None, 8)  # type: ignore[attr-defined]
        assert torch.equal(quant.ggml_linear(x, "Q8_0", blocks), outputs[value])
    assert torch.equal(outputs[None], outputs["int8"]) and torch.equal(
        outputs[None], outputs[" INT8 "]
    )
    assert quant.q8_0_activations() == "float32"
    assert bool(((outputs[None].double() - integer).abs() <= 1e-6 * magnitude).all())
    float_bound = 1e-6 * (x.abs() @ weight.abs().T).double()
    assert bool(((outputs["float32"].double() - exact).abs() <= float_bound).all())
    assert bool(((outputs[None].double() - exact).abs() > 10 * float_bound).any())
    monkeypatch.setenv(quant.Q8_0_ACTIVATIONS_ENV, "fp16")
    with pytest.raises(ValueError, match="KVFLOW_Q8_0_ACTIVATIONS"):
        quant.q8_0_activations()
    with pytest.raises(ValueError, match="KVFLOW_Q8_0_ACTIVATIONS"):
        ops.ggml_linear(x, blocks, code, None, 8)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="KVFLOW_Q8_0_ACTIVATIONS"):
        quant.ggml_linear(x, "Q8_0", blocks)


def test_q4_k_products_decode_every_scale_and_min_bit(ops: object, two_threads: None) -> None:
    """Q4_K blocks of random bytes: every bit pattern of the twelve packed bytes of 6-bit scales and mins (the
    quantizer's blocks leave many unused), d and dmin finite. The GEMV (its vector decoding of a block's first 16
    bytes) and the interleaved tiles match the reference, on 1 and 2 threads, and the GEMV's row is the same bit
    for bit alone or with other x rows."""
    code = quant._GGML_TYPE_CODES["Q4_K"]
    generator = torch.Generator().manual_seed(31)
    rows, columns = 29, 1024
    blocks = torch.randint(
        0, 256, (rows, columns // 256, 144), generator=generator, dtype=torch.uint8
    )
    halves = (torch.rand(rows, columns // 256, 2, generator=generator) * 0.01 + 1e-4).to(
        torch.float16
    )
    blocks[..., :4] = halves.view(torch.uint8).view(rows, columns // 256, 4)
    blocks = blocks.view(rows, -1)
    weight = quant.dequantize_reference("Q4_K", blocks)
    # sanity: the random scales and mins reach their top bits (>= 32) in both halves of the packing
    packed = blocks.view(rows, columns // 256, 144)[..., 4:16].long()
    assert bool(((packed[..., :8] >> 6) != 0).any()) and bool(((packed[..., 8:] >> 4) != 0).any())
    x = torch.randn(70, columns, generator=generator) + 0.5
    outputs = []
    for m in (1, 3, 8, 70):
        out = _on_threads(ops.ggml_linear, x[:m], blocks, code, None, 100)  # type: ignore[attr-defined]
        _check_product(out, x[:m], weight, None, "Q4_K")
        outputs.append(out)
    for out in outputs[:3]:
        assert torch.equal(out, outputs[2][: out.shape[0]])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_gemv_on_random_blocks_is_exact(ops: object, qtype: str, two_threads: None) -> None:
    """Random-byte Q4_K / Q6_K blocks (every nibble, high-bit pair, 6-bit scale and min pattern; Q6_K scales kept
    within +-31) with d = dmin = 1, against x rows of small integers whose largest magnitude per 256 is 127, so
    that x quantizes to itself (d_x = 1): every product, integer dot, float lane and lane sum is an integer below
    2^24, exact in float32, so the GEMV (M = 1..8 x rows) must equal the float64 product exactly, on 1 and 2
    threads. 203 weight rows: many row chunks per thread, the last one partial, each decoded as it would be
    alone."""
    code = quant._GGML_TYPE_CODES[qtype]
    rows, columns = 203, 1024
    block_bytes = quant.GGML_BLOCK_SIZES[qtype][1]
    generator = torch.Generator().manual_seed(41)
    blocks = torch.randint(
        0, 256, (rows, columns // 256, block_bytes), generator=generator, dtype=torch.uint8
    )
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # d (and Q4_K's dmin) = 1
    if qtype == "Q4_K":
        blocks[..., 0:2] = one
        blocks[..., 2:4] = one
    else:
        scales = torch.randint(-31, 32, (rows, columns // 256, 16), generator=generator)
        blocks[..., 192:208] = scales.to(torch.int8).view(torch.uint8)
        blocks[..., 208:210] = one
    blocks = blocks.view(rows, -1)
    weight = quant.dequantize_reference(qtype, blocks).double()
    x = torch.randint(-3, 4, (8, columns), generator=generator).float()
    x[:, ::256] = (
        127.0 * (1 - 2 * (torch.arange(8) % 2)).float()[:, None]
    )  # amax 127 in every block of 256
    for m in range(1, 9):
        out = _on_threads(ops.ggml_linear, x[:m], blocks, code, None, 8)  # type: ignore[attr-defined]
        assert torch.equal(out.double(), x[:m].double() @ weight.T)
