"""The checker's invariants, on a `World`: transition checks on each `SchedulerOutput` sent and on a pause that
took effect, state checks in every new state, and the clean end of a drain (see the package docstring)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvflow.core.sched.output import DRAFT_PLACEHOLDER
from kvflow.core.sched.scheduler import PauseState
from kvflow.request import RequestStatus
from kvflow.testing.interleavings.model import oracle

if TYPE_CHECKING:
    from kvflow.core.sched.output import SchedulerOutput
    from kvflow.testing.interleavings.world import World


def check_sent(world: World, output: SchedulerOutput) -> None:
    """A batch going out is well formed: budget, counts, protocol fields (no history where the protocol does not
    read it), drafts (`_check_sent_drafts`)."""
    scheduler = world.scheduler
    scheduled = output.num_scheduled_tokens
    assert scheduler.num_slot_holders <= scheduler.max_num_running_reqs, (
        "slot holders over max_num_seqs"
    )
    assert output.total_num_scheduled_tokens == sum(scheduled.values())
    assert output.total_num_scheduled_tokens <= scheduler.max_num_scheduled_tokens, (
        "over the budget"
    )
    assert all(num_tokens > 0 for num_tokens in scheduled.values()), scheduled
    cached = output.scheduled_cached_reqs
    new_ids = [new_req.req_id for new_req in output.scheduled_new_reqs]
    assert sorted(new_ids + cached.req_ids) == sorted(scheduled), "new + cached != scheduled"
    for new_req in output.scheduled_new_reqs:
        if new_req.prefill_token_ids is not None:
            assert scheduler.requests[new_req.req_id].num_preemptions > 0, (
                "prefill for a fresh request"
            )
    if world.config.use_v2_model_runner:
        assert not cached.all_token_ids, "the slot runner never reads all_token_ids"
        assert not cached.resumed_req_ids, "the slot runner gets resumes as new requests"
    else:
        for req_id in cached.all_token_ids:
            assert (
                req_id in cached.resumed_req_ids or req_id not in world.worker.last_scheduled_ids
            ), f"redundant all_token_ids for {req_id!r}: the worker ran it in the previous step"
    for index, req_id in enumerate(cached.req_ids):
        if cached.new_token_ids[index]:
            assert world.tracker.tracks[req_id].is_session, (
                "only a session's chunk travels as new tokens"
            )
    for req_id, drafts in output.scheduled_spec_decode_tokens.items():
        _check_sent_drafts(world, req_id, drafts, scheduled.get(req_id, 0))


def _check_sent_drafts(world: World, req_id: str, drafts: list[int], num_scheduled: int) -> None:
    """A step verifying drafts: at most k of them, all ids or (async) all placeholders, inside the step's
    tokens, and the most it can yield within `max_tokens` and `max_model_len` (async: the request's
    placeholders, this step's included, bound what its steps in flight can yield)."""
    config = world.config
    assert 0 < len(drafts) <= config.num_speculative_tokens, f"{req_id!r}: drafts {drafts}"
    assert len(drafts) < num_scheduled, (
        f"{req_id!r}: {len(drafts)} drafts in {num_scheduled} tokens"
    )
    num_placeholders = drafts.count(DRAFT_PLACEHOLDER)
    assert num_placeholders in (0, len(drafts)), f"{req_id!r}: drafts {drafts} mix ids and slots"
    assert config.async_scheduling or not num_placeholders, "draft slots in sync scheduling"
    request = world.scheduler.requests[req_id]
    most_yield = request.num_output_placeholders if config.async_scheduling else 1 + len(drafts)
    assert request.num_output_tokens + most_yield <= request.max_tokens, (
        f"{req_id!r}: a step with {len(drafts)} drafts may pass max_tokens"
    )
    assert request.num_tokens + most_yield <= config.max_model_len, (
        f"{req_id!r}: a step with {len(drafts)} drafts may pass max_model_len"
    )


# ---------------------------------------------------------------------------------------------------- state checks
def check_state(world: World) -> None:
    """The invariants of a state (see the package docstring)."""
    _check_queues(world)
    _check_slots(world)
    _check_blocks(world)
    _check_in_flight_accounting(world)
    _check_pause_state(world)


def _check_queues(world: World) -> None:
    scheduler, tracker = world.scheduler, world.tracker
    running = [request.request_id for request in scheduler.running]
    waiting = [request.request_id for request in scheduler.waiting]
    idle = [
        request_id
        for request_id, request in scheduler.requests.items()
        if request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    ]
    assert sorted(running + waiting + idle) == sorted(scheduler.requests), (
        f"queues {running} + {waiting} + idle {idle} do not partition {sorted(scheduler.requests)}"
    )
    assert all(
        scheduler.requests[request_id].status == RequestStatus.RUNNING for request_id in running
    )
    waiting_statuses = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert all(scheduler.requests[request_id].status in waiting_statuses for request_id in waiting)
    assert scheduler.num_waiting_for_streaming_input == len(idle)
    assert set(scheduler.requests) == {track.request_id for track in tracker.live()}, (
        f"scheduler requests {sorted(scheduler.requests)} != live tracks"
    )


def _slot_holders(world: World) -> set[str]:
    """Running requests and the streaming sessions that keep their worker slot."""
    scheduler = world.scheduler
    holders = {request.request_id for request in scheduler.running}
    holders |= {
        request_id for request_id in scheduler.requests if scheduler.sessions.holds_slot(request_id)
    }
    return holders


def _check_slots(world: World) -> None:
    scheduler = world.scheduler
    holders = _slot_holders(world)
    assert len(holders) == scheduler.num_slot_holders <= scheduler.max_num_running_reqs, (
        f"slot holders {sorted(holders)}"
    )
    held = world.worker.held
    pending = scheduler.finished_req_ids | scheduler.reset_preempted_req_ids
    assert holders <= held, f"slot holders {sorted(holders - held)} hold no worker slot"
    assert held - holders <= pending, (
        f"worker slots {sorted(held - holders - pending)} are held by no one and not reported"
    )
    if world.slots is not None:
        assert world.slots.held == held, (
            f"WorkerSlots {sorted(world.slots.held)} != worker {sorted(held)}"
        )


def _check_blocks(world: World) -> None:
    scheduler = world.scheduler
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    holders = _slot_holders(world)
    ref_counts: Counter[int] = Counter()
    for request_id, request_blocks in manager.req_to_blocks.items():
        assert request_id in holders, f"{request_id!r} holds KV blocks without holding a slot"
        ref_counts.update(block.block_id for block in request_blocks.blocks)
        request = scheduler.requests[request_id]
        num_positions = len(request_blocks.blocks) * world.config.block_size
        assert request.num_computed_tokens <= num_positions, (
            f"{request_id!r}: computed past its blocks"
        )
    for block in pool.blocks:
        assert block.ref_cnt == ref_counts[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, held {ref_counts[block.block_id]} times"
        )
    num_in_use = sum(1 for block in pool.blocks if block.ref_cnt)
    assert pool.get_num_free_blocks() + num_in_use == pool.num_blocks, "the free queue lost blocks"
    for request_id, request in scheduler.requests.items():
        if request_id not in manager.req_to_blocks:
            assert request.num_computed_tokens == 0, (
                f"{request_id!r}: computed tokens without blocks"
            )


def _check_in_flight_accounting(world: World) -> None:
    """For every id: steps in flight + step outputs to discard (live) or stale placeholders (finished) equal
    the batches in flight that sample for it; a live request's placeholders are the most its steps in flight
    that are not to be discarded (the newest ones) can yield: 1 + d for a step verifying d drafts."""
    scheduler = world.scheduler
    # Request id -> the drafts verified by each batch in flight that samples for it, oldest first.
    in_flight: dict[str, list[int]] = {}
    for batch in world.core.batch_queue:
        model_runner_output = batch.future.model_runner_output  # type: ignore[attr-defined]
        drafts = batch.scheduler_output.scheduled_spec_decode_tokens
        for req_id, index in model_runner_output.req_id_to_index.items():
            if model_runner_output.sampled_token_ids[index]:
                in_flight.setdefault(req_id, []).append(len(drafts.get(req_id, ())))
    stale = getattr(scheduler, "_stale_placeholders", {})
    for req_id in set(in_flight) | set(scheduler.requests) | set(stale):
        steps = in_flight.get(req_id, [])
        request = scheduler.requests.get(req_id)
        if request is not None:
            num_steps = request.num_in_flight_steps
            assert 0 <= num_steps <= request.num_output_placeholders, request
            assert request.async_tokens_to_discard >= 0, request
            counted = num_steps + request.async_tokens_to_discard
        else:
            counted = stale.get(req_id, 0)
        assert counted == len(steps), (
            f"{req_id!r}: {counted} step outputs counted in flight (steps + discards), "
            f"{len(steps)} batches in flight sample for it"
        )
        if request is not None:
            live_steps = steps[request.async_tokens_to_discard :]
            most_yield = sum(1 + num_drafts for num_drafts in live_steps)
            assert request.num_output_placeholders == most_yield, (
                f"{req_id!r}: {request.num_output_placeholders} placeholders, its steps in flight "
                f"verifying {live_steps} drafts may yield {most_yield} tokens"
            )
            assert request.num_output_tokens + most_yield <= request.max_tokens, (
                f"{req_id!r}: its steps in flight may pass max_tokens"
            )
            assert request.num_tokens + most_yield <= world.config.max_model_len, (
                f"{req_id!r}: its steps in flight may pass max_model_len"
            )


def _check_pause_state(world: World) -> None:
    core = world.core
    expected = PauseState.UNPAUSED if core.pause is None else core.pause.scheduler_state
    assert world.scheduler.pause_state == expected, (
        "the scheduler's pause state disagrees with the core"
    )


def check_pause_took_effect(world: World) -> None:
    """A pause that just took effect with `clear_cache` left nothing running, no block in use, no cached prefix."""
    pause = world.core.pause
    assert pause is not None
    if pause.clear_cache:
        pool = world.scheduler.kv_cache_manager.block_pool
        assert not world.scheduler.running, "clear_cache left running requests"
        assert pool.get_num_free_blocks() == pool.num_blocks, "clear_cache left KV blocks in use"
        assert not pool.cached_block_hash_to_block, "clear_cache left cached prefixes"


def check_clean(world: World) -> None:
    """The end of a drain: nothing left anywhere, every round equal to the oracle (an aborted one a prefix)."""
    core, scheduler = world.core, world.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    assert not core.batch_queue and not scheduler.has_pending_reports()
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked"
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert not getattr(scheduler, "_stale_placeholders", {}), "stale placeholders left"
    assert not world.worker.tokens and not world.worker.parked, "worker state leaked"
    if world.slots is not None:
        assert not world.slots.held, "WorkerSlots still held"
    for track in world.tracker.tracks.values():
        assert track.done, f"{track.request_id} never finished"
        for index, chunk in enumerate(track.chunks):
            expected = oracle(chunk.prompt, chunk.max_tokens)
            if track.aborted and index == len(track.chunks) - 1:
                assert tuple(chunk.tokens) == expected[: len(chunk.tokens)]
            else:
                assert tuple(chunk.tokens) == expected, (
                    f"{track.request_id} round {index}: {chunk.tokens} != {list(expected)}"
                )
