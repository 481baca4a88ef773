"""Paged attention in plain PyTorch (`"torch"`): runs on CPU and, unchanged, on CUDA.

Each layer stores the step's K/V with `index_copy_` at `slot_mapping`, gathers every attending request's K/V back
through its block table (whole blocks, one `index_select` per tensor), and attends with
`scaled_dot_product_attention` under a boolean mask. Requests are split into
  * one decode group: every request with a single query token, attended with two batched matmuls and a float32
    softmax, the GQA heads folded into the query-length axis (`[n, kv_heads, group, head_dim]`), so no K/V head is
    repeated (CPU SDPA kernels are tuned for long queries; for these 1-token queries plain matmuls are faster);
  * prefill groups: requests with several query tokens (fresh prompts, chunks continuing cached KV, prefix-cache
    hits), padded to the group's longest query; rows are grouped by length so padding at most doubles the work.
All indices and masks are built once per forward in `build_metadata`; `forward` does no Python work per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from kvflow.models.attention.base import AttentionBackend

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs

# A prefill group may cost at most this many times the attention work of its rows unpadded.
_MAX_PADDING_RATIO = 2.0


@dataclass
class _KVGather:
    """Whole blocks to gather for `num_rows` requests: `block_ids` is `[num_rows * blocks_per_row]`, row-major."""

    block_ids: torch.Tensor
    num_rows: int
    blocks_per_row: int


@dataclass
class DecodeGroup:
    """Requests with exactly one query token, attended in one call.

    Invariants: `token_indices[r]` is row r's flat token (None: the rows are exactly the batch's tokens, in order);
    `score_bias` is float32 `[num_rows, 1, 1, blocks_per_row * block_size]`: 0 where row r may attend that key,
    -inf where it may not (every row sees at least its own token).
    """

    token_indices: torch.Tensor | None
    kv: _KVGather
    score_bias: torch.Tensor


@dataclass
class PrefillGroup:
    """Requests with several query tokens, padded to `max_query_len` and attended in one call.

    Invariants: `query_indices` (`[num_rows * max_query_len]`) names the flat token each padded query reads (padding
    repeats a real token; None: no padding and the rows are the whole batch in order); `output_rows` picks the real
    queries out of the padded output (None: no padding) and `token_indices` says where each goes (None: identity).
    `attn_mask` is bool `[num_rows, 1, max_query_len, keys]`; every row, padded ones included, allows a key, so no
    softmax row is empty.
    """

    max_query_len: int
    query_indices: torch.Tensor | None
    output_rows: torch.Tensor | None
    token_indices: torch.Tensor | None
    kv: _KVGather
    attn_mask: torch.Tensor


@dataclass
class TorchPagedMetadata:
    """One forward's attention plan, shared by every layer with the same sliding window.

    Invariants: every scheduled token is in exactly one group (`decode` or one of `prefills`); requests with no
    scheduled token are in none. `slot_mapping` is int64 on the model's device.
    """

    num_tokens: int
    slot_mapping: torch.Tensor
    decode: DecodeGroup | None
    prefills: list[PrefillGroup]


class TorchPagedAttention(AttentionBackend):
    """The reference paged backend: `index_copy_` writes, block-table gathers, masked SDPA (see module docstring).

    Invariants: `build_metadata` does every host-side computation of a step (it reads the batch's `query_start_loc`
    and `seq_lens` on the host once). The only state is `_workspace`: one grow-only buffer each for gathered keys
    and values, overwritten by every gather and never read after the attention call that consumes it (reusing
    it avoids allocating, and page-faulting, megabytes per layer on CPU).
    """

    name: ClassVar[str] = "torch"

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        softcap: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scale=scale,
            softcap=softcap,
            dtype=dtype,
        )
        self._workspace: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------ metadata
    def build_metadata(
        self, batch: BatchInputs, sliding_window: int | None = None
    ) -> TorchPagedMetadata:
        device = batch.input_ids.device
        query_start_loc = batch.query_start_loc.to("cpu", torch.int64)
        seq_lens = batch.seq_lens.to("cpu", torch.int64)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        context_lens = seq_lens - query_lens
        builder = _GroupBuilder(
            batch, device, query_start_loc, seq_lens, context_lens, sliding_window
        )

        decode_rows = torch.nonzero(query_lens == 1).flatten()
        decode = builder.decode_group(decode_rows) if decode_rows.numel() else None
        prefill_rows = torch.nonzero(query_lens > 1).flatten()
        prefills = [
            builder.prefill_group(rows, query_lens[rows])
            for rows in _group_by_padding(prefill_rows, query_lens, seq_lens, batch.block_size)
        ]
        return TorchPagedMetadata(
            num_tokens=batch.num_tokens,
            slot_mapping=batch.slot_mapping.to(torch.int64),
            decode=decode,
            prefills=prefills,
        )

    # ------------------------------------------------------------------------------------------ forward
    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """One layer's cache, head-major: `[2 (key, value), num_kv_heads, num_blocks, block_size, head_dim]`, so a
        gather of one head's blocks is a contiguous `[rows, keys, head_dim]` batch that matmuls read in place."""
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    # ------------------------------------------------------------------------------------------ forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: TorchPagedMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = self._store(key, value, kv_cache_layer, metadata.slot_mapping)
        num_blocks = key_cache.shape[1]
        key_blocks = key_cache.view(self.num_kv_heads, num_blocks, -1)
        value_blocks = value_cache.view(self.num_kv_heads, num_blocks, -1)

        outputs: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        if metadata.decode is not None:
            outputs.append(self._decode(query, key_blocks, value_blocks, metadata.decode))
        outputs.extend(
            self._prefill(query, key_blocks, value_blocks, group) for group in metadata.prefills
        )
        if len(outputs) == 1 and outputs[0][0] is None:
            return outputs[0][1]
        output = query.new_empty(query.shape)
        for token_indices, group_output in outputs:
            output.index_copy_(0, token_indices, group_output)
        return output

    def _store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's K/V at `slot_mapping`; returns the layer's `(key_cache, value_cache)`."""
        key_cache, value_cache = kv_cache_layer[0], kv_cache_layer[1]
        key_cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(
            1, slot_mapping, key.transpose(0, 1)
        )
        value_cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(
            1, slot_mapping, value.transpose(0, 1)
        )
        return key_cache, value_cache

    def _gather(self, blocks: torch.Tensor, kv: _KVGather, buffer_index: int) -> torch.Tensor:
        """`[num_kv_heads, num_rows, blocks_per_row * block_size, head_dim]`, contiguous: a view of workspace buffer
        `buffer_index` (0 keys, 1 values), valid until the next gather into that buffer."""
        numel = self.num_kv_heads * kv.block_ids.numel() * blocks.shape[2]
        buffer = self._workspace.get(buffer_index)
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != blocks.dtype
            or buffer.device != blocks.device
            or buffer.is_inference() != torch.is_inference_mode_enabled()
        ):
            buffer = torch.empty(numel, dtype=blocks.dtype, device=blocks.device)
            self._workspace[buffer_index] = buffer
        out = buffer[:numel].view(self.num_kv_heads, -1, blocks.shape[2])
        for kv_head in range(
            self.num_kv_heads
        ):  # leading-dim gathers are much faster than one along dim 1
            torch.index_select(blocks[kv_head], 0, kv.block_ids, out=out[kv_head])
        return out.view(self.num_kv_heads, kv.num_rows, -1, self.head_dim)

    def _decode(
        self,
        query: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        group: DecodeGroup,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Two batched matmuls per KV head over contiguous gathers, float32 softmax in between."""
        rows = query if group.token_indices is None else query.index_select(0, group.token_indices)
        num_rows, group_size = group.kv.num_rows, self.num_heads // self.num_kv_heads
        grouped = rows.reshape(num_rows, self.num_kv_heads, group_size, self.head_dim)
        keys, values = (
            self._gather(key_blocks, group.kv, 0),
            self._gather(value_blocks, group.kv, 1),
        )
        scores = query.new_empty(self.num_kv_heads, num_rows, group_size, keys.shape[2])
        for kv_head in range(self.num_kv_heads):
            torch.bmm(grouped[:, kv_head], keys[kv_head].transpose(1, 2), out=scores[kv_head])
        bias = group.score_bias.view(1, num_rows, 1, -1)
        logits = scores.float().mul_(self.scale)
        if self.softcap is not None:
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        probs = torch.softmax(logits.add_(bias), dim=-1).to(values.dtype)
        attended = query.new_empty(self.num_kv_heads, num_rows, group_size, self.head_dim)
        for kv_head in range(self.num_kv_heads):
            torch.bmm(probs[kv_head], values[kv_head], out=attended[kv_head])
        return group.token_indices, attended.transpose(0, 1).reshape(
            num_rows, self.num_heads, self.head_dim
        )

    def _prefill(
        self,
        query: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        group: PrefillGroup,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        padded = (
            query if group.query_indices is None else query.index_select(0, group.query_indices)
        )
        num_rows = group.kv.num_rows
        padded = padded.view(
            num_rows, group.max_query_len, self.num_heads, self.head_dim
        ).transpose(1, 2)
        keys = self._gather(key_blocks, group.kv, 0).transpose(0, 1)
        values = self._gather(value_blocks, group.kv, 1).transpose(0, 1)
        if self.softcap is None:
            attended = F.scaled_dot_product_attention(
                padded,
                keys,
                values,
                attn_mask=group.attn_mask,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        else:
            attended = self._softcapped_attention(padded, keys, values, group.attn_mask)
        attended = attended.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        if group.output_rows is not None:
            attended = attended.index_select(0, group.output_rows)
        return group.token_indices, attended

    def _softcapped_attention(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """SDPA's result with the logits soft-capped (SDPA has no soft-capping): `query` `[rows, heads, q, d]`,
        `keys`/`values` `[rows, kv_heads, k, d]`, `mask` bool `[rows, 1, q, k]`; a float32 softmax, as
        transformers' eager attention computes it."""
        group_size = self.num_heads // self.num_kv_heads
        if group_size > 1:
            keys = keys.repeat_interleave(group_size, dim=1)
            values = values.repeat_interleave(group_size, dim=1)
        assert self.softcap is not None
        logits = torch.matmul(query, keys.transpose(2, 3)) * self.scale
        logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.matmul(probs, values)


class _GroupBuilder:
    """Builds decode and prefill groups for one batch (host-side index arithmetic, results moved to `device`)."""

    def __init__(
        self,
        batch: BatchInputs,
        device: torch.device,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        context_lens: torch.Tensor,
        sliding_window: int | None,
    ) -> None:
        self.batch = batch
        self.device = device
        self.block_size = batch.block_size
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.context_lens = context_lens
        self.sliding_window = sliding_window

    def _kv_gather(self, rows: torch.Tensor) -> tuple[_KVGather, torch.Tensor]:
        """The rows' block ids and the key positions `[0, blocks_per_row * block_size)` they cover."""
        blocks_per_row = int(-(-int(self.seq_lens[rows].max()) // self.block_size))
        tables = self.batch.block_tables.index_select(0, rows.to(self.device))[:, :blocks_per_row]
        block_ids = tables.reshape(-1).to(torch.int64)
        key_positions = torch.arange(blocks_per_row * self.block_size)
        return _KVGather(block_ids, int(rows.numel()), blocks_per_row), key_positions

    def _visible(self, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """Causal (and sliding-window) visibility of every key position from every query position."""
        visible = key_positions <= query_positions
        if self.sliding_window is not None:
            visible &= key_positions > query_positions - self.sliding_window
        return visible

    def _identity_or(self, token_indices: torch.Tensor) -> torch.Tensor | None:
        """None when `token_indices` is exactly `0..num_tokens-1` (the group is the whole batch, in order)."""
        num_tokens = self.batch.num_tokens
        if token_indices.numel() == num_tokens and torch.equal(
            token_indices, torch.arange(num_tokens)
        ):
            return None
        return token_indices.to(self.device)

    def decode_group(self, rows: torch.Tensor) -> DecodeGroup:
        kv, key_positions = self._kv_gather(rows)
        query_positions = (self.seq_lens[rows] - 1)[:, None]
        mask = self._visible(key_positions[None, :], query_positions)
        return DecodeGroup(
            token_indices=self._identity_or(self.query_start_loc[rows]),
            kv=kv,
            score_bias=torch.zeros(mask.shape, dtype=torch.float32)
            .masked_fill_(~mask, float("-inf"))[:, None, None, :]
            .to(self.device),
        )

    def prefill_group(self, rows: torch.Tensor, query_lens: torch.Tensor) -> PrefillGroup:
        kv, key_positions = self._kv_gather(rows)
        max_query_len = int(query_lens.max())
        offsets = torch.arange(max_query_len)
        is_real = offsets[None, :] < query_lens[:, None]  # [rows, max_query_len]
        starts = self.query_start_loc[rows][:, None]
        query_positions = (self.context_lens[rows][:, None] + offsets[None, :])[:, :, None]
        mask = self._visible(key_positions[None, None, :], query_positions) & is_real[:, :, None]
        mask[:, :, 0] |= ~is_real  # padded queries attend one key, so no softmax row is empty
        padded_tokens = starts + torch.minimum(offsets[None, :], query_lens[:, None] - 1)
        has_padding = not bool(is_real.all())
        token_indices = (starts + offsets[None, :])[is_real]
        identity = self._identity_or(token_indices)
        return PrefillGroup(
            max_query_len=max_query_len,
            query_indices=None
            if identity is None and not has_padding
            else padded_tokens.reshape(-1).to(self.device),
            output_rows=torch.nonzero(is_real.reshape(-1)).flatten().to(self.device)
            if has_padding
            else None,
            token_indices=identity,
            kv=kv,
            attn_mask=mask[:, None].to(self.device),
        )


def _group_by_padding(
    rows: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> list[torch.Tensor]:
    """Split prefill rows (longest query first) into groups whose padded attention work stays bounded."""
    if rows.numel() == 0:
        return []
    if rows.numel() == 1:
        return [rows]
    order = rows[torch.argsort(query_lens[rows], descending=True, stable=True)].tolist()
    key_lens = (-(-seq_lens // block_size) * block_size).tolist()
    lens = query_lens.tolist()
    groups: list[list[int]] = []
    current: list[int] = []
    max_query = max_keys = real_work = 0
    for row in order:
        new_query, new_keys = max(max_query, lens[row]), max(max_keys, key_lens[row])
        new_real = real_work + lens[row] * key_lens[row]
        if current and (len(current) + 1) * new_query * new_keys > _MAX_PADDING_RATIO * new_real:
            groups.append(current)
            current, new_query, new_keys, new_real = (
                [],
                lens[row],
                key_lens[row],
                lens[row] * key_lens[row],
            )
        current.append(row)
        max_query, max_keys, real_work = new_query, new_keys, new_real
    groups.append(current)
    return [torch.tensor(sorted(group), dtype=torch.int64) for group in groups]
