"""The tensors one forward pass reads: the batch the model runner builds from a `SchedulerOutput` and every model
consumes. It sits below both `kvflow.worker` and `kvflow.models`, so neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class BatchInputs:
    """One step's flattened batch, requests in `num_scheduled_tokens` order.

    Request `r` owns the flat token range `[query_start_loc[r], query_start_loc[r + 1])`; token `t` of it sits at
    `positions[t]` of its sequence and its KV goes to cache slot `slot_mapping[t]`. `seq_lens[r]` counts the
    request's tokens with KV after this step; `block_tables[r, :ceil(seq_lens[r] / block_size)]` are valid (the rest
    is padding). For `k < num_sampled`, `logits_indices[k]` is the flat index of the last scheduled token of request
    `sampled_req_indices[k]`, one entry per request that samples this step (partial prefills do not); a request
    verifying d speculative drafts has d + 1 consecutive entries, its last d + 1 scheduled tokens. Entries past
    `num_sampled` (only when a scheduled request asks for prompt logprobs) are further flat tokens whose logits the
    runner needs; a model returns one row per `logits_indices` entry, in order, and a model that samples its own
    tokens (never given such entries) one token per sampled request.
    """

    req_ids: list[str]
    block_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks_in_batch] int32
    logits_indices: torch.Tensor  # [num_sampled] int64
    sampled_req_indices: torch.Tensor  # [num_sampled] int64
    other_groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = field(default=())
    # LoRA: the adapter slot of each flat token ([num_tokens] int32, -1: the base model), or None when no token
    # of the step runs with an adapter (`kvflow.lora.model_manager`).
    lora_token_slots: torch.Tensor | None = None
    # Pooling (encoder models): each flat token's token type id ([num_tokens] int64; cross-encoder pairs), or
    # None when every token has type 0.
    token_type_ids: torch.Tensor | None = None

    def for_group(self, group_id: int) -> BatchInputs:
        """This batch with KV cache group `group_id`'s slot mapping and block tables (itself for group 0)."""
        if group_id == 0:
            return self
        slot_mapping, block_tables = self.other_groups[group_id - 1]
        return replace(self, slot_mapping=slot_mapping, block_tables=block_tables, other_groups=())

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_sampled(self) -> int:
        return int(self.sampled_req_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
