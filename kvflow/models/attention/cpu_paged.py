"""Paged attention with a C++ decode kernel (`"cpu"`): the default on CPU when the kernels are available.

In a step with decode rows, the K/V writes (`store_kv`) and the decode rows run in C++ (a request with up to
`MAX_KERNEL_QUERY_LEN` query tokens, e.g. a speculative verification, is one kernel row per token):
`paged_decode_attention` reads K/V in place through the block table (no gather into a padded copy) with an fp32
online softmax, each loaded K/V row shared by its GQA query group. Prefill rows, steps without decode rows and the
cache layout are the torch backend's (this class extends it), and without the compiled kernels
(`KVFLOW_CPU_KERNELS=0`, no compiler, a non-CPU tensor) every row takes the torch path, so the torch backend is
both the fallback and the reference. A model with attention-logit soft-capping (`softcap`, Gemma 2) also runs
every row in torch: the kernel does not soft-cap, so it is never given such a model's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvflow.kernels import load_cpu_kernels
from kvflow.models.attention.torch_paged import (
    TorchPagedAttention,
    TorchPagedMetadata,
    _group_by_padding,
    _GroupBuilder,
)

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# Requests with at most this many query tokens (decode steps, speculative verification, tiny chunks) go through
# the decode kernel, one kernel row per query token.
MAX_KERNEL_QUERY_LEN = 16


@dataclass
class CpuDecodeRows:
    """The decode rows of a batch, as the kernel reads them.

    Invariants: `token_index[r]` is row r's flat query token (int64); `block_tables[r]` (int32, contiguous rows)
    and `seq_lens[r]` (int32, counting the step's token) describe its sequence; `window` is the sliding window
    (0: none).
    """

    token_index: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    window: int


@dataclass
class CpuPagedMetadata:
    """The torch backend's plan for the prefill rows (`torch_plan.decode` is None when `decode` is set) plus the
    kernel's decode rows. With `decode` None, `torch_plan` covers every row."""

    torch_plan: TorchPagedMetadata
    decode: CpuDecodeRows | None

    @property
    def slot_mapping(self) -> torch.Tensor:
        """Every scheduled token's KV slot (int64, in token order)."""
        return self.torch_plan.slot_mapping

    def decode_only_rows(self) -> CpuDecodeRows | None:
        """The decode rows when the kernel attends the whole step (no prefill rows), else None: what a fused
        decode-only step (`kvflow.models.fused_decode`) reads its paging from."""
        return self.decode if self.decode is not None and not self.torch_plan.prefills else None


def _expanded_decode_rows(
    batch: BatchInputs,
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int,
) -> CpuDecodeRows:
    """One kernel row per query token of each request in `rows`: token j of a request with q query tokens and
    sequence length S attends to the first S - q + 1 + j positions, exactly causal attention (every token's K/V
    is written before any row attends). E.g., q 3, S 10: three rows of lengths 8, 9, 10."""
    counts = query_lens[rows]
    row_of_token = torch.repeat_interleave(rows, counts)
    starts = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(int(counts.sum()), device=rows.device) - torch.repeat_interleave(
        starts, counts
    )
    token_index = query_start_loc[row_of_token] + offsets
    token_seq_lens = seq_lens[row_of_token] - query_lens[row_of_token] + 1 + offsets
    return CpuDecodeRows(
        token_index=token_index.contiguous(),
        block_tables=batch.block_tables.index_select(0, row_of_token).to(torch.int32).contiguous(),
        seq_lens=token_seq_lens.to(torch.int32).contiguous(),
        window=window,
    )


class CpuPagedAttention(TorchPagedAttention):
    """Torch backend with decode rows attended in C++ (see module docstring); same cache layout and K/V writes."""

    name: ClassVar[str] = "cpu"

    def build_metadata(
        self, batch: BatchInputs, sliding_window: int | None = None
    ) -> CpuPagedMetadata:
        device = batch.input_ids.device
        if self.softcap is not None or device.type != "cpu" or load_cpu_kernels() is None:
            # The C++ kernel has no logit soft-capping: such a model (Gemma 2) attends every row in torch.
            return CpuPagedMetadata(super().build_metadata(batch, sliding_window), None)
        query_start_loc = batch.query_start_loc.to(torch.int64)
        seq_lens = batch.seq_lens.to(torch.int64)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        small = (query_lens >= 1) & (query_lens <= MAX_KERNEL_QUERY_LEN)
        decode_rows = torch.nonzero(small).flatten()
        if decode_rows.numel() == 0:
            return CpuPagedMetadata(super().build_metadata(batch, sliding_window), None)
        builder = _GroupBuilder(
            batch, device, query_start_loc, seq_lens, seq_lens - query_lens, sliding_window
        )
        prefill_rows = torch.nonzero(query_lens > MAX_KERNEL_QUERY_LEN).flatten()
        prefills = [
            builder.prefill_group(rows, query_lens[rows])
            for rows in _group_by_padding(prefill_rows, query_lens, seq_lens, batch.block_size)
        ]
        if decode_rows.numel() == batch.num_reqs and bool((query_lens == 1).all()):
            decode = CpuDecodeRows(
                token_index=query_start_loc[:-1].contiguous(),
                block_tables=batch.block_tables.to(torch.int32).contiguous(),
                seq_lens=batch.seq_lens.to(torch.int32).contiguous(),
                window=sliding_window or 0,
            )
        else:
            decode = _expanded_decode_rows(
                batch, decode_rows, query_start_loc, query_lens, seq_lens, sliding_window or 0
            )
        plan = TorchPagedMetadata(
            num_tokens=batch.num_tokens,
            slot_mapping=batch.slot_mapping.to(torch.int64),
            decode=None,
            prefills=prefills,
        )
        return CpuPagedMetadata(plan, decode)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: CpuPagedMetadata,
    ) -> torch.Tensor:
        plan, decode = metadata.torch_plan, metadata.decode
        if decode is None or query.dtype not in _KERNEL_DTYPES:
            return super().forward(query, key, value, kv_cache_layer, plan)
        ops = load_cpu_kernels()
        key_cache, value_cache = kv_cache_layer[0], kv_cache_layer[1]
        ops.store_kv(key, value, plan.slot_mapping, key_cache, value_cache)
        output = query.new_empty(query.shape)
        ops.paged_decode_attention(
            query,
            key_cache,
            value_cache,
            decode.block_tables,
            decode.seq_lens,
            decode.token_index,
            self.scale,
            decode.window,
            output,
        )
        if plan.prefills:
            num_blocks = key_cache.shape[1]
            key_blocks = key_cache.view(self.num_kv_heads, num_blocks, -1)
            value_blocks = value_cache.view(self.num_kv_heads, num_blocks, -1)
            for group in plan.prefills:
                token_indices, group_output = self._prefill(query, key_blocks, value_blocks, group)
                assert (
                    token_indices is not None
                )  # decode rows exist, so no group is the whole batch
                output.index_copy_(0, token_indices, group_output)
        return output
