"""Draft-model proposals: a smaller model with the target's tokenizer drafts the next tokens of every request.

`speculative_config={"method": "draft_model", "model": PATH, "num_speculative_tokens": k}` ("default-draft" is
the built-in model's draft, shipped in `kvflow/default_model/draft/`). The worker builds the
draft beside the target (`load`), gives it a KV cache of its own with the target's block count and block size
(`make_kv_cache`; the KV cache plan counts both), and after each step the runner asks it for drafts
(`propose_batch`).

The draft shares the target's paged layout: its K/V for position p of a request lives in the same block and offset
as the target's, in the draft's own cache tensors, so the scheduler's block tables serve both and a prefix-cache
hit gives the draft's K/V of the hit blocks too. That holds because the draft computes every position the target
computes, in the same step (the runner passes every scheduled request: `catch_up`), so a full block's draft K/V is
written whenever its target K/V is. The scheduler allocates `num_speculative_tokens` lookahead slots per request,
where the draft writes the K/V of its own drafts while proposing.

Invariants:
  * `RequestSlots.num_draft_computed[i]` counts the leading tokens of slot i whose draft K/V is in the cache;
    `propose_batch` computes positions `num_draft_computed .. end - 1` and sets it to `end`; the K/V it writes for
    its drafts (positions past the known tokens) is never counted, and the next call overwrites it;
  * a greedy request's drafts are the draft's argmax (point masses: the runner keeps a draft when the target's
    argmax equals it); a sampled request's draft j is drawn from q_j, the draft's distribution after the
    request's own sampling settings, and q_j is returned with it for `rejection_sample`'s min(1, p/q) rule;
  * a seeded request's drafts come from generators keyed by (seed, output position), so they are reproducible.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from kvflow.batch import BatchInputs
from kvflow.default_model import DEFAULT_DRAFT_NAME, SHIPPED_DRAFT
from kvflow.spec_decode.proposer import DraftBatch, Proposal, Proposer
from kvflow.utils import to_device
from kvflow.worker.sampler import Sampler, build_sampling_metadata, mix_seed

if TYPE_CHECKING:
    from kvflow.config import EngineConfig, SpeculativeConfig
    from kvflow.models.interface import RunnerModel
    from kvflow.worker.states import RequestSlots

# Mixed into a request's seed for its draft tokens, so they never reuse the target sampler's random streams.
DRAFT_SEED_SALT = 0x6472616674  # "draft"


class DraftModelProposer(Proposer):
    """Drafts from a smaller model with the target's vocabulary, run by the worker beside the target."""

    needs_kv_cache: ClassVar[bool] = True

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.model: RunnerModel | None = None
        self.kv_cache: torch.Tensor | None = None
        self.block_size = 0
        self.device = torch.device("cpu")
        self._generator: torch.Generator | None = None
        self._seed = 0

    # ------------------------------------------------------------------------------------------ set-up
    def load(
        self, engine_config: EngineConfig, device: torch.device, target_vocab_size: int
    ) -> None:
        """Build the draft on `device` (the target's dtype option). A draft whose vocabulary differs from the
        target's, or that cannot reach the engine's max_model_len, is a ValueError naming `speculative_config`."""
        from kvflow.model_info import resolve_model_info
        from kvflow.models.registry import build_model

        model_path = self.config.model
        if model_path == DEFAULT_DRAFT_NAME:
            model_path = str(SHIPPED_DRAFT)
        try:
            info = resolve_model_info(model_path)
        except ValueError as error:
            raise ValueError(f"speculative_config model: {error}") from None
        if info.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config model {model_path!r} has a vocabulary of {info.vocab_size} tokens, the "
                f"target model {target_vocab_size}: a draft model must share the target's tokenizer"
            )
        max_model_len = engine_config.scheduler_config.max_model_len
        if info.max_model_len < max_model_len:
            raise ValueError(
                f"speculative_config model {model_path!r} reaches {info.max_model_len} positions, fewer than "
                f"max_model_len={max_model_len}: lower max_model_len or use a draft that reaches it"
            )
        model_config = dataclasses.replace(
            engine_config.model_config,
            model=model_path,
            tokenizer=None,
            max_model_len=max_model_len,
        )
        self.model = build_model(model_config, info, device)
        if self.model.samples_own_tokens:
            raise ValueError(
                f"speculative_config model {model_path!r} gives no logits to draft from"
            )
        self.device = device
        self._seed = engine_config.model_config.seed

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        assert self.model is not None, "load the draft model first"
        return self.model.kv_cache_bytes_per_block(block_size)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The draft's KV cache: the target's block count and block size, the draft's own layers and heads."""
        assert self.model is not None, "load the draft model first"
        self.block_size = block_size
        self.kv_cache = self.model.make_kv_cache(num_blocks, block_size).to(self.device)

    # ------------------------------------------------------------------------------------------ proposing
    def propose_batch(self, batch: DraftBatch) -> dict[int, Proposal]:
        """Bring each slot of `batch.catch_up` (slot -> end) to `end` computed draft positions, then draft up to
        min(`max_drafts[slot]`, `num_speculative_tokens`) tokens after the known tokens of each slot of
        `max_drafts` whose end is its `num_tokens` (one whose blocks do not hold its known tokens yet drafts
        nothing this step; its last known token is recomputed when already covered, for its logits). Drafts are
        cut to the positions the slot's blocks can hold. Returns the proposals by slot."""
        assert self.model is not None and self.kv_cache is not None, "the draft model is not set up"
        slots, catch_up, eos_token_id = batch.slots, batch.catch_up, batch.eos_token_id
        max_drafts = {
            index: min(room, self.num_speculative_tokens)
            for index, room in batch.max_drafts.items()
            if catch_up.get(index) == slots.num_tokens[index]
        }
        block_size = self.block_size
        rows: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        num_drafts: dict[int, int] = {}
        for index, end in catch_up.items():
            start = int(slots.num_draft_computed[index])
            wanted = max_drafts.get(index, 0)
            if wanted > 0:
                assert end == slots.num_tokens[index], (
                    "a proposing slot catches up to its known tokens"
                )
                # Draft j (1-based) is read from position end - 2 + j, whose K/V the next pass writes: the
                # last draft needs none, so drafts fit up to one past the blocks' capacity.
                room = int(slots.num_blocks[index]) * block_size - end + 1
                wanted = min(wanted, room)
                start = min(start, end - 1)
            if start >= end:
                continue
            rows.append(index)
            starts.append(start)
            ends.append(end)
            if wanted > 0:
                num_drafts[index] = wanted
        if not rows:
            return {}
        slot_indices = np.array(rows, dtype=np.int64)
        start_arr = np.array(starts, dtype=np.int64)
        end_arr = np.array(ends, dtype=np.int64)
        proposing = [row for row, index in enumerate(rows) if index in num_drafts]
        with torch.inference_mode():
            logits = self._forward(slots, slot_indices, start_arr, end_arr, proposing)
            slots.num_draft_computed[slot_indices] = end_arr
            return self._draft(
                slots, [rows[row] for row in proposing], num_drafts, logits, eos_token_id
            )

    def _draft(
        self,
        slots: RequestSlots,
        indices: list[int],
        num_drafts: dict[int, int],
        logits: torch.Tensor,
        eos_token_id: int | None,
    ) -> dict[int, Proposal]:
        """Draft tokens one position at a time: choose from `logits` (one row per slot of `indices`), write the
        choice after the slot's known tokens, and run the slots that want more through the draft again."""
        proposals = {index: Proposal([]) for index in indices}
        probs_by_slot: dict[int, list[torch.Tensor]] = {index: [] for index in indices}
        active = list(indices)
        step = 0
        while active:
            chosen, probs = self._choose(slots, active, step, logits, eos_token_id)
            for row, index in enumerate(active):
                position = int(slots.num_tokens[index]) + step
                slots.token_ids[index, position] = chosen[row]  # uncommitted: past num_tokens
                proposals[index].token_ids.append(chosen[row])
                if probs[row] is not None:
                    probs_by_slot[index].append(probs[row])
            step += 1
            active = [index for index in active if num_drafts[index] > step]
            if not active:
                break
            slot_indices = np.array(active, dtype=np.int64)
            positions = slots.num_tokens[slot_indices] + step - 1
            logits = self._forward(
                slots, slot_indices, positions, positions + 1, list(range(len(active)))
            )
        for index in indices:
            if probs_by_slot[index]:
                proposals[index].draft_probs = torch.stack(probs_by_slot[index])
        return proposals

    def _choose(
        self,
        slots: RequestSlots,
        indices: list[int],
        step: int,
        logits: torch.Tensor,
        eos_token_id: int | None,
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each slot's draft at `step` (0-based): the argmax for greedy requests, else a draw from the draft's
        distribution under the request's settings (penalties see the earlier drafts as tokens). Returns the ids
        and each sampled row's distribution (None for greedy rows)."""
        slot_indices = np.array(indices, dtype=np.int64)
        params = [slots.sampling_params[index] for index in indices]
        assert all(p is not None for p in params), "a drafting request has no SamplingParams"
        metadata = build_sampling_metadata(
            params,  # type: ignore[arg-type]
            token_ids=slots.token_ids,
            slot_indices=slot_indices,
            num_prompt_tokens=slots.num_prompt_tokens[slot_indices],
            num_tokens=slots.num_tokens[slot_indices] + step,
            vocab_size=int(logits.shape[1]),
            eos_token_id=eos_token_id,
            device=logits.device,
        )
        if metadata.is_plain_greedy:
            return logits.float().argmax(dim=-1).tolist(), [None] * len(indices)
        probs = Sampler.probabilities(logits, metadata)
        chosen: list[int] = []
        for row, greedy in enumerate(metadata.greedy.tolist()):
            if greedy:
                chosen.append(int(probs[row].argmax()))
                continue
            p, index = params[row], indices[row]
            assert p is not None
            position = int(slots.num_tokens[index] - slots.num_prompt_tokens[index]) + step
            chosen.append(
                int(
                    torch.multinomial(
                        probs[row], 1, generator=self._row_generator(p.seed, position)
                    )
                )
            )
        greedy_rows = metadata.greedy.tolist()
        return chosen, [None if greedy_rows[row] else probs[row] for row in range(len(indices))]

    def _row_generator(self, seed: int | None, position: int) -> torch.Generator:
        """A seeded request's generator for its draft at output `position`; else this proposer's own stream."""
        if seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(mix_seed(seed ^ DRAFT_SEED_SALT, position))
            return generator
        if self._generator is None:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(mix_seed(self._seed, DRAFT_SEED_SALT))
        return self._generator

    def _forward(
        self,
        slots: RequestSlots,
        slot_indices: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        logits_rows: list[int],
    ) -> torch.Tensor:
        """Run the draft over positions [starts[r], ends[r]) of each slot, writing their K/V; returns the logits
        at the last position of each row in `logits_rows`."""
        assert self.model is not None and self.kv_cache is not None
        block_size = self.block_size
        counts = ends - starts
        query_start_loc = np.zeros(len(slot_indices) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        token_rows = np.repeat(np.arange(len(slot_indices)), counts)
        positions = (
            np.arange(query_start_loc[-1]) - query_start_loc[token_rows] + starts[token_rows]
        )
        token_slots = slot_indices[token_rows]
        input_ids = slots.token_ids[token_slots, positions]
        block_ids = slots.block_table[token_slots, positions // block_size].astype(np.int64)
        slot_mapping = block_ids * block_size + positions % block_size
        rows = np.array(logits_rows, dtype=np.int64)
        device = self.device
        batch = BatchInputs(
            req_ids=[str(index) for index in slot_indices.tolist()],
            block_size=block_size,
            input_ids=to_device(input_ids, device),
            positions=to_device(positions, device),
            slot_mapping=to_device(slot_mapping, device),
            query_start_loc=to_device(query_start_loc.astype(np.int32), device),
            seq_lens=to_device(ends.astype(np.int32), device),
            block_tables=to_device(
                slots.batch_block_tables(slot_indices, ends, block_size), device
            ),
            logits_indices=to_device(query_start_loc[rows + 1] - 1, device),
            sampled_req_indices=to_device(rows, device),
        )
        return self.model.forward(batch, self.kv_cache)
