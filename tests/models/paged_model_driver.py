"""A minimal engine for model tests: builds `BatchInputs` over a real paged KV cache, step by step.

Blocks come from a shuffled pool (non-contiguous, arbitrary ids); a request can start on another request's first
blocks (a prefix-cache hit). A model whose layers form several KV cache groups (`KVCacheLayout`) gets a cache of
`num_groups` pages per driver block: group g of driver block b is page `b * num_groups + g`.
`generate` runs a tiny continuous-batching loop (arrivals, chunked prefill, decodes
mixed in one step) with greedy sampling, so model tests exercise exactly the layouts the runner produces.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kvflow.batch import BatchInputs


@dataclass
class DriverRequest:
    """A request's tokens, blocks and progress; `num_computed` tokens already have KV in the cache."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class PagedDriver:
    """Owns a model's KV cache and a shuffled block pool; `step` runs one scheduled batch through `forward`.

    Blocks are never freed (tests are short), so a shared prefix block stays valid for every request using it.
    `step_query_lens` records each step's per-request query lengths (tests assert mixed steps happened).
    """

    def __init__(
        self, model: torch.nn.Module, *, num_blocks: int = 256, block_size: int = 4, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        layout = getattr(model, "kv_cache_layout", None)
        self.num_kv_groups = 1 if layout is None else layout.num_groups
        self.kv_cache = model.make_kv_cache(num_blocks * self.num_kv_groups, block_size)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.requests: dict[str, DriverRequest] = {}
        self.step_query_lens: list[list[int]] = []

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        *,
        share_prefix_from: str | None = None,
        num_shared_blocks: int = 0,
    ) -> DriverRequest:
        request = DriverRequest(req_id, list(prompt_token_ids), len(prompt_token_ids))
        if share_prefix_from is not None:
            source = self.requests[share_prefix_from]
            assert source.num_computed >= num_shared_blocks * self.block_size, (
                "shared blocks must be computed"
            )
            assert (
                source.token_ids[: num_shared_blocks * self.block_size]
                == request.token_ids[: num_shared_blocks * self.block_size]
            ), "shared blocks must hold the same tokens"
            request.block_ids = source.block_ids[:num_shared_blocks]
            request.num_computed = num_shared_blocks * self.block_size
        self.requests[req_id] = request
        return request

    def _ensure_blocks(self, request: DriverRequest, num_tokens: int) -> None:
        while len(request.block_ids) * self.block_size < num_tokens:
            request.block_ids.append(self.free_blocks.pop())

    def build_batch(self, schedule: dict[str, int], *, all_logits: bool = False) -> BatchInputs:
        """The `BatchInputs` for running `schedule[req_id]` next tokens of each request (in dict order).

        Requests whose last known token is scheduled sample (one logits index); with `all_logits` every
        scheduled token gets a logits index instead.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampled_rows: list[int] = []
        for row, (req_id, num_tokens) in enumerate(schedule.items()):
            request = self.requests[req_id]
            start, end = request.num_computed, request.num_computed + num_tokens
            assert end <= len(request.token_ids)
            self._ensure_blocks(request, end)
            for position in range(start, end):
                block = request.block_ids[position // self.block_size]
                input_ids.append(request.token_ids[position])
                positions.append(position)
                slots.append(block * self.block_size + position % self.block_size)
            query_start_loc.append(query_start_loc[-1] + num_tokens)
            seq_lens.append(end)
            if all_logits:
                logits_indices.extend(range(query_start_loc[-2], query_start_loc[-1]))
                sampled_rows.extend([row] * num_tokens)
            elif end == len(request.token_ids):
                logits_indices.append(query_start_loc[-1] - 1)
                sampled_rows.append(row)
        width = max(-(-length // self.block_size) for length in seq_lens)
        tables = torch.zeros(len(schedule), width, dtype=torch.int32)
        for row, req_id in enumerate(schedule):
            blocks = self.requests[req_id].block_ids[: -(-seq_lens[row] // self.block_size)]
            tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        groups = [
            (
                (slot_mapping // self.block_size * self.num_kv_groups + group_id) * self.block_size
                + slot_mapping % self.block_size,
                tables * self.num_kv_groups + group_id,
            )
            for group_id in range(self.num_kv_groups)
        ]
        return BatchInputs(
            req_ids=list(schedule),
            block_size=self.block_size,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=groups[0][0],
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=groups[0][1],
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            sampled_req_indices=torch.tensor(sampled_rows, dtype=torch.int64),
            other_groups=tuple(groups[1:]),
        )

    def step(
        self, schedule: dict[str, int], *, all_logits: bool = False
    ) -> tuple[BatchInputs, torch.Tensor]:
        """Run one batch; returns it and the model's logits (one row per logits index)."""
        batch = self.build_batch(schedule, all_logits=all_logits)
        with torch.inference_mode():
            logits = self.model.forward(batch, self.kv_cache)
        assert logits.dtype == torch.float32
        assert logits.shape == (batch.logits_indices.shape[0], self.model.vocab_size)
        for req_id, num_tokens in schedule.items():
            self.requests[req_id].num_computed += num_tokens
        self.step_query_lens.append(list(schedule.values()))
        return batch, logits

    def prompt_logits(self, req_id: str, chunk_sizes: list[int]) -> torch.Tensor:
        """Logits for every remaining prompt token of one request, fed in chunks of `chunk_sizes`."""
        rows = []
        for chunk in chunk_sizes:
            _, logits = self.step({req_id: chunk}, all_logits=True)
            rows.append(logits)
        return torch.cat(rows)

    def generate(
        self,
        prompts: dict[str, list[int]],
        max_new_tokens: int,
        *,
        chunk_size: int | None = None,
        arrival_steps: dict[str, int] | None = None,
    ) -> dict[str, list[int]]:
        """Greedy-generate `max_new_tokens` for each prompt with continuous batching.

        Every step schedules each arrived, unfinished request: its remaining prompt (at most `chunk_size` tokens)
        or one decode token. A request already added (e.g. with a shared prefix) keeps its computed tokens.
        """
        arrival_steps = arrival_steps or {}
        running: list[str] = []
        step_index = 0
        while True:
            for req_id, prompt in prompts.items():
                if req_id not in running and arrival_steps.get(req_id, 0) <= step_index:
                    if req_id not in self.requests:
                        self.add_request(req_id, prompt)
                    running.append(req_id)
            active = [
                req_id
                for req_id in running
                if len(self.requests[req_id].output_token_ids) < max_new_tokens
            ]
            if not active and len(running) == len(prompts):
                break
            schedule = {}
            for req_id in active:
                request = self.requests[req_id]
                remaining = len(request.token_ids) - request.num_computed
                schedule[req_id] = min(remaining, chunk_size) if chunk_size else remaining
            if schedule:
                batch, logits = self.step(schedule)
                next_tokens = logits.argmax(dim=-1).tolist()
                for row, token in zip(batch.sampled_req_indices.tolist(), next_tokens, strict=True):
                    self.requests[batch.req_ids[row]].token_ids.append(token)
            step_index += 1
        return {req_id: self.requests[req_id].output_token_ids for req_id in prompts}
