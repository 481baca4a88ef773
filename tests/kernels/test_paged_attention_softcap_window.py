"""The "cpu" backend's kernel with logit soft-capping (Gemma 2) and on prefill rows, against a dense float64
reference and the "torch" backend (the reference backend, which soft-caps in PyTorch); and its sliding-window
reads: sequences several windows long give the reference's result, and blocks wholly before a row's window are
never read (filled with NaN, the output stays finite and unchanged), as the hybrid allocator's freed blocks
require.

Tolerances as tests/kernels/test_paged_decode_attention.py's: float32 within 2e-5 of both references, bfloat16
within one bfloat16 ulp of the exact result plus 4e-3.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.models.attention import TorchPagedAttention
from kvflow.models.attention.cpu_paged import (
    MAX_KERNEL_QUERY_LEN,
    PREFILL_IN_TORCH_ENV,
    SOFTCAP_IN_TORCH_ENV,
    CpuPagedAttention,
)
from tests.kernels.test_paged_decode_attention import Step, _dense_reference, _make_step

SOFTCAP = 2.0  # small enough that the cap bends most of these random scores

CASES = {  # (context_len, query_len) per request
    "decode_only": [(5, 1), (12, 1), (0, 1), (63, 1)],
    "mixed": [(10, 1), (0, 13), (3, 1), (8, 40), (21, 1), (4, 2)],
    "prefill_only": [(0, 37), (19, 24)],
    "long": [(300, 1), (170, 60), (0, 250)],  # several windows of 16 long
}
SHAPES = {  # (num_heads, num_kv_heads, head_dim, block_size)
    "gemma2_like_d256_bs16": (4, 2, 256, 16),
    "gqa7_d64_bs16": (14, 2, 64, 16),
    "gqa3_d40_bs4": (6, 2, 40, 4),
    "mha_d8_bs5": (4, 4, 8, 5),
}


def _backends(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    softcap: float | None,
    dtype: torch.dtype | None = None,
) -> tuple[CpuPagedAttention, TorchPagedAttention]:
    dims = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5,
        softcap=softcap,
        dtype=dtype,
    )
    return CpuPagedAttention(**dims), TorchPagedAttention(**dims)


# bfloat16 on the Gemma-2-like shape only (the kernel's arithmetic is shared across shapes)
SHAPES_AND_DTYPES = [(shape, torch.float32) for shape in SHAPES] + [
    ("gemma2_like_d256_bs16", torch.bfloat16)
]


@pytest.mark.parametrize("softcap", [SOFTCAP, None])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize(("shape", "dtype"), SHAPES_AND_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_references(
    ops: object,
    case: str,
    shape: str,
    window: int | None,
    softcap: float | None,
    dtype: torch.dtype,
) -> None:
    requests = CASES[case]
    num_heads, num_kv_heads, head_dim, block_size = SHAPES[shape]
    step = _make_step(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=len(case) + head_dim,
    )
    cpu, reference_backend = _backends(num_heads, num_kv_heads, head_dim, softcap)
    torch_cache = step.cache.clone()
    metadata = cpu.build_metadata(step.batch, window)
    # with soft-capping or a window the kernel takes every row, prefill rows included
    if softcap is not None or window is not None:
        assert metadata.kernel is not None and not metadata.torch_plan.prefills
        assert metadata.kernel.token_start.numel() == len(requests)
    else:  # short rows only: full-attention prefill rows stay on SDPA
        short = [q <= MAX_KERNEL_QUERY_LEN for _, q in requests]
        assert (metadata.kernel is not None) == any(short)
        assert len(metadata.torch_plan.prefills) >= (not all(short))
    output = cpu.forward(step.query, step.step_keys, step.step_values, step.cache, metadata)
    torch_output = reference_backend.forward(
        step.query,
        step.step_keys,
        step.step_values,
        torch_cache,
        reference_backend.build_metadata(step.batch, window),
    )
    assert torch.equal(step.cache, torch_cache)  # the same K/V writes
    exact = _dense_reference(step, requests, num_heads, window, softcap)
    if dtype == torch.float32:
        torch.testing.assert_close(output, exact.float(), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(output, torch_output, atol=2e-5, rtol=2e-5)
    else:
        error = (output.double() - exact).abs()
        assert bool((error <= exact.abs() * 2.0**-8 + 4e-3).all()), float(error.max())


def _blocks_before_windows(
    step: Step, requests: list[tuple[int, int]], window: int, block_size: int
) -> list[int]:
    """Each request's blocks that end before the window of its first query token: no query of the step sees
    them (the blocks a sliding-window group may free)."""
    stale = []
    for row, (context, _) in enumerate(requests):
        first_visible = max(0, context - window + 1)
        stale += step.batch.block_tables[row, : first_visible // block_size].tolist()
    return stale


@pytest.mark.parametrize("softcap", [SOFTCAP, None])
@pytest.mark.parametrize("case", ["long"])
def test_kernel_never_reads_blocks_outside_the_window(
    ops: object, case: str, softcap: float | None
) -> None:
    requests, window, block_size = CASES[case], 16, 4
    step = _make_step(
        requests,
        num_heads=6,
        num_kv_heads=2,
        head_dim=40,
        block_size=block_size,
        dtype=torch.float32,
        seed=11,
    )
    cpu, _ = _backends(6, 2, 40, softcap)
    metadata = cpu.build_metadata(step.batch, window)
    clean_cache = step.cache.clone()
    expected = cpu.forward(step.query, step.step_keys, step.step_values, clean_cache, metadata)
    stale = _blocks_before_windows(step, requests, window, block_size)
    assert len(stale) >= 10  # the case reaches well past its window
    step.cache[:, :, stale] = float("nan")
    output = cpu.forward(step.query, step.step_keys, step.step_values, step.cache, metadata)
    assert bool(output.isfinite().all())
    assert torch.equal(output, expected)


def test_softcap_in_torch_env_restores_the_torch_route(
    ops: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The A/B switch of benchmarks/gemma_attention.py: every row of a soft-capping model in torch, with the same
    result within float32 tolerance."""
    requests = CASES["mixed"]
    step = _make_step(
        requests,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=2,
    )
    kernel_output = None
    for softcap_in_torch in ("0", "1"):
        monkeypatch.setenv(SOFTCAP_IN_TORCH_ENV, softcap_in_torch)
        cpu, _ = _backends(4, 2, 64, SOFTCAP)
        metadata = cpu.build_metadata(step.batch, None)
        assert (metadata.kernel is None) == (softcap_in_torch == "1")
        output = cpu.forward(
            step.query, step.step_keys, step.step_values, step.cache.clone(), metadata
        )
        if kernel_output is None:
            kernel_output = output
        else:
            torch.testing.assert_close(output, kernel_output, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("prefill_in_torch", ["0", "1"])
@pytest.mark.parametrize("case", ["mixed", "prefill_only", "long"])
def test_bfloat16_model_attends_prefill_rows_in_the_kernel(
    ops: object, monkeypatch: pytest.MonkeyPatch, case: str, prefill_in_torch: str
) -> None:
    """A bfloat16 model's backend (`dtype`) gives full-attention prefill rows to the kernel as well, one
    kernel row per request, unless `PREFILL_IN_TORCH_ENV` restores SDPA for them; either way within one bfloat16
    ulp (+4e-3) of the exact result, with the same K/V writes as the torch backend. A float32 model keeps SDPA."""
    monkeypatch.setenv(PREFILL_IN_TORCH_ENV, prefill_in_torch)
    requests = CASES[case]
    num_heads, num_kv_heads, head_dim, block_size = SHAPES["gqa7_d64_bs16"]
    step = _make_step(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        seed=5,
    )
    cpu, reference_backend = _backends(num_heads, num_kv_heads, head_dim, None, torch.bfloat16)
    float32_cpu, _ = _backends(num_heads, num_kv_heads, head_dim, None, torch.float32)
    metadata = cpu.build_metadata(step.batch)
    long_rows = any(query_len > MAX_KERNEL_QUERY_LEN for _, query_len in requests)
    assert long_rows
    if prefill_in_torch == "1":
        assert len(metadata.torch_plan.prefills) >= 1
    else:
        assert metadata.kernel is not None and not metadata.torch_plan.prefills
        assert metadata.kernel.token_start.numel() == len(requests)
    assert len(float32_cpu.build_metadata(step.batch).torch_plan.prefills) >= 1
    torch_cache = step.cache.clone()
    output = cpu.forward(step.query, step.step_keys, step.step_values, step.cache, metadata)
    reference_backend.forward(
        step.query,
        step.step_keys,
        step.step_values,
        torch_cache,
        reference_backend.build_metadata(step.batch),
    )
    assert torch.equal(step.cache, torch_cache)
    exact = _dense_reference(step, requests, num_heads, None, None)
    error = (output.double() - exact).abs()
    assert bool((error <= exact.abs() * 2.0**-8 + 4e-3).all()), float(error.max())


@pytest.mark.parametrize("window", [None, 16])
def test_float16_rows_take_the_torch_path(ops: object, window: int | None) -> None:
    """The kernel takes bfloat16 and float32 only: in float16 every row, kernel rows included, is the torch
    backend's."""
    requests = CASES["mixed"]
    step = _make_step(
        requests,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float16,
        seed=8,
    )
    cpu, reference_backend = _backends(4, 2, 16, SOFTCAP)
    metadata = cpu.build_metadata(step.batch, window)
    assert metadata.kernel is not None
    output = cpu.forward(step.query, step.step_keys, step.step_values, step.cache.clone(), metadata)
    expected = reference_backend.forward(
        step.query,
        step.step_keys,
        step.step_values,
        step.cache.clone(),
        reference_backend.build_metadata(step.batch, window),
    )
    assert torch.equal(output, expected)
