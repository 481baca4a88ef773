"""AsyncScheduler: plans step N+1 before step N's sampled tokens are back."""

from __future__ import annotations

from kvflow.core.sched.output import SchedulerOutput
from kvflow.core.sched.scheduler import Scheduler
from kvflow.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    """A scheduler that plans the next step before the current one's sampled tokens are back.

    A placeholder is a token sampled by a step in flight and not yet appended; a stale placeholder is one whose
    token must be discarded when it arrives.

    Invariants:
      * `num_output_placeholders` = steps planned to sample a token for the request whose output has not
        arrived; it never goes negative, and no step is planned once outputs plus placeholders reach `max_tokens`.
      * whenever a request with placeholders is preempted (in-step or by a forced reset) or stops, they become
        stale: they are added to `async_tokens_to_discard` (accumulated, never overwritten) and the next that
        many tokens to arrive for the request are dropped, so no token is lost or duplicated.
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
        for request_id in output.num_scheduled_tokens:
            request = self.requests[request_id]
            # A step samples once it computes the last known position; a partial prefill samples nothing.
            # E.g., a 20-token prompt in chunks of 8: after 8 and 16 computed, no placeholder; after 20, one.
            # Then each decode step computes the previous placeholder's position and adds one more.
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples a token we will see later

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        super()._preempt_request(request, timestamp)
        self._discard_in_flight(request)

    def _discard_in_flight(self, request: Request) -> None:
        request.async_tokens_to_discard += request.num_output_placeholders
        request.num_output_placeholders = 0

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        if request.async_tokens_to_discard > 0:
            # A stale placeholder from before a preemption or stop: its token is dropped.
            request.async_tokens_to_discard -= 1
            return [], False
        status_before = request.status
        request.num_output_placeholders -= 1
        assert request.num_output_placeholders >= 0, f"placeholder underflow for {request}"
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        if stopped:
            self._discard_in_flight(request)
        elif status_before == RequestStatus.RUNNING:
            # A block filled by a placeholder's position had no hash when it was allocated (its last token was
            # unknown); now that the token is appended, its hash exists and the block can join the prefix cache.
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        return new_token_ids, stopped
