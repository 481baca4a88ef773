"""AsyncScheduler: plans step N+1 before step N's sampled tokens are back."""

from __future__ import annotations

from kvflow.core.sched.drafts import max_drafts
from kvflow.core.sched.output import DRAFT_PLACEHOLDER, ModelRunnerOutput, SchedulerOutput
from kvflow.core.sched.scheduler import Scheduler
from kvflow.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    """A scheduler that plans the next step before the current one's sampled tokens are back.

    A placeholder is a token sampled by a step in flight and not yet appended; a stale step output is one whose
    tokens must be discarded when they arrive.

    Invariants:
      * `num_output_placeholders` = the most tokens the request's steps in flight can yield (1 per step, d + 1 for
        a step verifying d drafts), `num_in_flight_steps` = those steps; neither goes negative, and no step is
        planned once outputs plus placeholders reach `max_tokens` (or `max_model_len`).
      * with speculative decoding, a step planned while an earlier step of the request is in flight cannot know
        its drafts (the worker proposes them after that step): it gets `num_speculative_tokens` draft slots
        (`DRAFT_PLACEHOLDER`s, cut to what max_tokens and max_model_len leave), which the worker fills with its
        own drafts. `num_computed_tokens` counts every draft slot as accepted until the step's output arrives and
        rolls it back over the rejected ones: an upper bound, so blocks are allocated for the most the worker may
        write, and exact once no step is in flight.
      * whenever a request with steps in flight is preempted (in-step or by a forced reset) or stops, those steps
        become stale: their number is added to `async_tokens_to_discard` (accumulated, never overwritten) and the
        next that many step outputs to arrive for the request are dropped whole, whatever their lengths, so no
        token is lost or duplicated.
    """

    def _num_new_tokens_for_running(self, request: Request, token_budget: int) -> int:
        if request.num_output_placeholders > 0 and (
            request.num_output_tokens + request.num_output_placeholders >= request.max_tokens
            or request.num_tokens + request.num_output_placeholders >= self.max_model_len
        ):
            return 0  # every token it may still produce is already a placeholder
        return super()._num_new_tokens_for_running(request, token_budget)

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        super()._update_after_schedule(output)
        scheduled_drafts = output.scheduled_spec_decode_tokens
        for request_id in output.num_scheduled_tokens:
            request = self.requests[request_id]
            # A step samples once it computes the last known position; a partial prefill samples nothing.
            # E.g., a 20-token prompt in chunks of 8: after 8 and 16 computed, no placeholder; after 20, one.
            # Then each decode step computes the previous placeholder's position and adds one more (d + 1 when it
            # verifies d drafts: it may yield them all and one more).
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                drafts = scheduled_drafts.get(request_id) if scheduled_drafts else None
                request.num_output_placeholders += 1 + (len(drafts) if drafts else 0)
                request.num_in_flight_steps += 1
                if self.num_speculative_tokens:
                    request.spec_token_ids = self._draft_slots(request)

    def _draft_slots(self, request: Request) -> list[int]:
        """Draft slots for a step planned while this request has steps in flight: as many as the worker proposed
        after the request's latest applied step (a guess: a request whose text gives the proposer nothing costs
        no wasted positions), within `max_drafts`. Any count is exact: slots the worker cannot fill are padding."""
        if request.structured_output_request is not None:
            # A constrained request's bitmask rows follow its drafts, so it verifies only drafts the scheduler
            # knows: those proposed after its latest step, when no step of it is in flight.
            return []
        wanted = min(self.num_speculative_tokens, request.num_last_proposed_drafts)
        return [DRAFT_PLACEHOLDER] * min(wanted, max_drafts(request, self.max_model_len))

    def _next_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        # The drafts proposed after this output were already used by the request's step in flight, if any.
        if request.num_in_flight_steps > 0:
            return self._draft_slots(request)
        return super()._next_drafts(request, drafts)

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        super()._preempt_request(request, timestamp)
        self._discard_in_flight(request)

    def _discard_in_flight(self, request: Request) -> None:
        request.async_tokens_to_discard += request.num_in_flight_steps
        request.num_in_flight_steps = 0
        request.num_output_placeholders = 0

    def _apply_output(
        self,
        request: Request,
        generated: list[int],
        num_drafts: int,
        index: int,
        outcome: ModelRunnerOutput,
    ) -> tuple[list[int], bool]:
        if request.async_tokens_to_discard > 0:
            # A stale step from before a preemption or stop: its tokens are dropped, however many.
            request.async_tokens_to_discard -= 1
            return [], False
        status_before = request.status
        request.num_output_placeholders -= 1 + num_drafts
        request.num_in_flight_steps -= 1
        assert request.num_output_placeholders >= 0 and request.num_in_flight_steps >= 0, (
            f"placeholder underflow for {request}"
        )
        new_token_ids, stopped = super()._apply_output(
            request, generated, num_drafts, index, outcome
        )
        if stopped:
            self._discard_in_flight(request)
        elif status_before == RequestStatus.RUNNING:
            # A block filled by a placeholder's position had no hash when it was allocated (its last token was
            # unknown); now that the token is appended, its hash exists and the block can join the prefix cache.
            # Only known tokens are hashed: with drafts in flight the computed count runs ahead of them.
            self.kv_cache_manager.cache_blocks(
                request, min(request.num_computed_tokens, request.num_tokens)
            )
        return new_token_ids, stopped
