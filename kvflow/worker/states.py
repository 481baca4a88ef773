"""Per-request worker state in a fixed array of slots, stored in preallocated numpy arrays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvflow.lora.request import LoRARequest
    from kvflow.sampling_params import SamplingParams


class RequestSlots:
    """A fixed array of `max_num_reqs` slots, one per request the worker holds.

    Invariants:
      * every slot index is either in `free_indices` or the value of exactly one `req_id_to_index` entry,
        never both; `len(free_indices) + len(req_id_to_index) == max_num_reqs`;
      * for a held slot `i`: `token_ids[i, :num_tokens[i]]` are the request's known tokens (prompt, outputs and
        the last sampled token, which the worker feeds itself), `block_table[i, :num_blocks[i]]` its KV blocks,
        `num_computed_tokens[i] <= num_tokens[i] <= max_model_len`, and `token_ids[i, :num_prompt_tokens[i]]`
        is the prompt (for a streaming session: everything up to its latest chunk);
      * entries past `num_tokens[i]` / `num_blocks[i]` (and every entry of a free slot) are stale and never read;
      * `num_draft_computed[i] <= num_tokens[i]`: with a draft-model proposer, the draft's own KV cache holds its
        K/V of `token_ids[i, :num_draft_computed[i]]` in the slot's blocks (cut back to `num_computed_tokens[i]`
        whenever that is set, since the tokens past it may change, and advanced by the proposer);
      * with several KV cache groups (`num_kv_groups`), group g's table of slot `i` is
        `block_tables[g][i, :group_num_blocks[g][i]]`; `block_table` / `num_blocks` are group 0's, and every group's
        table covers the same positions (a sliding group's skipped positions hold the null block, never read).
    A freed slot is not cleared: taking it overwrites the counters, so `add` and `remove` cost O(new data).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_draft_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = [
            np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
            for _ in range(num_kv_groups)
        ]
        self.group_num_blocks = [
            np.zeros(max_num_reqs, dtype=np.int64) for _ in range(num_kv_groups)
        ]
        self.block_table = self.block_tables[0]
        self.num_blocks = self.group_num_blocks[0]
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        # The adapter of each held slot (None, id 0: the base model).
        self.lora_requests: list[LoRARequest | None] = [None] * max_num_reqs
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        # Popped from the end, so slot 0 is taken first.
        self.free_indices: list[int] = list(range(max_num_reqs - 1, -1, -1))
        self.req_id_to_index: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------ take / free
    def add(
        self,
        req_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_computed_tokens: int,
        sampling_params: SamplingParams | None = None,
        num_prompt_tokens: int | None = None,
        other_group_block_ids: Sequence[Sequence[int]] = (),
        lora_request: LoRARequest | None = None,
    ) -> int:
        """Take a free slot for `req_id` and fill it; returns the slot index. `block_ids` is KV cache group 0's
        table, `other_group_block_ids` the tables of groups 1, 2, ... (one per further group).

        `num_prompt_tokens` (default: all of `token_ids`) marks where the prompt ends and outputs begin (a
        resumed request brings its outputs back among `token_ids`); the sampler reads it for penalties, seeds
        and `min_tokens`. `lora_request` is the adapter it runs with (None: the base model).

        Raises AssertionError("No free indices") when every slot is held and ValueError when `req_id` already
        holds one (callers that mean to replace must `remove` first).
        """
        if req_id in self.req_id_to_index:
            raise ValueError(
                f"request {req_id!r} already holds slot {self.req_id_to_index[req_id]}"
            )
        if not self.free_indices:
            raise AssertionError("No free indices")
        self._check_fits(
            req_id, len(token_ids), len(block_ids), num_computed_tokens, num_prompt_tokens
        )
        index = self.free_indices.pop()
        self.req_id_to_index[req_id] = index
        self.req_ids[index] = req_id
        self.sampling_params[index] = sampling_params
        self.lora_requests[index] = lora_request
        self.lora_ids[index] = 0 if lora_request is None else lora_request.lora_int_id
        self.num_tokens[index] = 0
        self.write_tokens(index, 0, token_ids)
        self.num_prompt_tokens[index] = (
            len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        )
        self.set_block_ids(index, block_ids)
        for group_id, group_block_ids in enumerate(other_group_block_ids, 1):
            self.set_block_ids(index, group_block_ids, group_id)
        self.set_num_computed_tokens(index, num_computed_tokens)
        # Prefix-hit blocks hold the draft's K/V too: the draft computes every position the target does.
        self.num_draft_computed[index] = num_computed_tokens
        return index

    def _check_fits(
        self,
        req_id: str,
        num_tokens: int,
        num_blocks: int,
        num_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Validate a new request before it takes a slot, so a failed `add` leaves every slot unchanged."""
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: {num_tokens} tokens exceed max_model_len={self.max_model_len}"
            )
        if num_blocks > self.max_blocks_per_req:
            raise ValueError(
                f"request {req_id!r}: {num_blocks} blocks exceed "
                f"max_blocks_per_req={self.max_blocks_per_req}"
            )
        if not 0 <= num_computed_tokens <= num_tokens:
            raise ValueError(
                f"request {req_id!r}: num_computed_tokens={num_computed_tokens} is outside "
                f"[0, {num_tokens}]"
            )
        if num_prompt_tokens is not None and not 0 < num_prompt_tokens <= num_tokens:
            raise ValueError(
                f"request {req_id!r}: num_prompt_tokens={num_prompt_tokens} is outside "
                f"[1, {num_tokens}]"
            )

    def remove(self, req_id: str) -> int | None:
        """Give `req_id`'s slot back; returns the freed index, or None (a no-op) for an unknown id."""
        index = self.req_id_to_index.pop(req_id, None)
        if index is None:
            return None
        self.req_ids[index] = None
        self.sampling_params[index] = None
        self.lora_requests[index] = None
        self.lora_ids[index] = 0
        self.free_indices.append(index)
        return index

    # ------------------------------------------------------------------------------------------ updates
    def write_tokens(self, index: int, start: int, token_ids: Sequence[int]) -> None:
        """Set the slot's tokens to its first `start` tokens followed by `token_ids` (truncate, then extend)."""
        if start > self.num_tokens[index]:
            raise ValueError(
                f"slot {index}: cannot write at {start}, it holds {self.num_tokens[index]} tokens"
            )
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(
                f"slot {index}: {end} tokens exceed max_model_len={self.max_model_len}"
            )
        self.token_ids[index, start:end] = token_ids
        self.num_tokens[index] = end

    def append_block_ids(self, index: int, block_ids: Sequence[int], group_id: int = 0) -> None:
        """Append `block_ids` to the slot's block table of KV cache group `group_id`."""
        num_blocks = self.group_num_blocks[group_id]
        start = int(num_blocks[index])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"slot {index}: {end} blocks exceed max_blocks_per_req={self.max_blocks_per_req}"
            )
        self.block_tables[group_id][index, start:end] = block_ids
        num_blocks[index] = end

    def set_block_ids(self, index: int, block_ids: Sequence[int], group_id: int = 0) -> None:
        """Replace the slot's whole block table of group `group_id` (a resumed request's new blocks)."""
        self.group_num_blocks[group_id][index] = 0
        self.append_block_ids(index, block_ids, group_id)

    def set_num_computed_tokens(self, index: int, num_computed_tokens: int) -> None:
        """Record how many of the slot's tokens have their KV written. The draft model's count is cut back to it:
        a token past the computed ones may change (a streaming chunk replaces the unfed last token)."""
        if not 0 <= num_computed_tokens <= self.num_tokens[index]:
            raise ValueError(
                f"slot {index}: num_computed_tokens={num_computed_tokens} is outside "
                f"[0, {self.num_tokens[index]}]"
            )
        self.num_computed_tokens[index] = num_computed_tokens
        if self.num_draft_computed[index] > num_computed_tokens:
            self.num_draft_computed[index] = num_computed_tokens

    # ------------------------------------------------------------------------------------------ queries
    def __contains__(self, req_id: object) -> bool:
        return req_id in self.req_id_to_index

    def __len__(self) -> int:
        return len(self.req_id_to_index)

    @property
    def num_free(self) -> int:
        return len(self.free_indices)

    def get_token_ids(self, req_id: str) -> list[int]:
        """The request's known tokens (a copy; for tests and preemption, not for the hot path)."""
        index = self.req_id_to_index[req_id]
        return self.token_ids[index, : self.num_tokens[index]].tolist()

    def batch_block_tables(
        self, slot_indices: np.ndarray, seq_lens: np.ndarray, block_size: int, group_id: int = 0
    ) -> np.ndarray:
        """The block tables of a batch (slot `slot_indices[r]` reading `seq_lens[r]` positions) in KV cache group
        `group_id`, as wide as its longest sequence needs; entries past a row's blocks are 0.

        A slot's table keeps stale entries past its `num_blocks` (a previous holder's blocks); they are zeroed so
        no model can read another request's KV through the padding.
        """
        # E.g., seq_lens [9, 5, 7] with block_size 4 -> width cdiv(9, 4) = 3 columns
        width = int(-(-seq_lens.max() // block_size)) if seq_lens.size else 0
        # Fancy indexing copies the rows, so zeroing the padding below leaves the slots' own tables intact.
        # E.g., slots [3, 0, 1] -> [[5, 9, 1], [2, 6, 7], [8, 3, 7]] (7: a previous holder's block)
        tables = self.block_tables[group_id][slot_indices, :width]
        # Column j is padding where j >= the row's block count.
        # E.g., num_blocks [3, 2, 2] -> [[5, 9, 1], [2, 6, 0], [8, 3, 0]]
        num_blocks = self.group_num_blocks[group_id][slot_indices]
        tables[np.arange(width)[None, :] >= num_blocks[:, None]] = 0
        return tables

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table (a copy)."""
        index = self.req_id_to_index[req_id]
        return self.block_table[index, : self.num_blocks[index]].tolist()
