"""Paged attention with a C++ kernel (`"cpu"`): the default on CPU when the kernels are available.

In a step with kernel rows, the K/V writes (`store_kv`) and those rows run in C++: `paged_attention` reads K/V in
place through the block table (no gather into a padded copy) with an fp32 online softmax and the model's logit
soft-capping (`softcap`, Gemma 2), each loaded K/V row shared by a tile of query tokens times its GQA group, and
reads only the keys some query may see (a sliding-window layer reads its window, not the sequence). Which rows
the kernel takes:
  * requests with up to `MAX_KERNEL_QUERY_LEN` query tokens (decode steps, speculative verification, tiny
    chunks), always;
  * longer (prefill) requests when the model soft-caps (SDPA cannot), the layer has a sliding window (the torch
    path gathers and masks the whole block table), or the model runs in bfloat16 (the backend's `dtype`): on the
    Zen 4 development machine the kernel attends `throughput.py`'s prefill chunks (up to 256 tokens a request, 2048
    a step) 4-6x faster than the torch path, whose bfloat16 SDPA over gathered, padded and masked groups runs
    far below its GEMM rate (benchmarks/RESULTS.md, issue 45 item 3). A float32 model's full-attention layers
    without soft-capping leave them to the torch backend's SDPA, so float32 results stay the reference's.
Prefill rows the kernel does not take, steps without kernel rows and the cache layout are the torch backend's
(this class extends it), and without the compiled kernels (`KVFLOW_CPU_KERNELS=0`, no compiler, a non-CPU
tensor) every row takes the torch path, so the torch backend is both the fallback and the reference.
`KVFLOW_CPU_ATTENTION_SOFTCAP_IN_TORCH=1` restores the earlier route for soft-capping models (every row in torch),
for A/B measurements (benchmarks/gemma_attention.py).
`KVFLOW_CPU_ATTENTION_PREFILL_IN_TORCH=1` restores the earlier route for bfloat16 models (full-attention prefill
rows in SDPA), for A/B measurements (benchmarks/throughput.py, forward_profile.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

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
# Requests with at most this many query tokens (decode steps, speculative verification, tiny chunks) always go
# through the kernel.
MAX_KERNEL_QUERY_LEN = 16
# "1": a soft-capping model attends every row in torch (the route before the kernel soft-capped; for A/B runs).
SOFTCAP_IN_TORCH_ENV = "KVFLOW_CPU_ATTENTION_SOFTCAP_IN_TORCH"
# "1": a bfloat16 model's full-attention prefill rows go to SDPA (the route before they went to the kernel).
PREFILL_IN_TORCH_ENV = "KVFLOW_CPU_ATTENTION_PREFILL_IN_TORCH"


@dataclass
class CpuKernelRows:
    """The rows of a batch the kernel attends, as it reads them.

    Invariants: row r's query tokens are the flat tokens `token_start[r] + i` for i < `query_lens[r]` (int32;
    None: one token per row), the last at position `seq_lens[r] - 1` (int32, counting the step's tokens);
    `block_tables[r]` (int32, contiguous rows) holds its blocks; `window` is the sliding window (0: none).
    """

    token_start: torch.Tensor
    query_lens: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    window: int


@dataclass
class CpuPagedMetadata:
    """The torch backend's plan for the rows the kernel does not take (`torch_plan.decode` is None when `kernel`
    is set) plus the kernel's rows. With `kernel` None, `torch_plan` covers every row. `whole_torch_plan()` is the
    torch backend's plan for every row, built (once) only for a dtype the kernel does not take (float16)."""

    torch_plan: TorchPagedMetadata
    kernel: CpuKernelRows | None
    whole_torch_plan: Callable[[], TorchPagedMetadata] | None = None

    @property
    def slot_mapping(self) -> torch.Tensor:
        """Every scheduled token's KV slot (int64, in token order)."""
        return self.torch_plan.slot_mapping

    def decode_only_rows(self) -> CpuKernelRows | None:
        """The kernel's rows when they are the whole step and one token each, else None: what a fused decode-only
        step (`kvflow.models.fused_decode`) reads its paging from."""
        rows = self.kernel
        if rows is None or self.torch_plan.prefills or rows.query_lens is not None:
            return None
        return rows


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def softcap_in_torch() -> bool:
    """Whether `SOFTCAP_IN_TORCH_ENV` asks for the earlier route (every row of a soft-capping model in torch)."""
    return _env_flag(SOFTCAP_IN_TORCH_ENV)


def prefill_in_torch() -> bool:
    """Whether `PREFILL_IN_TORCH_ENV` asks for the earlier route (a bfloat16 model's prefill rows in SDPA)."""
    return _env_flag(PREFILL_IN_TORCH_ENV)


class CpuPagedAttention(TorchPagedAttention):
    """Torch backend with the rows listed in the module docstring attended in C++; same cache layout and K/V
    writes. Invariant: every scheduled token is in exactly one of the kernel's rows and the torch plan's groups."""

    name: ClassVar[str] = "cpu"

    def __init__(self, **dims: Any) -> None:
        super().__init__(**dims)
        # Read once: the A/B switch holds for the backend's life (and costs no lookup per step).
        self._softcap_in_torch = self.softcap is not None and softcap_in_torch()
        # Whether the kernel takes prefill rows of full-attention layers too: bfloat16 models.
        self._prefill_in_kernel = self.dtype is torch.bfloat16 and not prefill_in_torch()
        # Decode-only steps of n requests: `query_start_loc` `[0, 1, ..., n]` as a list, and the kernel's
        # token starts `[0, ..., n - 1]` (int64), by n (see `_decode_only_metadata`).
        self._decode_starts: dict[int, tuple[list[int], torch.Tensor]] = {}

    def build_metadata(
        self, batch: BatchInputs, sliding_window: int | None = None
    ) -> CpuPagedMetadata:
        # `is_cpu`, not `.device.type`: no device object to make, in the step's first lines.
        if not batch.input_ids.is_cpu or load_cpu_kernels() is None or self._softcap_in_torch:
            return CpuPagedMetadata(super().build_metadata(batch, sliding_window), None)
        decode = self._decode_only_metadata(batch, sliding_window)
        return decode if decode is not None else self._kernel_metadata(batch, sliding_window)

    def _kernel_metadata(self, batch: BatchInputs, sliding_window: int | None) -> CpuPagedMetadata:
        """The general path of `build_metadata` once the kernels are in use: the kernel's rows and the torch plan
        for the rest, for any step."""
        device = batch.input_ids.device
        query_start_loc = batch.query_start_loc.to(torch.int64)
        seq_lens = batch.seq_lens.to(torch.int64)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        kernel_takes_prefill = (
            self.softcap is not None or sliding_window is not None or self._prefill_in_kernel
        )
        max_kernel_query_len = batch.num_tokens if kernel_takes_prefill else MAX_KERNEL_QUERY_LEN
        in_kernel = (query_lens >= 1) & (query_lens <= max_kernel_query_len)
        kernel_rows = torch.nonzero(in_kernel).flatten()
        if kernel_rows.numel() == 0:
            return CpuPagedMetadata(super().build_metadata(batch, sliding_window), None)
        builder = _GroupBuilder(
            batch, device, query_start_loc, seq_lens, seq_lens - query_lens, sliding_window
        )
        prefill_rows = torch.nonzero(query_lens > max_kernel_query_len).flatten()
        prefills = [
            builder.prefill_group(rows, query_lens[rows])
            for rows in _group_by_padding(prefill_rows, query_lens, seq_lens, batch.block_size)
        ]
        if kernel_rows.numel() == batch.num_reqs and bool((query_lens == 1).all()):
            kernel = CpuKernelRows(
                token_start=query_start_loc[:-1].contiguous(),
                query_lens=None,
                block_tables=batch.block_tables.to(torch.int32).contiguous(),
                seq_lens=batch.seq_lens.to(torch.int32).contiguous(),
                window=sliding_window or 0,
            )
        else:
            kernel = CpuKernelRows(
                token_start=query_start_loc[kernel_rows].contiguous(),
                query_lens=query_lens[kernel_rows].to(torch.int32).contiguous(),
                block_tables=batch.block_tables.index_select(0, kernel_rows)
                .to(torch.int32)
                .contiguous(),
                seq_lens=seq_lens[kernel_rows].to(torch.int32).contiguous(),
                window=sliding_window or 0,
            )
        plan = TorchPagedMetadata(
            num_tokens=batch.num_tokens,
            slot_mapping=batch.slot_mapping.to(torch.int64),
            decode=None,
            prefills=prefills,
        )
        return CpuPagedMetadata(plan, kernel, self._whole_torch_plan_once(batch, sliding_window))

    def _whole_torch_plan_once(
        self, batch: BatchInputs, sliding_window: int | None
    ) -> Callable[[], TorchPagedMetadata]:
        """A callable returning the torch backend's plan for every row of `batch`, built on its first call and
        the same object after (a closure: cheaper to make per step than `functools.cache(functools.partial(...))`)."""
        built: list[TorchPagedMetadata] = []

        def whole_torch_plan() -> TorchPagedMetadata:
            if not built:
                built.append(TorchPagedAttention.build_metadata(self, batch, sliding_window))
            return built[0]

        return whole_torch_plan

    def _decode_only_metadata(
        self, batch: BatchInputs, sliding_window: int | None
    ) -> CpuPagedMetadata | None:
        """The metadata of a step whose every request has one query token, built without the general path's
        per-row index arithmetic; None for any other step, which the general path then builds.

        Invariant: for the steps it takes, it returns what the general path returns, field for field (the same
        values, dtypes and contiguity; `whole_torch_plan` the same cached torch plan): with every query length 1,
        every row is a kernel row, there are no prefill groups, and the kernel rows are the batch's own
        `block_tables` and `seq_lens` (int32) with `token_start = [0, ..., n - 1]`. It recognises such a step by
        `query_start_loc` holding exactly `[0, 1, ..., n]` (compared as a Python list: no torch op); any other
        content falls back.
        """
        num_reqs = batch.num_reqs
        if num_reqs == 0 or batch.input_ids.shape[0] != num_reqs:
            return None
        starts = self._decode_starts.get(num_reqs)
        if starts is None:
            starts = (list(range(num_reqs + 1)), torch.arange(num_reqs, dtype=torch.int64))
            self._decode_starts[num_reqs] = starts
        expected_starts, token_start = starts
        if batch.query_start_loc.tolist() != expected_starts:
            return None
        block_tables, seq_lens, slot_mapping = (
            batch.block_tables,
            batch.seq_lens,
            batch.slot_mapping,
        )
        if block_tables.dtype is not torch.int32 or not block_tables.is_contiguous():
            block_tables = block_tables.to(torch.int32).contiguous()
        if seq_lens.dtype is not torch.int32 or not seq_lens.is_contiguous():
            seq_lens = seq_lens.to(torch.int32).contiguous()
        if slot_mapping.dtype is not torch.int64:
            slot_mapping = slot_mapping.to(torch.int64)
        kernel = CpuKernelRows(token_start, None, block_tables, seq_lens, sliding_window or 0)
        plan = TorchPagedMetadata(num_reqs, slot_mapping, None, [])
        return CpuPagedMetadata(plan, kernel, self._whole_torch_plan_once(batch, sliding_window))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: CpuPagedMetadata,
    ) -> torch.Tensor:
        plan, rows = metadata.torch_plan, metadata.kernel
        if rows is None:
            return super().forward(query, key, value, kv_cache_layer, plan)
        if query.dtype not in _KERNEL_DTYPES:
            assert metadata.whole_torch_plan is not None
            return super().forward(query, key, value, kv_cache_layer, metadata.whole_torch_plan())
        ops = load_cpu_kernels()
        key_cache, value_cache = kv_cache_layer[0], kv_cache_layer[1]
        ops.store_kv(key, value, plan.slot_mapping, key_cache, value_cache)
        output = query.new_empty(query.shape)
        ops.paged_attention(
            query,
            key_cache,
            value_cache,
            rows.block_tables,
            rows.seq_lens,
            rows.token_start,
            rows.query_lens,
            self.scale,
            rows.window,
            self.softcap or 0.0,
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
                )  # kernel rows exist, so no group is the whole batch
                output.index_copy_(0, token_indices, group_output)
        return output
