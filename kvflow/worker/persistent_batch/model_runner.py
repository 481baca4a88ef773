"""The persistent-batch runner: the slot runner plus the worker-side state of preempted requests.

With this protocol (`use_v2_model_runner=False`) the scheduler does not resend a resumed request as a new one: it
sends the request's id in `resumed_req_ids` with replacement block ids and, where the worker's copy may be stale
(requests not scheduled in the previous step), the request's `all_token_ids`. So the worker keeps each preempted
request's tokens until it resumes or finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvflow.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from kvflow.core.sched.output import CachedRequestData
    from kvflow.lora.request import LoRARequest
    from kvflow.models.interface import RunnerModel
    from kvflow.sampling_params import SamplingParams


@dataclass
class ParkedRequest:
    """A preempted request's state, kept outside any slot until it resumes: its known tokens (prompt, outputs and
    the last sampled token), its sampling settings, where its prompt ends, and its adapter (None: base)."""

    token_ids: list[int]
    sampling_params: SamplingParams | None
    num_prompt_tokens: int
    lora_request: LoRARequest | None = None


class PersistentBatchModelRunner(ModelRunner):
    """The runner for the persistent-batch protocol (`use_v2_model_runner=False`).

    Invariants, on top of the slot runner's (where the slot runner frees a preempted request's slot):
      * a preempted request that held a slot sits in `parked` (tokens kept, no slot, no blocks) until it returns in
        `resumed_req_ids` or finishes; no id is both parked and holding a slot;
      * a resumed request gets a replacement block table (a parked one takes a slot again, with nothing computed);
        a parked request scheduled without being resumed is a protocol error;
      * a cached request's `all_token_ids`, when sent, replaces the worker's copy of its tokens (the scheduler's
        copy wins).
    """

    def __init__(self, model: RunnerModel, **runner_options: Any) -> None:
        """`runner_options` are the slot runner's keyword arguments (`max_num_reqs`, `block_size`, ...)."""
        super().__init__(model, **runner_options)
        self.parked: dict[str, ParkedRequest] = {}

    # ------------------------------------------------------------------------------------------ release
    def _forget(self, req_id: str) -> None:
        """Drop the request's slot and any parked state."""
        super()._forget(req_id)
        self.parked.pop(req_id, None)

    def _preempt(self, req_id: str) -> None:
        """Park a preempted request's state and free its slot (an id without a slot has nothing to park)."""
        index = self.slots.req_id_to_index.get(req_id)
        if index is None:
            return
        self.prompt_logprob_reqs.pop(req_id, None)
        self.parked[req_id] = ParkedRequest(
            self.slots.get_token_ids(req_id),
            self.slots.sampling_params[index],
            int(self.slots.num_prompt_tokens[index]),
            self.slots.lora_requests[index],
        )
        self.slots.remove(req_id)

    # ------------------------------------------------------------------------------------------ update
    def _update_cached_requests(self, cached: CachedRequestData) -> None:
        """Resumed ids and full token lists are part of this protocol: apply them with the other updates."""
        self._apply_cached_updates(cached)

    def _apply_cached_blocks(self, cached: CachedRequestData, i: int) -> int:
        """A resumed request's blocks replace its block table; any other request's extend it."""
        req_id = cached.req_ids[i]
        if req_id not in cached.resumed_req_ids:
            assert req_id not in self.parked, (
                f"preempted request {req_id!r} was scheduled without being resumed"
            )
            return super()._apply_cached_blocks(cached, i)
        new_block_ids = cached.new_block_ids[i]
        assert new_block_ids is not None, f"resumed request {req_id!r} came without block ids"
        return self._resume(req_id, new_block_ids)

    def _resume(self, req_id: str, block_ids: Sequence[Sequence[int]]) -> int:
        """Give a parked request a slot again (nothing computed yet), or replace a held one's block tables (one per
        KV cache group)."""
        parked = self.parked.pop(req_id, None)
        if parked is not None:
            index = self.slots.add(
                req_id,
                parked.token_ids,
                block_ids[0],
                0,
                parked.sampling_params,
                num_prompt_tokens=parked.num_prompt_tokens,
                other_group_block_ids=block_ids[1:],
                lora_request=parked.lora_request,
            )
            # Parked before its first output: its prompt (and prompt logprobs) are recomputed.
            self._track_prompt_logprobs(req_id, index)
            # Drafts in the slot were proposed for its last holder.
            if self.spec_decode is not None:
                self.spec_decode.forget_slot(index)
            return index
        index = self._index_of(req_id)
        for group_id, group_block_ids in enumerate(block_ids):
            self.slots.set_block_ids(index, group_block_ids, group_id)
        return index

    def _apply_cached_tokens(self, index: int, cached: CachedRequestData, i: int) -> None:
        """The scheduler's full token list, where sent, replaces the worker's copy; else as the slot runner."""
        req_id = cached.req_ids[i]
        if req_id in cached.all_token_ids:
            self.slots.write_tokens(index, 0, cached.all_token_ids[req_id])
        else:
            super()._apply_cached_tokens(index, cached, i)
