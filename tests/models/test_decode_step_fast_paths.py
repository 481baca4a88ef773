"""The decode step's shortcuts equal the general paths they skip: the cpu backend's decode-only metadata, the rotary
tables cast once per dtype, the float32 RMSNorm without its no-op casts, the GGUF products and embedding rows on
flat (2-D / 1-D) inputs, and the step's largest position read as a list."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import load_cpu_kernels, quant
from kvflow.models.attention.cpu_paged import CpuKernelRows, CpuPagedAttention
from kvflow.models.decoder_lm import _max_position
from kvflow.models.layers.norm import RMSNorm
from kvflow.models.layers.rotary import RotaryEmbedding
from kvflow.models.layers.vocab import VocabEmbedding
from kvflow.models.quantization.gguf_plan import GGUFVocab
from tests.models.test_attention_backend import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    _make_step,
    _reference,
)

needs_kernels = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the cpu backend's kernel rows need the compiled kernels"
)


def _backend(dtype: torch.dtype = torch.float32) -> CpuPagedAttention:
    return CpuPagedAttention(
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        scale=HEAD_DIM**-0.5,
        dtype=dtype,
    )


def _assert_same_rows(fast: CpuKernelRows, general: CpuKernelRows) -> None:
    for name in ("token_start", "block_tables", "seq_lens"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous(), name
        assert torch.equal(a, b), name
    assert fast.query_lens is None and general.query_lens is None
    assert fast.window == general.window


@needs_kernels
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("requests", [[(5, 1)], [(5, 1), (12, 1), (0, 1), (30, 1)]])
def test_decode_only_metadata_equals_the_general_path(
    requests: list[tuple[int, int]], window: int | None
) -> None:
    batch, cache, keys, values, query, step_rows = _make_step(requests, seed=3)
    backend = _backend()
    fast = backend._decode_only_metadata(batch, window)
    general = backend._kernel_metadata(batch, window)
    assert fast is not None and general.kernel is not None and fast.kernel is not None
    _assert_same_rows(fast.kernel, general.kernel)
    assert fast.decode_only_rows() is fast.kernel
    assert general.decode_only_rows() is general.kernel
    assert fast.torch_plan.num_tokens == general.torch_plan.num_tokens == len(requests)
    assert fast.torch_plan.decode is None and general.torch_plan.decode is None
    assert fast.torch_plan.prefills == general.torch_plan.prefills == []
    assert fast.slot_mapping.dtype == torch.int64 and torch.equal(
        fast.slot_mapping, general.slot_mapping
    )
    # The lazily built whole-batch torch plan: built once, the torch backend's plan.
    assert fast.whole_torch_plan is not None
    whole = fast.whole_torch_plan()
    assert whole is fast.whole_torch_plan() and whole.decode is not None
    # What build_metadata returns for the step attends as the reference does.
    metadata = backend.build_metadata(batch, window)
    _assert_same_rows(metadata.kernel, general.kernel)  # type: ignore[arg-type]
    output = backend.forward(query, keys[step_rows], values[step_rows], cache, metadata)
    torch.testing.assert_close(
        output, _reference(requests, keys, values, query, window), atol=1e-5, rtol=1e-5
    )


@needs_kernels
@pytest.mark.parametrize(
    "requests",
    [
        [(5, 2)],  # one request, two tokens
        [(5, 1), (0, 3), (7, 1)],  # mixed
        [(5, 1), (7, 0), (4, 2)],  # as many tokens as requests, but not one each
    ],
)
def test_decode_only_metadata_declines_other_steps(requests: list[tuple[int, int]]) -> None:
    batch, *_ = _make_step(requests, seed=5)
    backend = _backend()
    assert backend._decode_only_metadata(batch, None) is None
    metadata = backend.build_metadata(batch, None)
    assert metadata.kernel is not None and metadata.decode_only_rows() is None


@needs_kernels
def test_decode_only_metadata_converts_a_batch_of_other_dtypes() -> None:
    """int64 block tables and sequence lengths (not the runner's int32) reach the kernel as int32, as the general
    path gives them; an int64 `query_start_loc` of one token per request is still a decode-only step."""
    batch, *_ = _make_step([(5, 1), (9, 1)], seed=7)
    batch.block_tables = batch.block_tables.to(torch.int64)
    batch.seq_lens = batch.seq_lens.to(torch.int64)
    batch.query_start_loc = batch.query_start_loc.to(torch.int64)
    backend = _backend()
    fast = backend._decode_only_metadata(batch, None)
    assert fast is not None and fast.kernel is not None
    _assert_same_rows(fast.kernel, backend._kernel_metadata(batch, None).kernel)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_equal_casting_the_gathered_rows(dtype: torch.dtype) -> None:
    rotary = RotaryEmbedding(64, 32, 10000.0, None, device="cpu")
    positions = torch.tensor([0, 7, 31, 3])
    cos, sin = rotary.cos_sin(positions, dtype, max_position=31)
    expected_cos = rotary.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
    expected_sin = rotary.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
    assert cos.dtype == dtype and cos.is_contiguous() and sin.is_contiguous()
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
    # Growing the cache (a position past it) rebuilds the cast tables: the new positions are there.
    far = torch.tensor([100, 5])
    cos, sin = rotary.cos_sin(far, dtype, max_position=100)
    assert rotary.cos_cache.shape[0] > 100
    assert torch.equal(cos, rotary.cos_cache.index_select(0, far).to(dtype).unsqueeze(1))
    assert torch.equal(sin, rotary.sin_cache.index_select(0, far).to(dtype).unsqueeze(1))


def test_rotary_tables_follow_a_dtype_change_of_the_module() -> None:
    rotary = RotaryEmbedding(64, 32, 10000.0, None, device="cpu")
    positions = torch.tensor([1, 30])
    rotary.cos_sin(positions, torch.float32)
    rotary.to(torch.float64)  # the caches are cast: the float32 tables are rebuilt from them
    cos, _ = rotary.cos_sin(positions, torch.float64)
    assert torch.equal(cos, rotary.cos_cache.index_select(0, positions).unsqueeze(1))
    assert rotary.cos_sin(positions, torch.float32)[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_reference_expression(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(256, 1e-6, dtype=dtype, device="cpu")
    norm.weight.data.copy_(torch.randn(256, generator=generator))
    x = (torch.randn(5, 256, generator=generator) * 3).to(dtype)
    residual = torch.randn(5, 256, generator=generator).to(dtype)
    as_float = x.float()
    variance = as_float.pow(2).mean(-1, keepdim=True)
    expected = norm.weight * (as_float * torch.rsqrt(variance + 1e-6)).to(dtype)
    assert torch.equal(norm(x), expected)
    if (
        dtype is torch.float32
    ):  # float32 without `float32_kernel`: torch's numerics, the residual added first
        normalised, summed = norm.forward_with_residual(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normalised, norm(x + residual))


def test_max_position_reads_the_largest_sequence() -> None:
    batch, *_ = _make_step([(5, 1), (30, 2), (0, 4)], seed=1)
    assert _max_position(batch) == 31
    batch.req_ids = []
    assert _max_position(batch) == 0


def _q4_k_blocks(rows: int, columns: int, seed: int) -> torch.Tensor:
    """Random but valid Q4_K rows: fp16 scales kept small and finite."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(
        0,
        256,
        (rows, quant.ggml_row_bytes("Q4_K", columns)),
        generator=generator,
        dtype=torch.uint8,
    )
    per_block = blocks.view(rows, -1, 144)
    per_block[..., 0:4] = torch.tensor([0x00, 0x1C, 0x00, 0x18], dtype=torch.uint8)  # d, dmin
    return blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ggml_linear_flat_rows_equal_batched_shapes(dtype: torch.dtype) -> None:
    blocks = _q4_k_blocks(48, 512, seed=2)
    generator = torch.Generator().manual_seed(4)
    wide = torch.randn(3, 600, generator=generator).to(dtype)
    x = wide[:, :512]  # rows 600 apart: not contiguous as a whole
    flat = quant.ggml_linear(x, "Q4_K", blocks)
    assert flat.shape == (3, 48) and flat.dtype == dtype
    assert torch.equal(flat, quant.ggml_linear(x.contiguous(), "Q4_K", blocks))
    batched = quant.ggml_linear(x.contiguous().view(1, 3, 512), "Q4_K", blocks)
    assert batched.shape == (1, 3, 48) and torch.equal(batched[0], flat)


def test_gguf_embedding_flat_ids_equal_batched_ids() -> None:
    embedding = VocabEmbedding(48, 512, dtype=torch.float32, device="cpu")
    method = GGUFVocab(embedding, "Q4_K", torch.float32)
    embedding.weight.data.copy_(_q4_k_blocks(48, 512, seed=6))
    ids = torch.tensor([3, 0, 47, 3])
    flat = method.lookup(ids)
    assert flat.shape == (4, 512)
    assert torch.equal(flat, quant.dequantize_reference("Q4_K", embedding.weight.data[ids]))
    assert torch.equal(method.lookup(ids.view(2, 2)), flat.view(2, 2, 512))
