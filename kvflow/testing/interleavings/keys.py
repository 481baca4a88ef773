"""Canonical, hashable keys of what decides a state's future: a `SchedulerOutput`, a request, a scheduler.

Timestamps and metrics are left out: two states that differ only there are the same state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvflow.request import Request

if TYPE_CHECKING:
    from kvflow.core.sched.output import SchedulerOutput
    from kvflow.core.sched.scheduler import Scheduler


def output_key(output: SchedulerOutput) -> tuple[Any, ...]:
    """Everything a `SchedulerOutput` tells the worker, as a hashable value."""
    cached = output.scheduled_cached_reqs
    new_reqs = tuple(
        (
            new_req.req_id,
            tuple(new_req.prompt_token_ids),
            tuple(map(tuple, new_req.block_ids)),
            new_req.num_computed_tokens,
            None if new_req.prefill_token_ids is None else tuple(new_req.prefill_token_ids),
            new_req.sampling_params.max_tokens,
        )
        for new_req in output.scheduled_new_reqs
    )
    cached_reqs = (
        tuple(cached.req_ids),
        frozenset(cached.resumed_req_ids),
        tuple(map(tuple, cached.new_token_ids)),
        frozenset((req_id, tuple(ids)) for req_id, ids in cached.all_token_ids.items()),
        tuple(None if ids is None else tuple(map(tuple, ids)) for ids in cached.new_block_ids),
        tuple(cached.num_computed_tokens),
        tuple(cached.num_output_tokens),
    )
    return (
        tuple(output.num_scheduled_tokens.items()),
        new_reqs,
        cached_reqs,
        frozenset(
            (req_id, tuple(ids)) for req_id, ids in output.scheduled_spec_decode_tokens.items()
        ),
        frozenset(output.finished_req_ids),
        frozenset(output.preempted_req_ids),
    )


def request_key(request: Request, scheduler: Scheduler) -> tuple[Any, ...]:
    request_blocks = scheduler.kv_cache_manager.req_to_blocks.get(request.request_id)
    blocks = (
        None
        if request_blocks is None
        else (
            tuple(block.block_id for block in request_blocks.blocks),
            request_blocks.num_cached_blocks,
        )
    )
    queue = request.streaming_queue
    return (
        request.request_id,
        int(request.status),
        tuple(request.prompt_token_ids),
        tuple(request.output_token_ids),
        request.num_computed_tokens,
        request.num_output_placeholders,
        request.num_in_flight_steps,
        request.async_tokens_to_discard,
        request.num_preemptions > 0,
        request.sampling_params.max_tokens,
        request.resumable,
        None
        if queue is None
        else tuple(
            None
            if update is None
            else (tuple(update.prompt_token_ids), update.sampling_params.max_tokens)
            for update in queue
        ),
        tuple(request.spec_token_ids),
        request.num_last_proposed_drafts,  # async draft slots follow the worker's latest proposals
        len(request.block_hashes),
        blocks,
    )


def scheduler_key(scheduler: Scheduler) -> tuple[Any, ...]:
    pool = scheduler.kv_cache_manager.block_pool
    sessions = scheduler.sessions
    return (
        tuple(request_key(request, scheduler) for _, request in sorted(scheduler.requests.items())),
        tuple(request.request_id for request in scheduler.running),
        tuple(request.request_id for request in scheduler.waiting),
        frozenset(scheduler.finished_req_ids),
        frozenset(scheduler.reset_preempted_req_ids),
        frozenset(scheduler.prev_step_scheduled_req_ids),
        frozenset(getattr(scheduler, "_stale_placeholders", {}).items()),
        frozenset(sessions._idle_ids),
        frozenset(sessions._slot_holders),
        frozenset(sessions._unsent_chunk_ids),
        scheduler.pause_state.value,
        tuple((block.ref_cnt, block.block_hash) for block in pool.blocks),
        tuple(block.block_id for block in pool.free_block_queue.get_all_free_blocks()),
    )
