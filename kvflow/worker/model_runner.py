"""The slot runner: applies each `SchedulerOutput` to the worker's request slots, builds the batch, runs the model."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvflow.batch import BatchInputs
from kvflow.core.sched.output import DRAFT_PLACEHOLDER, LogprobsLists, ModelRunnerOutput
from kvflow.spec_decode.rejection_sampler import accept_point_mass_drafts, rejection_sample
from kvflow.utils import cdiv, to_device
from kvflow.worker.sampler import (
    Sampler,
    SamplerOutput,
    build_sampling_metadata,
    forbid_tokens,
    mix_seed,
    token_logprobs,
)
from kvflow.worker.states import RequestSlots

if TYPE_CHECKING:
    from kvflow.core.sched.output import (
        CachedRequestData,
        GrammarOutput,
        NewRequestData,
        SchedulerOutput,
    )
    from kvflow.models.interface import RunnerModel


logger = logging.getLogger(__name__)


class DraftProposer(Protocol):
    """Speculative decoding's proposer in the worker (`kvflow.spec_decode`): a lookup proposer (n-gram) drafts
    per request through `propose`; one with `needs_kv_cache` (the draft model) drafts for the whole batch through
    `propose_batch` (see `kvflow.spec_decode.draft_model.DraftModelProposer`)."""

    def propose(self, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        """Up to `max_drafts` draft tokens to follow `token_ids` (a request's known tokens)."""
        ...


# Mixed into a seeded request's seed for the uniforms that accept or reject its drafts (`rejection_sample`), so
# they never reuse the streams its tokens are sampled from.
_VERIFY_SEED_SALT = 0x766572696679  # "verify"


# Prompt-logprob rows go through log_softmax / rank / top-k this many at a time, bounding the temporaries.
_PROMPT_LOGPROBS_CHUNK_ROWS = 512


@dataclass
class _PromptLogprobRows:
    """The step's prompt-logprob rows, after the sampled rows in `BatchInputs.logits_indices`, grouped by request.

    Request `req_ids[i]` owns `counts[i]` consecutive rows; row j of it holds the logits at prompt position
    `start_indices[i] - 1 + j`, which predict prompt token `start_indices[i] + j` (`target_token_ids`).
    """

    req_ids: list[str]
    num_logprobs: list[int]
    start_indices: list[int]
    counts: list[int]
    flat_indices: np.ndarray  # [num_rows] flat batch token of each row
    target_token_ids: np.ndarray  # [num_rows] the prompt token each row predicts


@dataclass
class _StepArrays:
    """Numpy views of one step's batch that the post-forward state update needs."""

    slot_indices: np.ndarray  # [num_reqs] slot of each batch row
    num_scheduled: np.ndarray  # [num_reqs]
    sampled_rows: (
        np.ndarray
    )  # [num_sampled] the batch row of each sampled row (repeated for drafts)
    req_id_to_index: dict[str, int]  # batch row of each request
    prompt_rows: _PromptLogprobRows | None = None
    # Requests whose sampling failed on their own this step -> why (see `ModelRunnerOutput.failed_req_ids`).
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: the drafts each batch row verifies (none: an empty dict), and for each sampled row
    # its offset among its request's rows (row j samples the token after the request's j-th draft).
    drafts: dict[int, list[int]] = field(default_factory=dict)
    sample_offsets: np.ndarray | None = None
    # Draft-model drafts of sampled requests: the distribution each batch row's drafts were drawn from ([d, V]),
    # and, once verified, the tokens `rejection_sample` emitted for the row (used instead of point-mass checks).
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    verified: dict[int, list[int]] = field(default_factory=dict)


class ModelRunner:
    """The slot runner (the default protocol, `use_v2_model_runner=True`): turns `SchedulerOutput`s into forward
    passes over a paged KV cache owned by the runner.

    Invariants:
      * every request the scheduler may schedule holds a slot in `slots` (`slots.req_id_to_index`): it takes one
        when it first appears in `scheduled_new_reqs` and gives it back when its id appears in `finished_req_ids` or
        `preempted_req_ids`; a resumed request comes back as a new request carrying `prefill_token_ids`;
      * a held request's token buffer includes its last sampled token: the worker feeds that token into the next
        step itself, the scheduler never sends it back;
      * each step costs O(scheduled tokens + batch requests * blocks in the batch), never O(request history);
      * persistent-batch data (`resumed_req_ids`, `all_token_ids`) is a protocol error: the scheduler never sends
        it to this runner;
      * `prompt_logprob_reqs` holds exactly the held requests with `SamplingParams.prompt_logprobs` whose prompt
        positions that predict a prompt token (0 .. num_prompt_tokens - 2) are not all computed yet, and that had
        no output when they took their slot (a resume with outputs computed them before). Only they add logits rows
        beyond the sampled ones, so requests without prompt logprobs cost nothing extra.
    Another protocol (`kvflow.worker.persistent_batch`) subclasses this runner and overrides the per-request steps
    `_forget`, `_preempt`, `_apply_cached_blocks` and `_apply_cached_tokens`, and `_update_cached_requests`.
    """

    def __init__(
        self,
        model: RunnerModel,
        *,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        device: str | torch.device = "cpu",
        eos_token_id: int | None = None,
        seed: int = 0,
        spec_proposer: DraftProposer | None = None,
        spec_disable_by_batch_size: int | None = None,
    ) -> None:
        self.model = model
        # A step with at least this many requests proposes no drafts (None: always propose); logged per switch.
        self.spec_disable_by_batch_size = spec_disable_by_batch_size
        self._spec_switched_off = False
        # Speculative decoding: proposes each decoding request's drafts after its tokens are sampled (None: off);
        # `slot_drafts[index]` are the drafts proposed for the request in that slot after its latest step.
        self.spec_proposer = spec_proposer
        self.slot_drafts: list[list[int]] = [[] for _ in range(max_num_reqs)]
        # ... and the distributions they were drawn from (draft model, sampled requests; else None).
        self.slot_draft_probs: list[torch.Tensor | None] = [None] * max_num_reqs
        self._num_real_drafts: dict[int, int] = {}  # this step's padded rows -> real drafts
        self._draft_probs: dict[int, torch.Tensor] = {}  # this step's rows with draft distributions
        self.eos_token_id = eos_token_id
        self.sampler = Sampler(seed)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.slots = RequestSlots(max_num_reqs, max_model_len, int(cdiv(max_model_len, block_size)))
        self.kv_cache = model.make_kv_cache(num_blocks, block_size).to(self.device)
        self._drafts_with_model = bool(getattr(spec_proposer, "needs_kv_cache", False))
        if self._drafts_with_model:
            spec_proposer.make_kv_cache(num_blocks, block_size)  # type: ignore[union-attr]
        # Held requests still computing prompt logprobs -> their SamplingParams.prompt_logprobs.
        self.prompt_logprob_reqs: dict[str, int] = {}
        # A forward pass whose sampling waits for `sample_tokens` (structured outputs): logits, batch, arrays.
        self._deferred_step: tuple[torch.Tensor, BatchInputs, _StepArrays] | None = None

    # ------------------------------------------------------------------------------------------ step
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply one step's plan (release, add, update), run the scheduled tokens and return what was sampled.

        A step with structured-output requests stops after the forward pass and returns None: `sample_tokens`,
        the next call, samples it under the step's grammar bitmask (computed meanwhile by the engine)."""
        assert self._deferred_step is None, "a step's sampling is still waiting for its grammar"
        self._release(scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids)
        self._add_new_requests(scheduler_output.scheduled_new_reqs)
        self._update_cached_requests(scheduler_output.scheduled_cached_reqs)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput.make_empty()
        batch, arrays = self._prepare_inputs(
            scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens
        )
        with torch.inference_mode():
            model_output = self.model.forward(batch, self.kv_cache)
        if scheduler_output.has_structured_output_requests:
            self._deferred_step = (model_output, batch, arrays)
            return None
        return self._sample_and_update(model_output, batch, arrays, None)

    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        """Sample the step whose forward pass `execute_model` deferred, masking its structured requests' rows."""
        assert self._deferred_step is not None, "sample_tokens without a deferred forward pass"
        model_output, batch, arrays = self._deferred_step
        self._deferred_step = None
        return self._sample_and_update(model_output, batch, arrays, grammar_output)

    def _sample_and_update(
        self,
        model_output: torch.Tensor,
        batch: BatchInputs,
        arrays: _StepArrays,
        grammar_output: GrammarOutput | None,
    ) -> ModelRunnerOutput:
        with torch.inference_mode():
            sampled = self._sample(model_output, batch, arrays, grammar_output)
            if arrays.draft_probs:
                self._verify_sampled_drafts(model_output, arrays)
            prompt_logprobs = None
            if arrays.prompt_rows is not None:
                prompt_logits = model_output[batch.num_sampled :]
                prompt_logprobs = _compute_prompt_logprobs(prompt_logits, arrays.prompt_rows)
        output = self._update_states(batch, arrays, sampled)
        output.prompt_logprobs_dict = prompt_logprobs
        return output

    # ------------------------------------------------------------------------------------------ a. release
    def _release(self, finished_req_ids: set[str], preempted_req_ids: set[str]) -> None:
        """Finished requests are forgotten, then preempted ones are released the protocol's way."""
        for req_id in finished_req_ids:
            self._forget(req_id)
        for req_id in preempted_req_ids - finished_req_ids:
            self._preempt(req_id)

    def _forget(self, req_id: str) -> None:
        """Drop whatever the worker holds for `req_id` (a no-op for an id it does not hold)."""
        self.slots.remove(req_id)
        self.prompt_logprob_reqs.pop(req_id, None)

    def _preempt(self, req_id: str) -> None:
        """A preempted request gives its slot back: it will return as a new request."""
        self.slots.remove(req_id)
        self.prompt_logprob_reqs.pop(req_id, None)

    # ------------------------------------------------------------------------------------------ b. add
    def _add_new_requests(self, new_reqs: Iterable[NewRequestData]) -> None:
        """Give each new request a slot; a same-id add replaces whatever the worker held for that id."""
        for new_req in new_reqs:
            self._forget(new_req.req_id)
            token_ids = (
                new_req.prefill_token_ids
                if new_req.prefill_token_ids is not None
                else new_req.prompt_token_ids
            )
            index = self.slots.add(
                new_req.req_id,
                token_ids,
                new_req.block_ids[0],
                new_req.num_computed_tokens,
                new_req.sampling_params,
                num_prompt_tokens=len(new_req.prompt_token_ids),
            )
            self._track_prompt_logprobs(new_req.req_id, index)
            # Drafts proposed for the slot's previous holder are not this request's.
            self.slot_drafts[index] = []
            self.slot_draft_probs[index] = None

    def _track_prompt_logprobs(self, req_id: str, index: int) -> None:
        """Add a request that just took slot `index` to `prompt_logprob_reqs` if it still needs prompt logprobs.

        A request that comes with outputs (a resume) computed them before it was preempted, so it does not repeat
        them; one resumed before its first output recomputes its prompt, and its rows with it.
        """
        params = self.slots.sampling_params[index]
        if params is None or params.prompt_logprobs is None:
            return
        if self.model.samples_own_tokens:
            raise ValueError(
                f"request {req_id!r} asks for prompt_logprobs, but this model samples its own tokens "
                "and has no logits"
            )
        num_prompt_tokens = int(self.slots.num_prompt_tokens[index])
        if (
            self.slots.num_tokens[index] == num_prompt_tokens
            and self.slots.num_computed_tokens[index] < num_prompt_tokens - 1
        ):
            self.prompt_logprob_reqs[req_id] = params.prompt_logprobs

    # ------------------------------------------------------------------------------------------ c. update
    def _update_cached_requests(self, cached: CachedRequestData) -> None:
        """Refuse persistent-batch data, then update the requests the worker already holds."""
        assert not cached.resumed_req_ids and not cached.all_token_ids, (
            "the slot runner got persistent-batch data (resumed_req_ids / all_token_ids); "
            "it takes resumed requests back as new requests"
        )
        self._apply_cached_updates(cached)

    def _apply_cached_updates(self, cached: CachedRequestData) -> None:
        """Apply block, token and progress updates to requests the worker already holds."""
        num_reqs = len(cached.req_ids)
        lengths = (
            len(cached.new_token_ids),
            len(cached.new_block_ids),
            len(cached.num_computed_tokens),
        )
        assert lengths == (num_reqs,) * 3, (
            f"CachedRequestData lists are not parallel: {num_reqs}, {lengths}"
        )
        speculating = self.spec_proposer is not None
        for i in range(num_reqs):
            index = self._apply_cached_blocks(cached, i)
            self._apply_cached_tokens(index, cached, i)
            num_computed_tokens = cached.num_computed_tokens[i]
            if speculating and cached.req_ids[i] not in cached.resumed_req_ids:
                # With steps in flight the scheduler counts their draft slots as accepted (an upper bound, see
                # AsyncScheduler); the worker knows how many were. A streaming chunk cuts the count back; a
                # resumed request (persistent-batch protocol) takes the scheduler's count, prefix hits included.
                num_computed_tokens = min(
                    num_computed_tokens, int(self.slots.num_computed_tokens[index])
                )
            self.slots.set_num_computed_tokens(index, num_computed_tokens)
            # Tokens past the computed ones may change (a streaming chunk replaces the unfed last token).
            if self.slots.num_draft_computed[index] > num_computed_tokens:
                self.slots.num_draft_computed[index] = num_computed_tokens

    def _apply_cached_blocks(self, cached: CachedRequestData, i: int) -> int:
        """Extend cached request `i`'s block table with its new blocks; returns its slot index."""
        index = self._index_of(cached.req_ids[i])
        new_block_ids = cached.new_block_ids[i]
        if new_block_ids is not None:
            self.slots.append_block_ids(index, new_block_ids[0])
        return index

    def _apply_cached_tokens(self, index: int, cached: CachedRequestData, i: int) -> None:
        """A streaming session's next chunk replaces the unfed last token; all of the session is prompt now."""
        new_token_ids = cached.new_token_ids[i]
        if new_token_ids:
            self.slots.write_tokens(index, cached.num_computed_tokens[i], new_token_ids)
            self.slots.num_prompt_tokens[index] = self.slots.num_tokens[index]

    def _index_of(self, req_id: str) -> int:
        index = self.slots.req_id_to_index.get(req_id)
        assert index is not None, f"request {req_id!r} holds no worker slot"
        return index

    # ------------------------------------------------------------------------------------------ d. inputs
    def _prepare_inputs(
        self,
        num_scheduled_tokens: dict[str, int],
        spec_decode_tokens: dict[str, list[int]] | None = None,
    ) -> tuple[BatchInputs, _StepArrays]:
        """Build the batch tensors with vectorised gathers over the slot arrays (O(scheduled tokens)).

        The comments follow one example: requests [a, b, c] hold slots [3, 0, 1], have [7, 0, 4] tokens computed
        and [2, 5, 3] scheduled, with block_size 4 and block tables a: [5, 9, 1], b: [2, 6], c: [8, 3]; b is the
        first chunk of a 12-token prompt, a and c reach their last known token.
        """
        req_ids = list(num_scheduled_tokens)
        slot_indices = np.fromiter(
            (self._index_of(req_id) for req_id in req_ids), np.int64, len(req_ids)
        )
        num_scheduled = np.fromiter(num_scheduled_tokens.values(), np.int64, len(req_ids))
        start = self.slots.num_computed_tokens[slot_indices]
        seq_lens = start + num_scheduled  # E.g., [7, 0, 4] + [2, 5, 3] -> [9, 5, 7]
        drafts = self._write_drafts(req_ids, slot_indices, spec_decode_tokens)
        self._check_scheduled(req_ids, slot_indices, seq_lens, drafts)

        # Where each request's tokens start in the flat batch; the last entry is the batch's token count.
        # E.g., [2, 5, 3] -> [0, 2, 7, 10]
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        # The batch row (request) of each flat token.
        # E.g., [2, 5, 3] -> [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
        token_rows = np.repeat(np.arange(len(req_ids)), num_scheduled)
        # Offset within the request's scheduled tokens, shifted past the tokens it has computed.
        # E.g., [0, 1, 0, 1, 2, 3, 4, 0, 1, 2] + [7, 7, 0, 0, 0, 0, 0, 4, 4, 4]
        #    -> [7, 8, 0, 1, 2, 3, 4, 4, 5, 6]
        positions = np.arange(query_start_loc[-1]) - query_start_loc[token_rows] + start[token_rows]
        # One 2-D gather reads every token from its request's slot row: slots [3, 3, 0, 0, 0, 0, 0, 1, 1, 1].
        token_slots = slot_indices[token_rows]
        input_ids = self.slots.token_ids[token_slots, positions]
        # The block holding each position, through the request's block table (column position // block_size).
        # E.g., columns [1, 2, 0, 0, 0, 0, 1, 1, 1, 1] -> blocks [9, 1, 2, 2, 2, 2, 6, 3, 3, 3]
        block_ids = self.slots.block_table[token_slots, positions // self.block_size].astype(
            np.int64
        )
        # The KV cache slot each token's K/V is written to: its block's first slot plus its offset in the block.
        # E.g., [9, 1, 2, ...] * 4 + [3, 0, 0, ...] -> [39, 4, 8, 9, 10, 11, 24, 12, 13, 14]
        slot_mapping = block_ids * self.block_size + positions % self.block_size

        # A request samples once its scheduled tokens reach its last known token (partial prefills do not), from
        # the logits of its last scheduled token, the flat index just before the next request's start.
        # E.g., sampled_rows [0, 2] -> logits_indices [2 - 1, 10 - 1] = [1, 9]
        samples = (num_scheduled > 0) & (seq_lens >= self.slots.num_tokens[slot_indices])
        sampled_rows = np.flatnonzero(samples)
        logits_indices = query_start_loc[sampled_rows + 1] - 1
        sample_offsets = None
        if drafts:
            # A request verifying d drafts samples d + 1 rows, from its last d + 1 scheduled tokens.
            # E.g., sampled rows [0, 2], row 2 with 2 drafts: rows [0, 2, 2, 2], offsets [0, 0, 1, 2],
            # logits_indices [1, 7, 8, 9].
            counts = np.array([len(drafts.get(row, ())) + 1 for row in sampled_rows.tolist()])
            group_starts = np.cumsum(counts) - counts
            sample_offsets = np.arange(int(counts.sum())) - np.repeat(group_starts, counts)
            sampled_rows = np.repeat(sampled_rows, counts)
            logits_indices = (
                np.repeat(logits_indices, counts) - np.repeat(counts - 1, counts) + sample_offsets
            )
        arrays = _StepArrays(
            slot_indices,
            num_scheduled,
            sampled_rows,
            {req_id: row for row, req_id in enumerate(req_ids)},
            drafts=drafts,
            sample_offsets=sample_offsets,
            draft_probs=self._draft_probs,
        )
        if self.prompt_logprob_reqs:
            arrays.prompt_rows = self._prompt_logprob_rows(arrays, start, query_start_loc)
            if arrays.prompt_rows is not None:
                # Prompt-logprob rows follow the sampled ones: the model returns logits for both.
                logits_indices = np.concatenate([logits_indices, arrays.prompt_rows.flat_indices])
        batch = BatchInputs(
            req_ids=req_ids,
            block_size=self.block_size,
            input_ids=to_device(input_ids, self.device),
            positions=to_device(positions, self.device),
            slot_mapping=to_device(slot_mapping, self.device),
            query_start_loc=to_device(query_start_loc.astype(np.int32), self.device),
            seq_lens=to_device(seq_lens.astype(np.int32), self.device),
            block_tables=to_device(
                self.slots.batch_block_tables(slot_indices, seq_lens, self.block_size), self.device
            ),
            logits_indices=to_device(logits_indices, self.device),
            sampled_req_indices=to_device(sampled_rows.astype(np.int64), self.device),
        )
        return batch, arrays

    def _prompt_logprob_rows(
        self, arrays: _StepArrays, start: np.ndarray, query_start_loc: np.ndarray
    ) -> _PromptLogprobRows | None:
        """The logits rows this step's prompt-logprob requests need (None if none); O(their scheduled tokens).

        A request computing positions [first, end) needs the logits of those below `num_prompt_tokens - 1` (the
        last prompt position predicts the first output, a sampled row). It leaves `prompt_logprob_reqs` once
        `end` reaches that position. E.g., a 10-token prompt in chunks of 4: positions 0-3 give prompt tokens 1-4,
        4-7 give 5-8, and the last chunk's position 8 gives token 9 (position 9 samples).
        """
        rows = _PromptLogprobRows([], [], [], [], np.empty(0, np.int64), np.empty(0, np.int64))
        flat_parts: list[np.ndarray] = []
        target_parts: list[np.ndarray] = []
        for req_id, num_logprobs in list(self.prompt_logprob_reqs.items()):
            row = arrays.req_id_to_index.get(req_id)
            if row is None:
                continue  # not scheduled this step
            slot = int(arrays.slot_indices[row])
            first = int(start[row])
            end = first + int(arrays.num_scheduled[row])
            last_position = int(self.slots.num_prompt_tokens[slot]) - 1
            if end >= last_position:
                del self.prompt_logprob_reqs[req_id]  # complete after this step
            stop = min(end, last_position)
            if stop <= first:
                continue
            flat_parts.append(np.arange(stop - first) + query_start_loc[row])
            target_parts.append(self.slots.token_ids[slot, first + 1 : stop + 1])
            rows.req_ids.append(req_id)
            rows.num_logprobs.append(num_logprobs)
            rows.start_indices.append(first + 1)
            rows.counts.append(stop - first)
        if not rows.req_ids:
            return None
        rows.flat_indices = np.concatenate(flat_parts)
        rows.target_token_ids = np.concatenate(target_parts)
        return rows

    def _write_drafts(
        self,
        req_ids: list[str],
        slot_indices: np.ndarray,
        spec_decode_tokens: dict[str, list[int]] | None,
    ) -> dict[int, list[int]]:
        """Put each request's drafts in its token buffer right after its known tokens, where this step reads them
        (they stay uncommitted: `num_tokens` does not move until the accepted ones are appended). Returns the
        drafts by batch row.

        The scheduler's ids are used as sent; `DRAFT_PLACEHOLDER` slots (planned while the step that proposed
        them was in flight) take the worker's own drafts, and slots beyond those are padded with token 0: a
        padded draft is verified like any other, and accepting it when sampled is exact too (a point-mass draft
        is accepted with the probability the model gives it, whoever chose it). `num_real[row]` counts the
        non-padded drafts."""
        self._num_real_drafts = {}
        self._draft_probs = {}
        if not spec_decode_tokens:
            return {}
        drafts: dict[int, list[int]] = {}
        for row, req_id in enumerate(req_ids):
            request_drafts = spec_decode_tokens.get(req_id)
            if not request_drafts:
                continue
            index = int(slot_indices[row])
            own = self.slot_drafts[index][: len(request_drafts)]
            if DRAFT_PLACEHOLDER in request_drafts:
                self._num_real_drafts[row] = len(own)
                request_drafts = own + [0] * (len(request_drafts) - len(own))
            draft_probs = self.slot_draft_probs[index]
            params = self.slots.sampling_params[index]
            # A request asking for logprobs verifies its drafts as point masses (exact too, if accepted less
            # often): each token it emits is then a verification row's sample, whose logprobs that row holds.
            wants_logprobs = params is not None and params.logprobs is not None
            if draft_probs is not None and not wants_logprobs and request_drafts[: len(own)] == own:
                self._draft_probs[row] = _pad_point_masses(
                    draft_probs[: len(own)], request_drafts[len(own) :]
                )
            start = int(self.slots.num_tokens[index])
            self.slots.token_ids[index, start : start + len(request_drafts)] = request_drafts
            drafts[row] = request_drafts
        return drafts

    def _check_scheduled(
        self,
        req_ids: list[str],
        slot_indices: np.ndarray,
        seq_lens: np.ndarray,
        drafts: dict[int, list[int]],
    ) -> None:
        """Refuse to read tokens the worker does not have (its known tokens and this step's drafts) or KV slots
        outside the request's blocks."""
        readable = self.slots.num_tokens[slot_indices].copy()
        for row, request_drafts in drafts.items():
            readable[row] += len(request_drafts)
        over_tokens = np.flatnonzero(seq_lens > readable)
        assert over_tokens.size == 0, (
            f"scheduled past the worker's known tokens: {[req_ids[i] for i in over_tokens]}"
        )
        over_blocks = np.flatnonzero(
            cdiv(seq_lens, self.block_size) > self.slots.num_blocks[slot_indices]
        )
        assert over_blocks.size == 0, (
            f"scheduled tokens without KV blocks: {[req_ids[i] for i in over_blocks]}"
        )

    # ------------------------------------------------------------------------------------------ e. sample
    def _sample(
        self,
        model_output: torch.Tensor,
        batch: BatchInputs,
        arrays: _StepArrays,
        grammar_output: GrammarOutput | None = None,
    ) -> SamplerOutput:
        """Token ids from a self-sampling model pass through; logits go through the batched `Sampler`, after the
        grammar bitmask (if any) masked its requests' rows."""
        num_sampled = batch.num_sampled
        if self.model.samples_own_tokens:
            assert model_output.shape[0] == num_sampled, "one sampled token per sampled row"
            return SamplerOutput(sampled_token_ids=model_output, logprobs=None)
        assert model_output.shape[0] == batch.logits_indices.shape[0], (
            "one row of logits per logits index"
        )
        model_output = model_output[:num_sampled]  # prompt-logprob rows, if any, follow
        if grammar_output is not None and grammar_output.structured_output_request_ids:
            model_output = _apply_grammar_bitmask(
                model_output, batch.req_ids, arrays, grammar_output
            )
        slot_indices = arrays.slot_indices[arrays.sampled_rows]
        try:
            return self._sample_rows(model_output, slot_indices, arrays.sample_offsets)
        except Exception as error:
            return self._sample_isolating_faults(
                model_output, slot_indices, batch.req_ids, arrays, error
            )

    def _sample_rows(
        self, logits: torch.Tensor, slot_indices: np.ndarray, offsets: np.ndarray | None = None
    ) -> SamplerOutput:
        """Sample one token per row of `logits`, row i for the request in slot `slot_indices[i]`, in the context of
        its known tokens and its first `offsets[i]` drafts (penalties, min_tokens and per-position seeds see the
        drafts before the row as tokens, so row j samples exactly what decoding without drafts would sample
        there had the drafts before it been sampled)."""
        params = [self.slots.sampling_params[index] for index in slot_indices.tolist()]
        assert all(p is not None for p in params), "a sampling request has no SamplingParams"
        num_tokens = self.slots.num_tokens[slot_indices]
        if offsets is not None:
            num_tokens = num_tokens + offsets
        metadata = build_sampling_metadata(
            params,  # type: ignore[arg-type]
            token_ids=self.slots.token_ids,
            slot_indices=slot_indices,
            num_prompt_tokens=self.slots.num_prompt_tokens[slot_indices],
            num_tokens=num_tokens,
            vocab_size=int(logits.shape[1]),
            eos_token_id=self.eos_token_id,
            device=logits.device,
        )
        return self.sampler(logits, metadata)

    def _sample_isolating_faults(
        self,
        logits: torch.Tensor,
        slot_indices: np.ndarray,
        batch_req_ids: list[str],
        arrays: _StepArrays,
        error: Exception,
    ) -> SamplerOutput:
        """The batch failed to sample: find the rows that fail on their own, record their requests in
        `arrays.failed` (the scheduler ends them with finish_reason "error") and sample the others as a batch.
        A failed row gets token 0 so that every slot advances as scheduled (its request is finished before its
        next token is read). Re-raises `error` when no row fails alone: the fault is not a request's."""
        req_ids = [batch_req_ids[row] for row in arrays.sampled_rows.tolist()]
        good_rows: list[int] = []
        for row in range(len(req_ids)):
            offsets = (
                None if arrays.sample_offsets is None else arrays.sample_offsets[row : row + 1]
            )
            try:
                self._sample_rows(logits[row : row + 1], slot_indices[row : row + 1], offsets)
            except Exception as row_error:
                arrays.failed[req_ids[row]] = f"{type(row_error).__name__}: {row_error}"
            else:
                good_rows.append(row)
        if not arrays.failed:
            raise error
        token_ids = torch.zeros(len(req_ids), dtype=torch.int64, device=logits.device)
        logprobs = None
        if good_rows:
            rows = torch.tensor(good_rows, dtype=torch.int64, device=logits.device)
            sampled = self._sample_rows(
                logits[rows],
                slot_indices[good_rows],
                None if arrays.sample_offsets is None else arrays.sample_offsets[good_rows],
            )
            token_ids[rows] = sampled.sampled_token_ids
            logprobs = _spread_rows(sampled.logprobs, good_rows, len(req_ids))
        return SamplerOutput(token_ids, logprobs)

    # ------------------------------------------------------------------------------------------ f. update
    def _update_states(
        self, batch: BatchInputs, arrays: _StepArrays, sampler_output: SamplerOutput
    ) -> ModelRunnerOutput:
        """Advance progress, append each sampled token to its request's buffer, and report the samples.

        Logprob rows are re-indexed from sampled rows to batch rows (partial prefills get empty rows)."""
        sampled_np = sampler_output.sampled_token_ids.to("cpu").numpy()
        self.slots.num_computed_tokens[arrays.slot_indices] += arrays.num_scheduled
        if arrays.drafts:
            sampled_token_ids = self._accept_drafts(batch, arrays, sampled_np)
        else:
            self._append_sampled(arrays.slot_indices[arrays.sampled_rows], sampled_np)
            sampled_token_ids = [[] for _ in batch.req_ids]
            for row, token_id in zip(
                arrays.sampled_rows.tolist(), sampled_np.tolist(), strict=True
            ):
                sampled_token_ids[row] = [token_id]
        output = ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index=arrays.req_id_to_index,
            sampled_token_ids=sampled_token_ids,
            failed_req_ids=arrays.failed or None,
        )
        if arrays.drafts and sampler_output.logprobs is not None:
            output.logprobs, output.logprobs_row_starts = _rows_per_token(
                sampler_output.logprobs, arrays.sampled_rows.tolist(), sampled_token_ids
            )
        else:
            output.logprobs = _spread_rows(
                sampler_output.logprobs, arrays.sampled_rows.tolist(), batch.num_reqs
            )
        if self.spec_proposer is not None:
            output.spec_token_ids = self._propose_drafts(arrays, sampled_token_ids)
            if self._num_real_drafts:
                output.num_real_drafts = [
                    self._num_real_drafts.get(row, len(arrays.drafts.get(row, ())))
                    for row in range(batch.num_reqs)
                ]
        return output

    def _accept_drafts(
        self, batch: BatchInputs, arrays: _StepArrays, sampled_np: np.ndarray
    ) -> list[list[int]]:
        """Each request's accepted drafts and the token after them (`accept_point_mass_drafts`: row j was sampled
        with drafts 0..j-1 as context, so a draft is accepted when its row sampled it), appended to its buffer
        over the drafts; the rejected drafts' positions leave the computed count. Returns the tokens per batch
        row."""
        sampled_token_ids: list[list[int]] = [[] for _ in batch.req_ids]
        for row, token_id in zip(arrays.sampled_rows.tolist(), sampled_np.tolist(), strict=True):
            sampled_token_ids[row].append(token_id)
        slots = self.slots
        for row, request_drafts in arrays.drafts.items():
            accepted = arrays.verified.get(row) or accept_point_mass_drafts(
                sampled_token_ids[row], request_drafts
            )
            sampled_token_ids[row] = accepted
            index = int(arrays.slot_indices[row])
            slots.num_computed_tokens[index] -= len(request_drafts) + 1 - len(accepted)
        for row in set(arrays.sampled_rows.tolist()):
            index = int(arrays.slot_indices[row])
            start = int(slots.num_tokens[index])
            kept = sampled_token_ids[row][
                : max(slots.max_model_len - start, 0)
            ]  # past it: reported, not stored
            slots.token_ids[index, start : start + len(kept)] = kept
            slots.num_tokens[index] = start + len(kept)
        return sampled_token_ids

    def _propose_drafts(
        self, arrays: _StepArrays, sampled_token_ids: list[list[int]]
    ) -> list[list[int]]:
        """Drafts for the next step of each request that sampled, from its buffer; never past `max_model_len`
        (the scheduler cuts them to what max_tokens and a request's grammar allow)."""
        assert self.spec_proposer is not None
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        slots = self.slots
        wanted: dict[int, int] = {}  # slot -> room for drafts
        row_of: dict[int, int] = {}
        switched_off = self._speculation_switched_off(len(sampled_token_ids))
        for row in set(arrays.sampled_rows.tolist()):
            index = int(arrays.slot_indices[row])
            self.slot_drafts[index] = []
            self.slot_draft_probs[index] = None
            if switched_off:
                continue
            params = slots.sampling_params[index]
            if not sampled_token_ids[row] or params is None:
                continue
            room = slots.max_model_len - int(slots.num_tokens[index]) - 1
            if room > 0:
                wanted[index] = room
                row_of[index] = row
        if self._drafts_with_model:
            return self._propose_with_model(arrays, drafts, wanted, row_of)
        for index, room in wanted.items():
            row = row_of[index]
            num_tokens = int(slots.num_tokens[index])
            drafts[row] = self.spec_proposer.propose(slots.token_ids[index, :num_tokens], room)
            self.slot_drafts[index] = drafts[row]
        return drafts

    def _speculation_switched_off(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` requests proposes nothing (`disable_by_batch_size`); logs each switch."""
        limit = self.spec_disable_by_batch_size
        switched_off = limit is not None and batch_size >= limit
        if switched_off != self._spec_switched_off:
            self._spec_switched_off = switched_off
            logger.info(
                "speculative decoding %s: %d requests in the step, disable_by_batch_size=%s",
                "off" if switched_off else "back on",
                batch_size,
                limit,
            )
        return switched_off

    def _propose_with_model(
        self,
        arrays: _StepArrays,
        drafts: list[list[int]],
        wanted: dict[int, int],
        row_of: dict[int, int],
    ) -> list[list[int]]:
        """The draft model computes every position this step's requests computed (so a full block's draft K/V is
        there whenever its target K/V is), then drafts for the requests in `wanted`."""
        slots = self.slots
        num_speculative_tokens = self.spec_proposer.num_speculative_tokens  # type: ignore[union-attr]
        sampled = set(arrays.sampled_rows.tolist())
        failed_rows = {arrays.req_id_to_index[req_id] for req_id in arrays.failed}
        catch_up: dict[int, int] = {}
        for row, index in enumerate(arrays.slot_indices.tolist()):
            if row in failed_rows:
                continue
            known = slots.num_tokens if row in sampled else slots.num_computed_tokens
            writable = int(slots.num_blocks[index]) * self.block_size
            catch_up[index] = min(int(known[index]), writable)
        max_drafts = {
            index: min(room, num_speculative_tokens)
            for index, room in wanted.items()
            if catch_up.get(index) == slots.num_tokens[index]
        }
        proposals = self.spec_proposer.propose_batch(  # type: ignore[union-attr]
            slots, catch_up, max_drafts, self.eos_token_id
        )
        for index, proposal in proposals.items():
            drafts[row_of[index]] = proposal.token_ids
            self.slot_drafts[index] = proposal.token_ids
            self.slot_draft_probs[index] = proposal.draft_probs
        return drafts

    def _verify_sampled_drafts(self, logits: torch.Tensor, arrays: _StepArrays) -> None:
        """Rows whose drafts came with their distributions q (a draft model, sampled requests) are verified by
        `rejection_sample` against the target's distributions p at their d + 1 sampled rows (min(1, p/q), then
        the residual or the bonus token); the result goes to `arrays.verified`. Seeded requests draw their
        uniforms from (seed, output position), others from the sampler's stream."""
        sampled_rows = arrays.sampled_rows
        # A row's d + 1 sampled rows are consecutive, and sampled rows ascend (batch order).
        rows_with_probs = np.fromiter(arrays.draft_probs, np.int64, len(arrays.draft_probs))
        begins = np.searchsorted(sampled_rows, rows_with_probs, side="left")
        ends = np.searchsorted(sampled_rows, rows_with_probs, side="right")
        groups = [
            (row, np.arange(begin, end))
            for row, begin, end in zip(
                rows_with_probs.tolist(), begins.tolist(), ends.tolist(), strict=True
            )
        ]
        flat = np.concatenate([rows for _, rows in groups])
        slot_indices = arrays.slot_indices[sampled_rows[flat]]
        params = [self.slots.sampling_params[index] for index in slot_indices.tolist()]
        offsets = arrays.sample_offsets[flat] if arrays.sample_offsets is not None else 0
        metadata = build_sampling_metadata(
            params,  # type: ignore[arg-type]
            token_ids=self.slots.token_ids,
            slot_indices=slot_indices,
            num_prompt_tokens=self.slots.num_prompt_tokens[slot_indices],
            num_tokens=self.slots.num_tokens[slot_indices] + offsets,
            vocab_size=int(logits.shape[1]),
            eos_token_id=self.eos_token_id,
            device=logits.device,
        )
        index_tensor = torch.as_tensor(flat, dtype=torch.int64, device=logits.device)
        target_probs = self.sampler.probabilities(logits[index_tensor], metadata)
        first = 0
        for row, rows in groups:
            index = int(arrays.slot_indices[row])
            request_drafts = arrays.drafts[row]
            params_row = self.slots.sampling_params[index]
            assert params_row is not None
            generator = None
            if params_row.seed is not None:
                position = int(self.slots.num_tokens[index] - self.slots.num_prompt_tokens[index])
                generator = torch.Generator(device=logits.device)
                generator.manual_seed(mix_seed(params_row.seed ^ _VERIFY_SEED_SALT, position))
            else:
                generator = self.sampler.generator(logits.device)
            draft_probs = arrays.draft_probs[row].to(target_probs.device)
            arrays.verified[row] = rejection_sample(
                target_probs[first : first + len(rows)],
                draft_probs,
                torch.tensor(request_drafts, dtype=torch.int64, device=target_probs.device),
                generator,
            )
            first += len(rows)

    def _append_sampled(self, slot_indices: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one token per slot; a token sampled at max_model_len is reported but not stored (it stops)."""
        positions = self.slots.num_tokens[slot_indices]
        fits = positions < self.slots.max_model_len
        self.slots.token_ids[slot_indices[fits], positions[fits]] = token_ids[fits]
        self.slots.num_tokens[slot_indices[fits]] += 1


def _apply_grammar_bitmask(
    logits: torch.Tensor, req_ids: list[str], arrays: _StepArrays, grammar_output: GrammarOutput
) -> torch.Tensor:
    """Set every token a structured request's grammar forbids to -inf in `logits` (the step's sampled rows, which
    nothing reads after sampling), in place; returns `logits`.

    Only the sampled rows of the grammar's requests change; other rows stay bit-identical. A row whose bitmask
    allows nothing is left as it is: the scheduler then rejects whatever it samples, and ends that request.
    """
    # A request verifying d drafts has d + 1 sampled rows and d + 1 bitmask rows, matched in order.
    sampled_index: dict[str, list[int]] = {}
    for i, row in enumerate(arrays.sampled_rows.tolist()):
        sampled_index.setdefault(req_ids[row], []).append(i)
    logits_rows: list[int] = []
    mask_rows: list[int] = []
    seen: dict[str, int] = {}
    for mask_row, req_id in enumerate(grammar_output.structured_output_request_ids):
        rows = sampled_index.get(req_id)
        if rows is None:  # a partial prefill samples nothing
            continue
        nth = seen.get(req_id, 0)
        seen[req_id] = nth + 1
        logits_rows.append(rows[nth])
        mask_rows.append(mask_row)
    if not logits_rows:
        return logits
    # Bit j of word w allows token 32 * w + j (little-endian words, so the bytes unpack in token order).
    # E.g., a first word 5 (0b101) allows tokens 0 and 2.
    words = np.ascontiguousarray(grammar_output.grammar_bitmask[mask_rows])
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    vocab_size = logits.shape[1]
    if bits.shape[1] < vocab_size:  # logits past the grammar's vocabulary are never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    forbidden = bits[:, :vocab_size] == 0
    forbidden[~words.any(axis=1)] = False  # nothing allowed: leave the row unmasked
    mask = torch.from_numpy(forbidden).to(logits.device)
    if logits_rows == list(range(logits.shape[0])):  # every sampled row is constrained, in order
        return logits.masked_fill_(mask, float("-inf"))
    index = torch.tensor(logits_rows, dtype=torch.int64, device=logits.device)
    return forbid_tokens(logits, (index, mask))


def _rows_per_token(
    logprobs: LogprobsLists, sampled_rows: list[int], sampled_token_ids: list[list[int]]
) -> tuple[LogprobsLists, list[int]]:
    """With drafts, one logprob row per emitted token: batch row r's tokens are the samples of its first
    len(sampled_token_ids[r]) verification rows (point-mass verification emits the sampled tokens), so their
    rows are kept in order. Returns the rows and where each batch row's rows start."""
    positions: list[list[int]] = [[] for _ in sampled_token_ids]
    for position, row in enumerate(sampled_rows):
        positions[row].append(position)
    result = LogprobsLists([], [], [])
    starts: list[int] = []
    for row, tokens in enumerate(sampled_token_ids):
        starts.append(result.num_rows)
        for position in positions[row][: len(tokens)]:
            result.logprob_token_ids.append(logprobs.logprob_token_ids[position])
            result.logprobs.append(logprobs.logprobs[position])
            result.sampled_token_ranks.append(logprobs.sampled_token_ranks[position])
    return result, starts


def _spread_rows(
    logprobs: LogprobsLists | None, rows: list[int], num_rows: int
) -> LogprobsLists | None:
    """Logprob rows given for `rows` (in order) spread over `num_rows` rows, empty ones (rank -1) elsewhere: the
    sampled rows over the batch's rows (partial prefills sample nothing), or a subset of the sampled rows."""
    if logprobs is None:
        return None
    token_ids: list[list[int]] = [[] for _ in range(num_rows)]
    values: list[list[float]] = [[] for _ in range(num_rows)]
    ranks = [-1] * num_rows
    for index, row in enumerate(rows):
        token_ids[row] = logprobs.logprob_token_ids[index]
        values[row] = logprobs.logprobs[index]
        ranks[row] = logprobs.sampled_token_ranks[index]
    return LogprobsLists(token_ids, values, ranks)


def _compute_prompt_logprobs(
    logits: torch.Tensor, rows: _PromptLogprobRows
) -> dict[str, LogprobsLists]:
    """Each prompt-logprob request's rows: the actual prompt token, then its top `prompt_logprobs` tokens.

    `logits` are the raw float32 logits of `rows`, in order; no sampling setting (temperature, penalties) applies.
    """
    targets = torch.from_numpy(rows.target_token_ids).to(logits.device)
    num_top = max(rows.num_logprobs)
    ids: list[list[int]] = []
    values: list[list[float]] = []
    ranks: list[int] = []
    for begin in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK_ROWS):
        end = begin + _PROMPT_LOGPROBS_CHUNK_ROWS
        chunk_ids, chunk_values, chunk_ranks = token_logprobs(
            logits[begin:end], targets[begin:end], num_top
        )
        ids += chunk_ids
        values += chunk_values
        ranks += chunk_ranks
    result: dict[str, LogprobsLists] = {}
    offset = 0
    for req_id, num_logprobs, start_index, count in zip(
        rows.req_ids, rows.num_logprobs, rows.start_indices, rows.counts, strict=True
    ):
        width = 1 + num_logprobs
        result[req_id] = LogprobsLists(
            [row[:width] for row in ids[offset : offset + count]],
            [row[:width] for row in values[offset : offset + count]],
            ranks[offset : offset + count],
            start_index=start_index,
        )
        offset += count
    return result


def _pad_point_masses(draft_probs: torch.Tensor, padding: list[int]) -> torch.Tensor:
    """`draft_probs` [n, V] followed by one point-mass row per padded draft id: a padded draft's "distribution"
    is the point mass on it (its id was fixed, not drawn), which `rejection_sample` verifies exactly."""
    if not padding:
        return draft_probs
    masses = torch.zeros(
        (len(padding), draft_probs.shape[1]), dtype=draft_probs.dtype, device=draft_probs.device
    )
    masses[torch.arange(len(padding)), torch.tensor(padding)] = 1.0
    return torch.cat([draft_probs, masses])
