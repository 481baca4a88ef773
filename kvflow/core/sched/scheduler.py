"""The scheduler: one loop per step over running then waiting requests, under a token budget."""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core.hybrid_kv_cache_manager import make_kv_cache_manager
from kvflow.core.kv_cache_manager import KVCacheBlocks
from kvflow.core.kv_cache_utils import RequestBlockHasher
from kvflow.core.sched.drafts import cut_drafts, roll_back_rejected
from kvflow.core.sched.failures import (
    RequestFailedInStep,
    StructuredOutputRejected,
    fail_request,
    rejection_message,
)
from kvflow.core.sched.output import (
    CachedRequestData,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    PooledData,
    SchedulerOutput,
    SchedulerStats,
)
from kvflow.core.sched.pause import PauseState
from kvflow.core.sched.prompt_logprobs import logprobs_rows, receive_prompt_logprobs
from kvflow.core.sched.request_queue import SchedulingPolicy, create_request_queue
from kvflow.core.sched.sessions import StreamingSessions
from kvflow.core.sched.stats import PrefixCacheStats
from kvflow.core.sched.step_output import StepPlan, make_cached_request_data
from kvflow.core.sched.stop import check_stop
from kvflow.request import Request, RequestStatus, StreamingUpdate
from kvflow.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute.

    Invariants (checked by the randomized tests after every step):
      * every request in `requests` is in exactly one of: `running`, `waiting`, or (idle streaming sessions)
        `WAITING_FOR_STREAMING_REQ` outside both queues; finished requests are gone from `requests`.
      * worker slot holders are `running` plus the streaming sessions that keep a slot outside it (see
        `StreamingSessions`); there are never more than `max_num_running_reqs`. A preempted or finished request
        gives its slot back in the very next `SchedulerOutput` (`preempted_req_ids` / `finished_req_ids`), which
        the worker applies before admitting, so at admission time the holders above are exactly what the worker
        holds.
      * each step schedules at most `max_num_scheduled_tokens` tokens, and a step that preempted admits nothing.
      * LoRA: the running requests use at most `max_loras` distinct adapters (so no step runs more adapters than
        the worker has slots). A waiting request whose adapter would be one too many waits; from then on, in that
        step, no later request with an adapter is admitted either (requests of the adapters already running must
        not overtake it, or a busy adapter could keep its slot forever), while base-model requests still are.
      * a pooling request (`Request.pooling_params`) finishes in the step whose output carries its pooled result
        (the step that computed the last of its prompt); it never gets an output token.
      * per-step cost grows with the number of scheduled requests, not with their token histories: full token
        lists are copied only for requests the worker cannot know (new, slot-runner resumes) or, for the
        persistent-batch protocol, requests not scheduled in the previous step.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        num_kv_blocks: int | None = None,
        use_v2_model_runner: bool | None = None,
        compute_common_prefix_blocks: bool = False,
        has_structured_outputs: bool = False,
        num_speculative_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        kv_cache_group_windows: tuple[int | None, ...] = (None,),
        max_loras: int = 0,
    ) -> None:
        num_blocks = num_kv_blocks if num_kv_blocks is not None else cache_config.num_kv_blocks
        if num_blocks is None:
            raise ValueError("the scheduler needs cache_config.num_kv_blocks (or num_kv_blocks=)")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        # Requests with `structured_outputs` are accepted only beside a StructuredOutputManager (the engine core's).
        self.has_structured_outputs = has_structured_outputs
        # Set by the first constrained request: until then no step looks for grammars among its requests.
        self._has_seen_structured_requests = False
        # The runner protocol is the config's unless overridden here (the config defaults to the slot runner).
        self.use_v2_model_runner = (
            scheduler_config.use_v2_model_runner
            if use_v2_model_runner is None
            else use_v2_model_runner
        )
        # Counting `num_common_prefix_blocks` walks a running request's block list every step; only an attention
        # backend that shares a prefix across the batch (cascade attention) needs it, so it is asked for.
        self.compute_common_prefix_blocks = compute_common_prefix_blocks
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.block_size = cache_config.block_size
        self.policy = SchedulingPolicy(scheduler_config.policy)
        # One KV cache group per attention kind of the model's layers (`KVCacheLayout.group_windows`, from the
        # worker): sliding-window groups hold only their window. Their blocks are given back behind the computed
        # count less what may still move back: rejected drafts, and async steps in flight (two at most).
        num_unsettled_tokens = (
            2 * (num_speculative_tokens + 1)
            if scheduler_config.async_scheduling
            else num_speculative_tokens
        )
        self.kv_cache_manager = make_kv_cache_manager(
            num_blocks,
            cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            max_model_len=self.max_model_len,
            group_windows=kv_cache_group_windows,
            num_unsettled_tokens=num_unsettled_tokens,
        )
        self.block_hasher = RequestBlockHasher(cache_config.block_size)

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Reported to the worker in the next SchedulerOutput, then cleared.
        self.finished_req_ids: set[str] = set()
        self.reset_preempted_req_ids: set[str] = set()
        self.prev_step_scheduled_req_ids: set[str] = set()
        self.sessions = StreamingSessions(self.max_model_len, self.waiting, self.kv_cache_manager)
        # Placeholders of finished requests, by id: their tokens still arrive and are dropped, even if the id is
        # reused meanwhile.
        self._stale_placeholders: dict[str, int] = {}
        self._pause_state = PauseState.UNPAUSED
        self.prefix_cache_stats = PrefixCacheStats()
        # Preemptions by recompute since startup (a metric, never reset).
        self.num_preemptions_total = 0
        # Speculative decoding (the runner proposes drafts, `ModelRunnerOutput.spec_token_ids`): verification
        # counts since startup, None without speculation.
        self.num_speculative_tokens = num_speculative_tokens
        # KV slots past each scheduled step's tokens that the worker may write without scheduling them: a draft
        # model writes the K/V of its drafts there while proposing (`speculative_config` method "draft_model").
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_decoding_stats = (
            SpecDecodingStats(num_speculative_tokens) if num_speculative_tokens > 0 else None
        )
        # LoRA: the worker's adapter slots, the most distinct adapters the running requests may use (0: LoRA off;
        # a request with an adapter is then refused by the engine core before it gets here).
        self.max_loras = max_loras

    # ------------------------------------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a new request, or feed the streaming session with the same id: a resumable request adds a chunk,
        a non-resumable one adds the last chunk, and one without tokens just closes the session (`close_session`).
        """
        session = self.requests.get(request.request_id)
        structured_outputs = request.sampling_params.structured_outputs
        if structured_outputs is not None:
            self._check_structured_outputs(request, session)
        if session is not None:
            if session.streaming_queue is None:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            chunk = StreamingUpdate.from_request(request)
            self._update_session(session, chunk, close_after=not request.resumable)
            if chunk is not None:
                _record_queued(session)
            return
        self._validate_prompt_length(request.request_id, len(request.prompt_token_ids))
        request.set_block_hasher(self.block_hasher)
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        _record_queued(request)

    def _check_structured_outputs(self, request: Request, session: Request | None) -> None:
        """A constrained request needs the engine's manager; a session's chunk may only repeat the session's
        constraint (which restarts it) or ask for none."""
        if not self.has_structured_outputs:
            raise ValueError(
                "SamplingParams.structured_outputs needs an engine with a structured outputs manager"
            )
        self._has_seen_structured_requests = True
        if session is None:
            return
        params = request.sampling_params.structured_outputs
        so_request = session.structured_output_request
        if so_request is None or so_request.params.cache_key() != params.cache_key():
            raise ValueError(
                f"request {request.request_id!r}: SamplingParams.structured_outputs of a streaming session's "
                "chunk must be the session's first chunk's (or None for an unconstrained continuation)"
            )

    def close_session(self, request_id: str) -> bool:
        """End streaming session `request_id` once its current chunk stops.

        Returns True when nothing is left in the core: the id is unknown (already finished), or the session was
        idle, so it finishes now (FINISHED_STOPPED, blocks and slot freed, reported in `finished_req_ids`).
        Returns False when a chunk runs or is queued: the close waits behind it, and the output that ends that
        chunk ends the session. Raises ValueError for a request that is not a streaming session.
        """
        session = self.requests.get(request_id)
        if session is None:
            return True
        if session.streaming_queue is None:
            raise ValueError(f"request {request_id!r} is not a streaming session")
        return self._update_session(session, None, close_after=True)

    def _update_session(
        self, session: Request, chunk: StreamingUpdate | None, close_after: bool
    ) -> bool:
        """Pass a session its next chunk and/or close; True when it ended at once (it idled, nothing to run)."""
        ends_now = self.sessions.add_update(session, chunk, close_after)
        if ends_now:
            self.finish_requests(session.request_id, RequestStatus.FINISHED_STOPPED)
        return ends_now

    def _validate_prompt_length(self, request_id: str, num_tokens: int) -> None:
        if num_tokens == 0:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {num_tokens} tokens is longer than "
                f"max_model_len={self.max_model_len}"
            )
        num_blocks_needed = self.kv_cache_manager.min_blocks_for(num_tokens)
        if num_blocks_needed > self.kv_cache_manager.num_usable_blocks:
            raise ValueError(
                f"request {request_id!r}: prompt of {num_tokens} tokens needs {num_blocks_needed} "
                f"KV blocks but the cache has only {self.kv_cache_manager.num_usable_blocks}"
            )

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (abort, session close). Safe for any id in any state; idempotent."""
        assert RequestStatus.is_finished(finished_status), finished_status
        ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        running_to_remove: set[Request] = set()
        waiting_to_remove: list[Request] = []
        to_free: list[Request] = []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            # Idle streaming sessions (WAITING_FOR_STREAMING_REQ) are in neither queue.
            if request.status == RequestStatus.RUNNING:
                running_to_remove.add(request)
            elif request.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
                waiting_to_remove.append(request)
            request.status = finished_status
            to_free.append(request)
        if running_to_remove:
            self.running = [request for request in self.running if request not in running_to_remove]
        if waiting_to_remove:
            self.waiting.remove_requests(waiting_to_remove)
        for request in to_free:
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        request_id = request.request_id
        num_stale_placeholders = request.num_in_flight_steps + request.async_tokens_to_discard
        if num_stale_placeholders:
            self._stale_placeholders[request_id] = (
                self._stale_placeholders.get(request_id, 0) + num_stale_placeholders
            )
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request_id)
        self.reset_preempted_req_ids.discard(request_id)  # reported once, as finished
        self.sessions.forget(request_id)
        del self.requests[request_id]

    def get_num_unfinished_requests(self) -> int:
        """Requests with work to do (idle streaming sessions excluded), including those held while paused."""
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def get_num_started_requests(self) -> int:
        """Requests that ran and have not finished: running or preempted (not counting idle sessions)."""
        started = (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
        return sum(1 for request in self.requests.values() if request.status in started)

    def has_pending_reports(self) -> bool:
        """True when the worker still has to hear about finished or preempted requests."""
        return bool(self.finished_req_ids or self.reset_preempted_req_ids)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's counters now (O(1); O(requests) for the adapter counts with LoRA on)."""
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_query_tokens=self.prefix_cache_stats.num_query_tokens,
            prefix_cache_hit_tokens=self.prefix_cache_stats.num_hit_tokens,
            num_preemptions_total=self.num_preemptions_total,
            spec_decoding_stats=copy.deepcopy(self.spec_decoding_stats),
            running_lora_adapters=_count_adapters(self.running) if self.max_loras else {},
            waiting_lora_adapters=_count_adapters(self.waiting) if self.max_loras else {},
        )

    @property
    def pause_state(self) -> PauseState:
        return self._pause_state

    def set_pause_state(self, pause_state: PauseState) -> None:
        self._pause_state = pause_state

    @property
    def num_slot_holders(self) -> int:
        """Requests holding a worker slot: running ones plus streaming sessions that kept theirs."""
        return len(self.running) + self.sessions.num_slot_holders

    @property
    def num_waiting_for_streaming_input(self) -> int:
        """Streaming sessions parked in WAITING_FOR_STREAMING_REQ, waiting for their next chunk."""
        return self.sessions.num_waiting_for_input

    # ------------------------------------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_scheduled_tokens if self._pause_state != PauseState.PAUSED_ALL else 0
        timestamp = time.monotonic()
        plan = StepPlan(token_budget=budget, timestamp=timestamp)
        self._schedule_running(plan, timestamp)
        if not plan.preempted and self._pause_state != PauseState.PAUSED_ALL:
            self._schedule_waiting(plan, only_started=self._pause_state == PauseState.PAUSED_NEW)
        assert plan.token_budget >= 0
        assert self.num_slot_holders <= self.max_num_running_reqs
        output = self._build_output(plan)
        self._update_after_schedule(output)
        return output

    def _num_new_tokens_for_running(self, request: Request, token_budget: int) -> int:
        """Tokens to compute for a running request this step: what it has (placeholders included) minus what
        is computed, capped by the long-prefill threshold and the budget."""
        # A placeholder's position is computable before its token is back: the worker feeds its own sample.
        # E.g., async: 10 tokens, 1 placeholder, 10 computed -> 1 new token, at the placeholder's position.
        num_new_tokens = (
            request.num_tokens_with_spec
            + request.num_output_placeholders
            - request.num_computed_tokens
        )
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return num_new_tokens if num_new_tokens < token_budget else token_budget

    def _schedule_running(self, plan: StepPlan, timestamp: float) -> None:
        # Runs once per running request per step: methods are looked up once, outside the loop.
        running = self.running  # preemption below deletes from this very list
        num_new_tokens_for_running = self._num_new_tokens_for_running
        allocate_slots = (
            functools.partial(
                self.kv_cache_manager.allocate_slots,
                num_lookahead_tokens=self.num_lookahead_tokens,
            )
            if self.num_lookahead_tokens
            else self.kv_cache_manager.allocate_slots
        )
        append_cached = plan.cached.append
        num_scheduled_tokens = plan.num_scheduled_tokens
        req_to_new_blocks = plan.req_to_new_blocks
        req_index = 0
        while req_index < len(running) and plan.token_budget > 0:
            request = running[req_index]
            num_new_tokens = num_new_tokens_for_running(request, plan.token_budget)
            if num_new_tokens <= 0:
                # Nothing to compute now (e.g. async: every token it may still produce is a placeholder).
                req_index += 1
                continue
            new_blocks = allocate_slots(request, num_new_tokens)
            while new_blocks is None:
                victim = self._pick_preemption_victim()
                victim_index = running.index(victim)
                del running[victim_index]
                # PRIORITY may pick one we already passed; the request we are at then moves up one.
                # E.g., running [a, b, c] at c (req_index 2), victim a: running [b, c], c at req_index 1.
                if victim_index < req_index:
                    req_index -= 1
                if victim.request_id in plan.num_scheduled_tokens:
                    plan.undo(victim)
                self._preempt_request(victim, timestamp)
                plan.preempted.append(victim)
                if victim is request:
                    break
                new_blocks = allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                break
            append_cached(request)
            if request.spec_token_ids:
                # Drafts sit past the known tokens (and placeholders): those that fit this step's share are
                # verified by it. E.g., 10 tokens, 9 computed, drafts [a, b, c], 3 new tokens: the last token, a, b.
                num_drafts = (
                    request.num_computed_tokens
                    + num_new_tokens
                    - request.num_tokens
                    - request.num_output_placeholders
                )
                if num_drafts > 0:
                    plan.spec_decode_tokens[request.request_id] = request.spec_token_ids[
                        :num_drafts
                    ]
            # plan.add(request, num_new_tokens, new_blocks), inlined: this loop runs per request per step.
            num_scheduled_tokens[request.request_id] = num_new_tokens
            req_to_new_blocks[request.request_id] = new_blocks
            plan.token_budget -= num_new_tokens
            req_index += 1

    def _pick_preemption_victim(self) -> Request:
        """FCFS: the most recently admitted request. PRIORITY: the worst (priority, arrival_time)."""
        if self.policy == SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda request: (request.priority, request.arrival_time))
        return self.running[-1]

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        """Free a running request's blocks and put it back at the head of the waiting queue (recompute later).

        The caller removes it from `running` first.
        """
        assert request.status == RequestStatus.RUNNING, (
            f"only running requests can be preempted: {request}"
        )
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        request.events.append(EngineCoreEvent(EngineCoreEventType.PREEMPTED, timestamp))
        self.waiting.prepend_request(request)

    def _schedule_waiting(self, plan: StepPlan, only_started: bool = False) -> None:
        """Admit from the head of `waiting` until something does not fit.

        With `only_started` (PAUSED_NEW) only requests that already ran (preempted ones, slot-holding sessions)
        are admitted, so that "let running requests finish" terminates even when some were preempted.

        Once the head is blocked (no slot, no KV blocks or no budget), only streaming sessions that still hold
        their slot and blocks may pass it: they need no new slot, and they may hold the very blocks the head waits
        for, so stopping at the head could deadlock. Other requests keep their queue order.
        """
        skipped = create_request_queue(self.policy)
        head_blocked = False
        # LoRA: the adapters of the running requests (gathered at the first adapter request: steps without one never
        # walk `running` for them), and whether a request already waits for an adapter slot.
        running_loras: set[int] | None = None
        lora_blocked = False
        while self.waiting and plan.token_budget > 0:
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                # Its grammar is still compiling: pass over it, in order, without blocking the others.
                skipped.add_request(self.waiting.pop_request())
                continue
            lora_request = request.lora_request
            if lora_request is not None:
                if running_loras is None:
                    running_loras = self._running_lora_ids()
                if lora_blocked or (
                    lora_request.lora_int_id not in running_loras
                    and len(running_loras) >= self.max_loras
                ):
                    # No adapter slot: it waits, in order, and so does every later adapter request (fairness).
                    lora_blocked = True
                    skipped.add_request(self.waiting.pop_request())
                    continue
            holds_slot = self.sessions.holds_slot(request.request_id)
            if only_started and not holds_slot and request.status != RequestStatus.PREEMPTED:
                # PAUSED_NEW: a request that never ran is held, in order, until resume.
                skipped.add_request(self.waiting.pop_request())
                continue
            if holds_slot or not head_blocked:
                has_slot = holds_slot or self.num_slot_holders < self.max_num_running_reqs
                if has_slot and self._try_admit(request, plan):
                    if running_loras is not None and lora_request is not None:
                        running_loras.add(lora_request.lora_int_id)
                    continue
                head_blocked = True
            if not self.sessions.has_unsent_chunks:
                break  # no slot-holding session waits behind the blocked head: nothing may pass it
            skipped.add_request(self.waiting.pop_request())
        if skipped:
            self.waiting.prepend_requests(skipped)

    def _running_lora_ids(self) -> set[int]:
        """The adapter ids of the running requests (O(running); only with LoRA on)."""
        return {
            request.lora_request.lora_int_id
            for request in self.running
            if request.lora_request is not None
        }

    def _try_admit(self, request: Request, plan: StepPlan) -> bool:
        """Schedule the head of the waiting queue. Returns False when it does not fit (stop admitting)."""
        computed_blocks: KVCacheBlocks | None = None
        num_hit_tokens = 0
        if request.num_computed_tokens == 0 and not request.skip_reading_prefix_cache:
            computed_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        num_computed_tokens = request.num_computed_tokens + num_hit_tokens
        num_new_tokens = request.num_tokens - num_computed_tokens
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > plan.token_budget:
            return False
        num_new_tokens = min(num_new_tokens, plan.token_budget)
        new_blocks = self.kv_cache_manager.allocate_slots(
            request,
            num_new_tokens,
            num_hit_tokens,
            computed_blocks,
            num_lookahead_tokens=self.num_lookahead_tokens,
        )
        if new_blocks is None:
            return False

        self.waiting.pop_request()
        self.running.append(request)
        if self.sessions.resume_in_own_slot(request.request_id):
            plan.cached.append(request)
        elif request.status == RequestStatus.PREEMPTED:
            plan.resumed.append(request)
        else:
            plan.new.append(request)
        if computed_blocks is not None and request.num_preemptions == 0:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens  # the first admission's hit
        if not request.scheduled_since_queued:
            request.scheduled_since_queued = True
            request.events.append(EngineCoreEvent(EngineCoreEventType.SCHEDULED, plan.timestamp))
        plan.add(request, num_new_tokens, new_blocks)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        return True

    # ------------------------------------------------------------------------------------------------ output
    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs_data = [
            NewRequestData.from_request(request, kv.get_block_ids(request.request_id))
            for request in plan.new
        ]
        cached_resumed = plan.resumed
        if self.use_v2_model_runner:
            # The slot runner dropped a preempted request's state: it comes back as a new request.
            new_reqs_data += [
                NewRequestData.from_request(
                    request,
                    kv.get_block_ids(request.request_id),
                    prefill_token_ids=request.all_token_ids.copy(),
                )
                for request in plan.resumed
            ]
            cached_resumed = []
        cached_reqs_data = self._make_cached_request_data(
            plan.cached,
            cached_resumed,
            plan.num_scheduled_tokens,
            plan.spec_decode_tokens,
            plan.req_to_new_blocks,
        )
        preempted_req_ids = {
            request.request_id for request in plan.preempted
        } | self.reset_preempted_req_ids
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=plan.spec_decode_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_req_ids,
        )
        if self._has_seen_structured_requests:
            output.has_structured_output_requests = any(
                request.structured_output_request is not None
                and request.structured_output_request.grammar is not None
                for request in itertools.chain(plan.cached, plan.new, plan.resumed)
            )
        if self.compute_common_prefix_blocks:
            output.num_common_prefix_blocks = self._num_common_prefix_blocks()
        return output

    def _num_common_prefix_blocks(self) -> list[int]:
        """Leading blocks shared by every running request, per KV cache group ([0] with nothing running)."""
        if not self.running:
            return [0]
        return self.kv_cache_manager.get_num_common_prefix_blocks(
            self.running[0].request_id, len(self.running)
        )

    def _make_cached_request_data(
        self,
        running_reqs: list[Request],
        resumed_reqs: list[Request],
        num_scheduled_tokens: dict[str, int],
        spec_decode_tokens: dict[str, list[int]],
        req_to_new_blocks: dict[str, KVCacheBlocks],
    ) -> CachedRequestData:
        """Per-request deltas for requests the worker holds; resumed ones only in the persistent-batch protocol
        (see `make_cached_request_data`)."""
        return make_cached_request_data(
            running_reqs,
            resumed_reqs,
            req_to_new_blocks,
            kv_cache_manager=self.kv_cache_manager,
            sessions=self.sessions,
            send_all_tokens=not self.use_v2_model_runner,
            prev_step_scheduled_req_ids=self.prev_step_scheduled_req_ids,
        )

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        """Advance computed counts right away, so the next step can be planned before this one's output."""
        requests = self.requests
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            requests[request_id].num_computed_tokens += num_tokens
        self.prev_step_scheduled_req_ids = set(output.num_scheduled_tokens)
        # New set objects: the output keeps the old ones.
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    # ------------------------------------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, run stop checks, finish or park stopped requests; return per-request outputs."""
        outputs: list[EngineCoreOutput] = []
        stopped_running: set[Request] = set()
        sampled_token_ids = model_runner_output.sampled_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        logprobs = model_runner_output.logprobs
        failed_req_ids = model_runner_output.failed_req_ids
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        proposed_drafts = model_runner_output.spec_token_ids
        if model_runner_output.prompt_logprobs_dict:
            receive_prompt_logprobs(self.requests, model_runner_output.prompt_logprobs_dict)
        # Runs once per scheduled request per step: lookups are hoisted out of the loop.
        requests = self.requests
        stale_placeholders = self._stale_placeholders
        apply_output = self._apply_output
        outcome = model_runner_output
        append_output = outputs.append
        pooler_output = model_runner_output.pooler_output
        for request_id in scheduler_output.num_scheduled_tokens:
            index = req_id_to_index.get(request_id)
            if index is None:
                continue
            if pooler_output is not None and pooler_output[index] is not None:
                pooled = self._finish_pooled(request_id, pooler_output[index], stopped_running)
                if pooled is not None:
                    append_output(pooled)
                continue
            generated = sampled_token_ids[index]
            if not generated or (stale_placeholders and self._drop_stale_placeholder(request_id)):
                continue
            request = requests.get(request_id)
            if request is None or request.is_finished():
                continue  # aborted while the step ran
            status_before = request.status
            num_drafts = 0
            if scheduled_drafts:
                drafts = scheduled_drafts.get(request_id)
                num_drafts = len(drafts) if drafts else 0
            try:
                if failed_req_ids and request_id in failed_req_ids:
                    raise RequestFailedInStep(failed_req_ids[request_id])
                # The runner's list is not copied: it is only read, and a stop cuts a copy (see below).
                new_token_ids, stopped = apply_output(
                    request, generated, num_drafts, index, outcome
                )
                if proposed_drafts is not None and new_token_ids and not stopped:
                    self._take_drafts(request, proposed_drafts[index])
                num_cached_tokens = request.num_cached_tokens
                output = EngineCoreOutput(
                    request_id,
                    new_token_ids,
                    num_cached_tokens=num_cached_tokens if num_cached_tokens > 0 else 0,
                    new_logprobs=None
                    if logprobs is None
                    else logprobs_rows(
                        logprobs,
                        index,
                        len(new_token_ids),
                        model_runner_output.logprobs_row_starts,
                    ),
                )
                if request.events:
                    output.events, request.events = request.events, []
                if request.prompt_logprobs_rows is not None and new_token_ids:
                    output.new_prompt_logprobs, request.prompt_logprobs_rows = (
                        request.prompt_logprobs_rows,
                        None,
                    )
            except Exception as error:  # this request's fault alone: it ends, the engine goes on
                stopped, output = True, self._fail_request(request, error)
            if stopped:
                if output.finish_reason is None:
                    output.finish_reason = request.get_finished_reason()
                    output.stop_reason = request.stop_reason
                output.session_continues = not self._retire_stopped(
                    request, status_before, stopped_running
                )
            append_output(output)
        if stopped_running:
            self.running = [request for request in self.running if request not in stopped_running]
        return outputs

    def _finish_pooled(
        self, request_id: str, pooled: np.ndarray, stopped_running: set[Request]
    ) -> EngineCoreOutput | None:
        """A pooling request whose prompt is computed: it finishes ("stop") with its pooled result as its one output
        (None when it was aborted while the step ran)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished():
            return None
        output = EngineCoreOutput(
            request_id,
            [],
            finish_reason="stop",
            num_cached_tokens=max(request.num_cached_tokens, 0),
            pooling_output=PooledData.from_array(pooled),
        )
        if request.events:
            output.events, request.events = request.events, []
        status_before = request.status
        request.status = RequestStatus.FINISHED_STOPPED
        self._retire_stopped(request, status_before, stopped_running)
        return output

    def _apply_output(
        self,
        request: Request,
        generated: list[int],
        num_drafts: int,
        index: int,
        outcome: ModelRunnerOutput,
    ) -> tuple[list[int], bool]:
        """Apply one step's tokens for `request` (`generated`, the row `index` of `outcome`), which verified
        `num_drafts` drafts: roll back over the rejected ones, then append (`_update_request_with_output`)."""
        if num_drafts:
            roll_back_rejected(
                request, num_drafts, len(generated), index, outcome, self.spec_decoding_stats
            )
        return self._update_request_with_output(request, generated)

    def _take_drafts(self, request: Request, drafts: list[int]) -> None:
        """Record the runner's drafts for `request`'s next step (`_next_drafts` decides what is scheduled)."""
        request.num_last_proposed_drafts = len(drafts)
        request.spec_token_ids = self._next_drafts(request, drafts)

    def _next_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """What `request`'s next step verifies of the runner's `drafts` (see `cut_drafts`)."""
        return cut_drafts(request, drafts, self.max_model_len)

    def _fail_request(self, request: Request, error: Exception) -> EngineCoreOutput:
        """End `request` alone on its own fault (see `fail_request`)."""
        return fail_request(request, error)

    def _drop_stale_placeholder(self, request_id: str) -> bool:
        """True for a stale placeholder: a token of an earlier, finished request with this id, in flight at finish."""
        num_stale_placeholders = self._stale_placeholders.get(request_id)
        if not num_stale_placeholders:
            return False
        if num_stale_placeholders == 1:
            del self._stale_placeholders[request_id]
        else:
            self._stale_placeholders[request_id] = num_stale_placeholders - 1
        return True

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append tokens one by one, stopping at the first that ends the request (later ones are dropped).

        `new_token_ids` is never modified (it is the runner's list): a stop that drops tokens returns a new list.
        A constrained request's structured-output state takes exactly the appended tokens (its reasoning detector
        while the reasoning lasts, then its matcher; see `StructuredOutputManager`).
        """
        max_model_len = self.max_model_len
        so_request = request.structured_output_request
        if so_request is not None and so_request.grammar is None:
            so_request = None  # a streaming chunk without a constraint
        for num_appended, token_id in enumerate(new_token_ids, 1):
            if so_request is not None and not so_request.accept_token(token_id):
                raise StructuredOutputRejected(rejection_message(request, token_id))
            request.append_output_token_id(token_id)
            if so_request is not None and so_request.is_terminated():
                # The constraint is complete (its end accepted): the request stops, as with EOS, also when
                # this was its last allowed token (EOS comes before the length cap in check_stop too).
                request.status = RequestStatus.FINISHED_STOPPED
                return new_token_ids[:num_appended], True
            if check_stop(request, max_model_len):
                # E.g., [5, EOS, 9]: stops at EOS (num_appended 2), so 9 is dropped -> [5, EOS].
                return new_token_ids[:num_appended], True
        return new_token_ids, False

    def _retire_stopped(
        self, request: Request, status_before: RequestStatus, stopped_running: set[Request]
    ) -> bool:
        """Take a request that stopped this step out of its queue (a running one joins `stopped_running`, which the
        caller filters out of `running` once per step) and finish it (`_handle_stopped_request`). True if finished."""
        if status_before == RequestStatus.RUNNING:
            stopped_running.add(request)
        else:  # preempted by a forced reset after this step was planned (rare)
            self.waiting.remove_requests([request])
        return self._handle_stopped_request(request, status_before)

    def _handle_stopped_request(self, request: Request, status_before: RequestStatus) -> bool:
        """Finish a stopped request, or keep a streaming session for its next chunk. True if finished.

        The caller has taken the request out of (or will filter it from) `running` / `waiting`.
        """
        kept_slot = status_before == RequestStatus.RUNNING
        if request.resumable and not self.sessions.park_stopped(request, kept_slot):
            return False
        self._free_request(request)
        return True

    # ------------------------------------------------------------------------------------------------ reset
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Clear the prefix cache. Returns False while blocks are in use, unless `reset_running_requests`:
        then every running request (and every session holding blocks) is preempted first, keeping FIFO order
        in `waiting`, and reported in the next output's `preempted_req_ids`.
        """
        if reset_running_requests:
            timestamp = time.monotonic()
            while self.running:
                request = self.running.pop()
                self._preempt_request(request, timestamp)
                self.reset_preempted_req_ids.add(request.request_id)
            self.reset_preempted_req_ids.update(self.sessions.release_slot_holders())
            self.prev_step_scheduled_req_ids.clear()
        reset_ok = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not reset_ok:
            raise RuntimeError("KV blocks still in use after preempting every running request")
        return reset_ok


def _count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    """Adapter name -> how many of `requests` run with it (requests without one are not counted)."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts


def _record_queued(request: Request) -> None:
    """A request (or a streaming session's chunk) entered the scheduler: it will be reported scheduled once."""
    request.events.append(EngineCoreEvent(EngineCoreEventType.QUEUED, time.monotonic()))
    request.scheduled_since_queued = False
