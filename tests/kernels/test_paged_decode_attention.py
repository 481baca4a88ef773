"""The "cpu" attention backend (C++ decode kernel reading K/V through the block table) against a dense float64
reference and against the "torch" backend, on paged layouts: shuffled block ids, partial last blocks, requests of
different lengths, decode rows mixed with prefill rows, GQA groups, sliding windows, bfloat16 and float32.

Tolerances: float32 within 2e-5 (the kernel's online softmax sums in another order); bfloat16 within one bfloat16
ulp of the output plus 4e-3 (the kernel keeps scores and probabilities in float32 where the torch backend rounds
them to bfloat16, so the kernel is the closer of the two to the exact result).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvflow.batch import BatchInputs
from kvflow.models.attention import TorchPagedAttention, get_attention_backend
from kvflow.models.attention.cpu_paged import CpuPagedAttention


@dataclass
class Step:
    """One batch over a pre-filled paged cache, with every request's full K/V for the reference."""

    batch: BatchInputs
    cache: torch.Tensor
    keys: list[torch.Tensor]  # per request [seq_len, kv_heads, head_dim]
    values: list[torch.Tensor]
    query: torch.Tensor  # [num_tokens, heads, head_dim]
    step_keys: torch.Tensor  # [num_tokens, kv_heads, head_dim]
    step_values: torch.Tensor


def _make_step(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> Step:
    """Requests as (context_len, query_len); the context's K/V is already in the cache at shuffled blocks."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in requests) + 7
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    cache = torch.zeros(
        TorchPagedAttention.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim),
        dtype=dtype,
    )
    flat = cache.view(2, num_kv_heads, -1, head_dim)
    keys, values, tables, slot_mapping, positions, starts = [], [], [], [], [], [0]
    step_keys, step_values = [], []
    for context, query_len in requests:
        seq_len = context + query_len
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        flat[0][:, slots[:context]] = k[:context].transpose(0, 1)
        flat[1][:, slots[:context]] = v[:context].transpose(0, 1)
        keys.append(k)
        values.append(v)
        step_keys.append(k[context:])
        step_values.append(v[context:])
        tables.append(blocks)
        slot_mapping += slots[context:]
        positions += list(range(context, seq_len))
        starts.append(starts[-1] + query_len)
    width = max(len(t) for t in tables) + 2  # padding past every table, as the runner leaves it
    num_tokens = starts[-1]
    batch = BatchInputs(
        req_ids=[str(i) for i in range(len(requests))],
        block_size=block_size,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slot_mapping),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in requests], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        logits_indices=torch.zeros(0, dtype=torch.int64),
        sampled_req_indices=torch.zeros(0, dtype=torch.int64),
    )
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    return Step(batch, cache, keys, values, query, torch.cat(step_keys), torch.cat(step_values))


def _dense_reference(
    step: Step,
    requests: list[tuple[int, int]],
    num_heads: int,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention in float64 over the same (already rounded) inputs; with `softcap`, soft-capped as
    transformers' Gemma 2 (`tanh(scores / cap) * cap` on the scaled scores, before the mask and the softmax)."""
    outputs, token = [], 0
    for (context, query_len), k, v in zip(requests, step.keys, step.values, strict=True):
        group = num_heads // k.shape[1]
        for i in range(query_len):
            position = context + i
            first = 0 if window is None else max(0, position - window + 1)
            kk = k[first : position + 1].double().repeat_interleave(group, dim=1)
            vv = v[first : position + 1].double().repeat_interleave(group, dim=1)
            q = step.query[token].double()
            scores = torch.einsum("hd,lhd->hl", q, kk) * q.shape[-1] ** -0.5
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            outputs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), vv))
            token += 1
    return torch.stack(outputs)


CASES = {
    "decode_only": [(5, 1), (12, 1), (0, 1), (30, 1), (63, 1)],
    "one_long_decode": [(300, 1)],
    "mixed": [(10, 1), (0, 13), (3, 1), (8, 5), (21, 1), (4, 2)],
}
SHAPES = {  # (num_heads, num_kv_heads, head_dim, block_size)
    "gqa7_d64_bs16": (14, 2, 64, 16),
    "gqa3_d40_bs4": (6, 2, 40, 4),
    "mha_d8_bs5": (4, 4, 8, 5),
    # blocks of two 16-key chunks, a head of 32 + 8 dim pairs; an odd head_dim (bfloat16 keys are read in pairs)
    "gqa4_d72_bs32": (8, 2, 72, 32),
    "gqa2_d9_bs20": (4, 2, 9, 20),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_backend_matches_reference(
    ops: object, case: str, shape: str, window: int | None, dtype: torch.dtype
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
    dims = dict(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=head_dim**-0.5
    )
    cpu, reference_backend = CpuPagedAttention(**dims), TorchPagedAttention(**dims)
    torch_cache = step.cache.clone()
    metadata = cpu.build_metadata(step.batch, window)
    assert metadata.kernel is not None  # every case has decode rows: the kernel runs
    output = cpu.forward(step.query, step.step_keys, step.step_values, step.cache, metadata)
    torch_output = reference_backend.forward(
        step.query,
        step.step_keys,
        step.step_values,
        torch_cache,
        reference_backend.build_metadata(step.batch, window),
    )
    assert torch.equal(step.cache, torch_cache)  # the same K/V writes
    exact = _dense_reference(step, requests, num_heads, window)
    if dtype == torch.float32:
        torch.testing.assert_close(output, exact.float(), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(output, torch_output, atol=2e-5, rtol=2e-5)
    else:
        error = (output.double() - exact).abs()
        assert bool((error <= exact.abs() * 2.0**-8 + 4e-3).all()), float(error.max())
        torch_error = (torch_output.double() - exact).abs()
        assert float(error.max()) <= float(torch_error.max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 7])
def test_a_tokens_result_does_not_depend_on_its_batch_or_tile(
    ops: Any, dtype: torch.dtype, window: int
) -> None:
    """Query token i of a request gets the same output, bit for bit, whether the kernel attends it in a tile of the
    request's 12 step tokens, alone as a decode row, or as a decode row beside another one."""
    step = _make_step(
        [(40, 12)],
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=11,
    )
    backend = CpuPagedAttention(num_heads=14, num_kv_heads=2, head_dim=64, scale=0.125)
    metadata = backend.build_metadata(step.batch, window or None)
    assert metadata.kernel is not None and metadata.kernel.query_lens is not None  # a tile of 12
    tiled = backend.forward(step.query, step.step_keys, step.step_values, step.cache, metadata)
    key_cache, value_cache = step.cache[0], step.cache[1]

    def decode_rows(tokens: list[int]) -> torch.Tensor:
        out = torch.empty(len(tokens), 14, 64, dtype=dtype)
        ops.paged_attention(
            step.query[tokens],
            key_cache,
            value_cache,
            step.batch.block_tables[[0] * len(tokens)].contiguous(),
            torch.tensor([41 + token for token in tokens], dtype=torch.int32),
            torch.arange(len(tokens), dtype=torch.int64),
            None,
            0.125,
            window,
            0.0,
            out,
        )
        return out

    for token in range(12):
        assert torch.equal(decode_rows([token])[0], tiled[token])
        assert torch.equal(decode_rows([(token + 5) % 12, token])[1], tiled[token])


def test_strided_query_and_prefill_only_batches(ops: object) -> None:
    """Strided q/k/v views (as the model passes them) give the contiguous result; a batch without decode rows is
    the torch backend's."""
    requests = [(9, 1), (17, 1)]
    step = _make_step(
        requests,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.bfloat16,
        seed=3,
    )
    backend = get_attention_backend("cpu")(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    # q, k and v as the attention layer passes them: views of two different fused tensors
    rotated = torch.cat((step.query, step.step_keys), dim=1)  # [tokens, 4 + 2, 16]
    qkv = torch.cat((torch.randn(2, 6, 16).bfloat16(), step.step_values), dim=1)  # [tokens, 8, 16]
    query, key, value = rotated[:, :4], rotated[:, 4:], qkv[:, 6:]
    assert not (query.is_contiguous() or key.is_contiguous() or value.is_contiguous())
    strided_cache = step.cache.clone()
    output = backend.forward(query, key, value, strided_cache, backend.build_metadata(step.batch))
    contiguous = backend.forward(
        step.query,
        step.step_keys,
        step.step_values,
        step.cache,
        backend.build_metadata(step.batch),
    )
    assert torch.equal(output, contiguous)
    assert torch.equal(strided_cache, step.cache)
    prefill = _make_step(
        [(0, 20), (3, 18)],  # longer than MAX_KERNEL_QUERY_LEN: the torch backend's prefill path
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        seed=4,
    )
    metadata = backend.build_metadata(prefill.batch)
    assert metadata.kernel is None and len(metadata.torch_plan.prefills) >= 1


@pytest.mark.parametrize("window", [None, 3])
def test_decode_only_rows_are_the_whole_step_or_none(ops: object, window: int | None) -> None:
    """What the fused decode path reads: the kernel's rows exactly when it attends every row of the step, one
    token each, and the step's KV slots in token order."""
    backend = CpuPagedAttention(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    for requests, decode_only in (
        ([(5, 1), (12, 1), (0, 1)], True),
        ([(5, 1), (7, 3)], False),  # a speculative verification: kernel rows, not one token each
        ([(5, 1), (0, 20)], False),  # decode and prefill rows
        ([(0, 20), (3, 18)], False),  # prefill rows only
    ):
        step = _make_step(
            requests,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            block_size=4,
            dtype=torch.bfloat16,
            seed=6,
        )
        metadata = backend.build_metadata(step.batch, window)
        rows = metadata.decode_only_rows()
        assert (rows is not None) == decode_only
        if rows is not None:
            assert rows is metadata.kernel and rows.window == (window or 0)
            assert rows.query_lens is None
            assert rows.seq_lens.tolist() == [c + q for c, q in requests]
            assert rows.token_start.tolist() == list(range(len(requests)))
        assert metadata.slot_mapping.dtype == torch.int64
        assert torch.equal(metadata.slot_mapping, step.batch.slot_mapping)


def test_kernels_off_means_torch_path(ops: object, kernels_off: None) -> None:
    step = _make_step(
        [(5, 1), (0, 3)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.bfloat16,
        seed=5,
    )
    backend = CpuPagedAttention(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    metadata = backend.build_metadata(step.batch)
    assert metadata.kernel is None and metadata.torch_plan.decode is not None
    reference = TorchPagedAttention(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    cache = step.cache.clone()
    expected = reference.forward(
        step.query, step.step_keys, step.step_values, cache, reference.build_metadata(step.batch)
    )
    output = backend.forward(step.query, step.step_keys, step.step_values, step.cache, metadata)
    assert torch.equal(output, expected)


def test_store_kv_rejects_a_slot_outside_the_cache(ops: object) -> None:
    cache = torch.zeros(2, 2, 3, 4, 8)  # [K/V, kv_heads, blocks, block_size, head_dim]: 12 slots
    step = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="outside the cache's 12 slots"):
        ops.store_kv(step, step, torch.tensor([3, 12]), cache[0], cache[1])
    assert not cache.any()  # nothing written
    ops.store_kv(step, step, torch.tensor([3, 11]), cache[0], cache[1])
    assert torch.equal(cache[0].view(2, 12, 8)[:, 11], step[1])
