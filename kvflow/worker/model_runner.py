"""The slot runner: applies each `SchedulerOutput` to the worker's request slots, builds the batch, runs the model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.batch import BatchInputs
from kvflow.core.sched.output import LogprobsLists, ModelRunnerOutput
from kvflow.spec_decode.runner import SpecDecodeRunner, SpecStep, rows_per_token
from kvflow.structured_output.bitmask import apply_grammar_bitmask
from kvflow.utils import cdiv, to_device
from kvflow.worker.prompt_logprobs import (
    PromptLogprobRows,
    compute_prompt_logprobs,
    prompt_logprob_rows,
)
from kvflow.worker.sampler import (
    Sampler,
    SamplerOutput,
    build_sampling_metadata,
    samples_argmax_only,
)
from kvflow.worker.states import RequestSlots

if TYPE_CHECKING:
    from kvflow.core.sched.output import (
        CachedRequestData,
        GrammarOutput,
        NewRequestData,
        SchedulerOutput,
    )
    from kvflow.lora.model_manager import LoRAModelManager
    from kvflow.models.interface import RunnerModel
    from kvflow.spec_decode.proposer import Proposer


@dataclass
class _StepArrays:
    """Numpy views of one step's batch that the post-forward state update needs."""

    slot_indices: np.ndarray  # [num_reqs] slot of each batch row
    num_scheduled: np.ndarray  # [num_reqs]
    sampled_rows: np.ndarray  # [num_sampled] each sampled row's batch row (repeated for drafts)
    req_id_to_index: dict[str, int]  # batch row of each request
    prompt_rows: PromptLogprobRows | None = None
    # Requests whose sampling failed on their own this step -> why (see `ModelRunnerOutput.failed_req_ids`).
    failed: dict[str, str] = field(default_factory=dict)


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
        beyond the sampled ones, so requests without prompt logprobs cost nothing extra;
      * every draft lives in `spec_decode` (a `SpecDecodeRunner`, None without speculative decoding): the runner
        hands it each step's scheduled drafts before the forward pass (`write`, giving the step's `SpecStep`) and
        the step's logits and samples after it (`verify`, `accept`, `propose`), and keeps no draft state itself.
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
        spec_proposer: Proposer | None = None,
        spec_disable_by_batch_size: int | None = None,
        lora_manager: LoRAModelManager | None = None,
    ) -> None:
        self.model = model
        # LoRA (None: off): puts each step's adapters in the model's adapter slots and maps tokens to them.
        self.lora_manager = lora_manager
        self.eos_token_id = eos_token_id
        self.sampler = Sampler(seed)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        # KV cache groups (a model without sliding-window layers, or with only one kind, has one): each group has
        # its own block table per request (`KVCacheLayout`).
        layout = getattr(model, "kv_cache_layout", None)
        self.num_kv_groups = 1 if layout is None else layout.num_groups
        self.slots = RequestSlots(
            max_num_reqs,
            max_model_len,
            int(cdiv(max_model_len, block_size)),
            num_kv_groups=self.num_kv_groups,
        )
        self.kv_cache = model.make_kv_cache(num_blocks, block_size).to(self.device)
        # Speculative decoding (None: off): writes, verifies and proposes each step's drafts.
        self.spec_decode: SpecDecodeRunner | None = None
        if spec_proposer is not None:
            self.spec_decode = SpecDecodeRunner(
                spec_proposer,
                self.slots,
                block_size=block_size,
                num_blocks=num_blocks,
                eos_token_id=eos_token_id,
                disable_by_batch_size=spec_disable_by_batch_size,
            )
        # Held requests still computing prompt logprobs -> their SamplingParams.prompt_logprobs.
        self.prompt_logprob_reqs: dict[str, int] = {}
        # A forward pass whose sampling waits for `sample_tokens` (structured outputs): logits, batch, arrays, drafts.
        self._deferred_step: (
            tuple[torch.Tensor, BatchInputs, _StepArrays, SpecStep | None] | None
        ) = None

    # ------------------------------------------------------------------------------------------ step
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply one step's plan (release, add, update), run the scheduled tokens and return what was sampled.

        A step with structured-output requests stops after the forward pass and returns None: `sample_tokens`,
        the next call, samples it under the step's grammar bitmask (computed meanwhile by the engine)."""
        assert self._deferred_step is None, "a step's sampling is still waiting for its grammar"
        self._apply_plan(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput.make_empty()
        batch, arrays, spec = self._prepare_inputs(
            scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens
        )
        # One inference-mode scope for the forward pass and the sampling (entering one costs as much as a small
        # step's input preparation); the state update after it runs outside, as it always did.
        with torch.inference_mode():
            model_output = self.model.forward(batch, self.kv_cache)
            if scheduler_output.has_structured_output_requests:
                self._deferred_step = (model_output, batch, arrays, spec)
                return None
            samples = self._sample_step(model_output, batch, arrays, spec, None)
        return self._finish_step(batch, arrays, spec, samples)

    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        """Sample the step whose forward pass `execute_model` deferred, masking its structured requests' rows."""
        assert self._deferred_step is not None, "sample_tokens without a deferred forward pass"
        model_output, batch, arrays, spec = self._deferred_step
        self._deferred_step = None
        with torch.inference_mode():
            samples = self._sample_step(model_output, batch, arrays, spec, grammar_output)
        return self._finish_step(batch, arrays, spec, samples)

    def _sample_step(
        self,
        model_output: torch.Tensor,
        batch: BatchInputs,
        arrays: _StepArrays,
        spec: SpecStep | None,
        grammar_output: GrammarOutput | None,
    ) -> tuple[SamplerOutput, dict[int, list[int]], dict[str, LogprobsLists] | None]:
        """The step's samples, verified drafts and prompt logprobs (called in inference mode)."""
        offsets = None if spec is None else spec.sample_offsets
        sampled = self._sample(model_output, batch, arrays, offsets, grammar_output)
        verified: dict[int, list[int]] = {}
        if spec is not None and self.spec_decode is not None:
            verified = self.spec_decode.verify(model_output, spec, self.sampler)
        prompt_logprobs = None
        if arrays.prompt_rows is not None:
            prompt_logits = model_output[batch.num_sampled :]
            prompt_logprobs = compute_prompt_logprobs(prompt_logits, arrays.prompt_rows)
        return sampled, verified, prompt_logprobs

    def _finish_step(
        self,
        batch: BatchInputs,
        arrays: _StepArrays,
        spec: SpecStep | None,
        samples: tuple[SamplerOutput, dict[int, list[int]], dict[str, LogprobsLists] | None],
    ) -> ModelRunnerOutput:
        sampled, verified, prompt_logprobs = samples
        output = self._update_states(batch, arrays, sampled, spec, verified)
        output.prompt_logprobs_dict = prompt_logprobs
        return output

    def _apply_plan(self, scheduler_output: SchedulerOutput) -> None:
        """The step's request changes, in the protocol's order: release, add, update."""
        self._release(scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids)
        self._add_new_requests(scheduler_output.scheduled_new_reqs)
        self._update_cached_requests(scheduler_output.scheduled_cached_reqs)

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
                other_group_block_ids=new_req.block_ids[1:],
                lora_request=new_req.lora_request,
            )
            self._track_prompt_logprobs(new_req.req_id, index)
            if self.spec_decode is not None:
                self.spec_decode.forget_slot(index)

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
        speculating = self.spec_decode is not None
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

    def _apply_cached_blocks(self, cached: CachedRequestData, i: int) -> int:
        """Extend cached request `i`'s block tables (one per KV cache group) with its new blocks; returns its slot
        index."""
        index = self._index_of(cached.req_ids[i])
        new_block_ids = cached.new_block_ids[i]
        if new_block_ids is not None:
            self.slots.append_block_ids(index, new_block_ids[0])
            for group_id in range(1, self.num_kv_groups):
                self.slots.append_block_ids(index, new_block_ids[group_id], group_id)
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
    ) -> tuple[BatchInputs, _StepArrays, SpecStep | None]:
        """Build the batch tensors with vectorised gathers over the slot arrays (O(scheduled tokens)), after
        writing the step's drafts (if any) into the token buffers.

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

        # Where each request's tokens start in the flat batch; the last entry is the batch's token count.
        # E.g., [2, 5, 3] -> [0, 2, 7, 10]
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        # A request samples once its scheduled tokens reach its last known token (partial prefills do not), from
        # the logits of its last scheduled token, the flat index just before the next request's start.
        # E.g., sampled_rows [0, 2] -> logits_indices [2 - 1, 10 - 1] = [1, 9]
        samples = (num_scheduled > 0) & (seq_lens >= self.slots.num_tokens[slot_indices])
        sampled_rows = np.flatnonzero(samples)
        logits_indices = query_start_loc[sampled_rows + 1] - 1
        spec = None
        if spec_decode_tokens:
            # With drafts a request samples one row per draft more (see `SpecStep`).
            assert self.spec_decode is not None, "drafts scheduled to a runner without a proposer"
            spec = self.spec_decode.write(
                req_ids, slot_indices, spec_decode_tokens, sampled_rows, logits_indices
            )
            if spec is not None:
                sampled_rows, logits_indices = spec.sampled_rows, spec.logits_indices
        self._check_scheduled(req_ids, slot_indices, seq_lens, spec)

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

        other_groups = (
            self._other_group_tables(token_slots, positions, slot_indices, seq_lens)
            if self.num_kv_groups > 1
            else ()
        )
        arrays = _StepArrays(
            slot_indices,
            num_scheduled,
            sampled_rows,
            {req_id: row for row, req_id in enumerate(req_ids)},
        )
        if self.prompt_logprob_reqs:
            arrays.prompt_rows = prompt_logprob_rows(
                self.prompt_logprob_reqs,
                self.slots,
                arrays.req_id_to_index,
                slot_indices,
                start,
                num_scheduled,
                query_start_loc,
            )
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
            other_groups=other_groups,
            lora_token_slots=None
            if self.lora_manager is None
            else self.lora_manager.token_slots(self.slots, slot_indices, token_rows),
        )
        return batch, arrays, spec

    def _other_group_tables(
        self,
        token_slots: np.ndarray,
        positions: np.ndarray,
        slot_indices: np.ndarray,
        seq_lens: np.ndarray,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """`(slot_mapping, block_tables)` of KV cache groups 1, 2, ...: the same gathers as group 0's, through each
        group's own block tables."""
        block_size = self.block_size
        tables = []
        for group_id in range(1, self.num_kv_groups):
            block_ids = self.slots.block_tables[group_id][
                token_slots, positions // block_size
            ].astype(np.int64)
            slot_mapping = block_ids * block_size + positions % block_size
            block_tables = self.slots.batch_block_tables(
                slot_indices, seq_lens, block_size, group_id
            )
            tables.append(
                (to_device(slot_mapping, self.device), to_device(block_tables, self.device))
            )
        return tuple(tables)

    def _check_scheduled(
        self,
        req_ids: list[str],
        slot_indices: np.ndarray,
        seq_lens: np.ndarray,
        spec: SpecStep | None,
    ) -> None:
        """Refuse to read tokens the worker does not have (its known tokens and this step's drafts) or KV slots
        outside the request's blocks."""
        readable = self.slots.num_tokens[slot_indices].copy()
        for row, request_drafts in ({} if spec is None else spec.drafts).items():
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
        offsets: np.ndarray | None = None,
        grammar_output: GrammarOutput | None = None,
    ) -> SamplerOutput:
        """Token ids from a self-sampling model pass through; logits go through the batched `Sampler`, after the
        grammar bitmask (if any) masked its requests' rows. `offsets`: see `_sample_rows` (None: all 0)."""
        num_sampled = batch.num_sampled
        if self.model.samples_own_tokens:
            assert model_output.shape[0] == num_sampled, "one sampled token per sampled row"
            return SamplerOutput(sampled_token_ids=model_output, logprobs=None)
        assert model_output.shape[0] == batch.logits_indices.shape[0], (
            "one row of logits per logits index"
        )
        if model_output.shape[0] != num_sampled:
            model_output = model_output[:num_sampled]  # prompt-logprob rows follow
        if grammar_output is not None and grammar_output.structured_output_request_ids:
            row_req_ids = [batch.req_ids[row] for row in arrays.sampled_rows.tolist()]
            model_output = apply_grammar_bitmask(model_output, row_req_ids, grammar_output)
        slot_indices = arrays.slot_indices[arrays.sampled_rows]
        try:
            return self._sample_rows(model_output, slot_indices, offsets)
        except Exception as error:
            return self._sample_isolating_faults(
                model_output, slot_indices, offsets, batch.req_ids, arrays, error
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
        num_outputs = (num_tokens - self.slots.num_prompt_tokens[slot_indices]).tolist()
        if all(
            samples_argmax_only(p, n)  # type: ignore[arg-type]
            for p, n in zip(params, num_outputs, strict=True)
        ):
            return self.sampler.argmax_only(logits)
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
        offsets: np.ndarray | None,
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
            row_offsets = None if offsets is None else offsets[row : row + 1]
            try:
                self._sample_rows(logits[row : row + 1], slot_indices[row : row + 1], row_offsets)
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
                None if offsets is None else offsets[good_rows],
            )
            token_ids[rows] = sampled.sampled_token_ids
            logprobs = _spread_rows(sampled.logprobs, good_rows, len(req_ids))
        return SamplerOutput(token_ids, logprobs)

    # ------------------------------------------------------------------------------------------ f. update
    def _update_states(
        self,
        batch: BatchInputs,
        arrays: _StepArrays,
        sampler_output: SamplerOutput,
        spec: SpecStep | None = None,
        verified: dict[int, list[int]] | None = None,
    ) -> ModelRunnerOutput:
        """Advance progress, append each sampled token (with drafts: the accepted ones, see `SpecDecodeRunner.
        accept`) to its request's buffer, report the samples and propose the next drafts.

        Logprob rows are re-indexed from sampled rows to batch rows (partial prefills get empty rows)."""
        sampled_token_ids = sampler_output.sampled_token_ids
        if sampled_token_ids.device.type != "cpu":
            sampled_token_ids = sampled_token_ids.cpu()
        sampled_np = sampled_token_ids.numpy()
        self.slots.num_computed_tokens[arrays.slot_indices] += arrays.num_scheduled
        if spec is not None and self.spec_decode is not None:
            sampled_token_ids = self.spec_decode.accept(spec, sampled_np, verified or {})
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
        if spec is not None and sampler_output.logprobs is not None:
            output.logprobs, output.logprobs_row_starts = rows_per_token(
                sampler_output.logprobs, arrays.sampled_rows.tolist(), sampled_token_ids
            )
        else:
            output.logprobs = _spread_rows(
                sampler_output.logprobs, arrays.sampled_rows.tolist(), batch.num_reqs
            )
        if self.spec_decode is not None:
            failed_rows = {arrays.req_id_to_index[req_id] for req_id in arrays.failed}
            output.spec_token_ids = self.spec_decode.propose(
                arrays.slot_indices, arrays.sampled_rows, failed_rows, sampled_token_ids
            )
            if spec is not None:
                output.num_real_drafts = spec.real_draft_counts(batch.num_reqs)
        return output

    def _append_sampled(self, slot_indices: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one token per slot; a token sampled at max_model_len is reported but not stored (it stops)."""
        positions = self.slots.num_tokens[slot_indices]
        fits = positions < self.slots.max_model_len
        self.slots.token_ids[slot_indices[fits], positions[fits]] = token_ids[fits]
        self.slots.num_tokens[slot_indices[fits]] += 1


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
