"""The "torch" and "cpu" paged attention backends against a dense per-token reference, on mixed batches (the cpu
backend's kernel takes requests of up to MAX_KERNEL_QUERY_LEN query tokens, one kernel row per token)."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow.batch import BatchInputs
from kvflow.kernels import load_cpu_kernels
from kvflow.models.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    TorchPagedAttention,
    available_attention_backends,
    get_attention_backend,
)
from kvflow.models.attention.cpu_paged import MAX_KERNEL_QUERY_LEN, CpuPagedAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 64


def _make_step(
    requests: list[tuple[int, int]], seed: int
) -> tuple[BatchInputs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A step over requests given as (context_len, query_len), their cache pre-filled for the context.

    Returns the batch, the layer cache, the full per-request K and V (all positions, concatenated), the step's query,
    and each request's offset into the full K/V.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    cache = torch.zeros(
        TorchPagedAttention.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    )
    total = sum(context + query for context, query in requests)
    keys = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    values = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    offsets, slot_mapping, positions, query_start_loc, tables = [], [], [], [0], []
    step_rows: list[int] = []
    offset = 0
    for context, query in requests:
        seq_len = context + query
        request_blocks = [blocks.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        slots = [
            request_blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)
        ]
        flat = cache.view(
            2, NUM_KV_HEADS, -1, HEAD_DIM
        )  # head-major layout: [K/V, head, slot, dim]
        flat[0][:, slots[:context]] = keys[offset : offset + context].transpose(0, 1)
        flat[1][:, slots[:context]] = values[offset : offset + context].transpose(0, 1)
        slot_mapping += slots[context:]
        positions += list(range(context, seq_len))
        step_rows += list(range(offset + context, offset + seq_len))
        query_start_loc.append(query_start_loc[-1] + query)
        tables.append(request_blocks)
        offsets.append(offset)
        offset += seq_len
    width = max(len(table) for table in tables)
    block_tables = torch.tensor(
        [table + [0] * (width - len(table)) for table in tables], dtype=torch.int32
    )
    num_tokens = query_start_loc[-1]
    batch = BatchInputs(
        req_ids=[str(i) for i in range(len(requests))],
        block_size=BLOCK_SIZE,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slot_mapping),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in requests], dtype=torch.int32),
        block_tables=block_tables,
        logits_indices=torch.zeros(0, dtype=torch.int64),
        sampled_req_indices=torch.zeros(0, dtype=torch.int64),
    )
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    return batch, cache, keys, values, query, step_rows


def _reference(
    requests: list[tuple[int, int]],
    keys: torch.Tensor,
    values: torch.Tensor,
    query: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    group = NUM_HEADS // NUM_KV_HEADS
    outputs = []
    token = offset = 0
    for context, num_queries in requests:
        for i in range(num_queries):
            position = context + i
            first = 0 if window is None else max(0, position - window + 1)
            k = keys[offset + first : offset + position + 1].repeat_interleave(
                group, dim=1
            )  # [L, H, D]
            v = values[offset + first : offset + position + 1].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", query[token], k) * HEAD_DIM**-0.5
            outputs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
            token += 1
        offset += context + num_queries
    return torch.stack(outputs)


CASES = {
    "decode_only": [(5, 1), (12, 1), (0, 1), (30, 1)],
    "fresh_prefill": [(0, 9)],
    "chunk_after_context": [(7, 6)],
    "mixed": [(10, 1), (0, 13), (3, 1), (8, 5), (21, 1), (4, 2)],
    "uneven_prefills": [(0, 40), (2, 2), (50, 3), (0, 5)],
}


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_reference(case: str, window: int | None, backend_name: str) -> None:
    requests = CASES[case]
    batch, cache, keys, values, query, step_rows = _make_step(requests, seed=len(case))
    if backend_name == "cpu":
        if load_cpu_kernels() is None:
            pytest.skip("the cpu backend needs the compiled kernels (tests/kernels builds them)")
        # "mixed" and "uneven_prefills" give the kernel multi-token rows.
        assert MAX_KERNEL_QUERY_LEN >= 5
    backend_class = TorchPagedAttention if backend_name == "torch" else CpuPagedAttention
    backend = backend_class(
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM**-0.5
    )
    metadata = backend.build_metadata(batch, window)
    output = backend.forward(query, keys[step_rows], values[step_rows], cache, metadata)
    torch.testing.assert_close(
        output, _reference(requests, keys, values, query, window), atol=1e-5, rtol=1e-5
    )
    # the step's K/V landed at its slots
    flat = cache.view(2, NUM_KV_HEADS, -1, HEAD_DIM)
    torch.testing.assert_close(
        flat[0][:, batch.slot_mapping], keys[step_rows].transpose(0, 1), atol=0, rtol=0
    )
    torch.testing.assert_close(
        flat[1][:, batch.slot_mapping], values[step_rows].transpose(0, 1), atol=0, rtol=0
    )


def test_uneven_prefills_are_split_into_groups() -> None:
    batch, *_ = _make_step(CASES["uneven_prefills"], seed=0)
    backend = TorchPagedAttention(
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scale=1.0
    )
    metadata = backend.build_metadata(batch)
    assert metadata.decode is None
    assert len(metadata.prefills) >= 2
    assert sum(group.token_indices.numel() for group in metadata.prefills) == batch.num_tokens  # type: ignore[union-attr]


def test_registry() -> None:
    assert get_attention_backend("torch") is TorchPagedAttention
    assert available_attention_backends() == ["cpu", "torch"]
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash-nope'.*torch"):
        get_attention_backend("flash-nope")
    with pytest.raises(ValueError, match="already registered"):
        ATTENTION_BACKENDS.register("torch", "somewhere.else:Other")
    with pytest.raises(ValueError, match="multiple"):
        TorchPagedAttention(num_heads=6, num_kv_heads=4, head_dim=8, scale=1.0)
    assert issubclass(TorchPagedAttention, AttentionBackend)


def test_every_registered_backend_carries_its_registered_name() -> None:
    for name in available_attention_backends():
        backend = get_attention_backend(name)
        assert issubclass(backend, AttentionBackend) and backend.name == name
