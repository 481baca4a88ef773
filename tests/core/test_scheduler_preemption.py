"""Preemption by recompute under KV pressure: victim choice, no admissions, resume correctness, counters."""

from __future__ import annotations

import pytest
from sched_helpers import SimWorker, run_to_completion, step

from kvflow.request import RequestStatus
from kvflow.testing import make_request, make_requests, make_scheduler
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.worker_slots import WorkerSlots


def three_full_requests(policy="fcfs", **kwargs):
    """Three 8-token requests filling 6 of 7 blocks of 4; the next decode step runs out of blocks."""
    scheduler = make_scheduler(block_size=4, num_blocks=7, policy=policy, **kwargs)
    for request in make_requests(3, num_tokens=8, max_tokens=10):
        scheduler.add_request(request)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"0": 8, "1": 8, "2": 8}
    return scheduler


def test_fcfs_preempts_most_recently_admitted():
    scheduler = three_full_requests()
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"2"}
    assert output.num_scheduled_tokens == {"0": 1, "1": 1}
    victim = scheduler.requests["2"]
    assert victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1
    assert scheduler.kv_cache_manager.get_block_ids("2") == ([],)
    assert [request.request_id for request in scheduler.running] == ["0", "1"]
    assert scheduler.waiting.peek_request() is victim


def test_preempted_request_goes_to_head_of_waiting():
    scheduler = three_full_requests()
    scheduler.add_request(make_request("late", [9], max_tokens=1))
    step(scheduler)
    assert [request.request_id for request in scheduler.waiting] == ["2", "late"]


def test_no_admissions_in_a_step_that_preempted():
    scheduler = three_full_requests()
    scheduler.add_request(
        make_request("late", [9], max_tokens=1)
    )  # would fit: 1 block free after preemption
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"2"}
    assert output.scheduled_new_reqs == []
    assert "late" not in output.num_scheduled_tokens
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 1


def low_priority_first_scheduler(policy: str):
    """`low` (priority 5) admitted first, then `hi1`, `hi2` (priority 0); the third step runs out of blocks."""
    scheduler = make_scheduler(block_size=4, num_blocks=7, policy=policy)
    scheduler.add_request(make_request("low", [1] * 8, max_tokens=10, priority=5))
    step(scheduler)
    scheduler.add_request(make_request("hi1", [2] * 8, max_tokens=10))
    scheduler.add_request(make_request("hi2", [3] * 8, max_tokens=10))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"low": 1, "hi1": 8, "hi2": 8}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    return scheduler


def test_priority_preempts_worst_priority_even_if_already_scheduled():
    scheduler = low_priority_first_scheduler("priority")
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"hi1": 1, "hi2": 1}  # low's token taken back
    assert output.total_num_scheduled_tokens == 2
    assert output.scheduled_cached_reqs.req_ids == ["hi1", "hi2"]
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED


def test_fcfs_same_scenario_preempts_last_admitted():
    scheduler = low_priority_first_scheduler("fcfs")
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"hi2"}
    assert output.num_scheduled_tokens == {"low": 1, "hi1": 1}


def test_priority_ties_broken_by_arrival_time():
    scheduler = make_scheduler(block_size=4, num_blocks=7, policy="priority")
    scheduler.add_request(make_request("first", [1] * 8, max_tokens=10, priority=1))
    scheduler.add_request(make_request("second", [2] * 8, max_tokens=10, priority=1))
    scheduler.add_request(make_request("best", [3] * 8, max_tokens=10, priority=0))
    output, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["best", "first", "second"]
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"second"}


def test_priority_resumes_better_priority_first():
    scheduler = low_priority_first_scheduler("priority")
    step(scheduler)
    scheduler.add_request(make_request("mid", [4], max_tokens=1, priority=3))
    assert [request.request_id for request in scheduler.waiting] == ["mid", "low"]


def test_preemption_counts_repeat():
    scheduler = make_scheduler(block_size=4, num_blocks=8, max_num_batched_tokens=64)
    requests = make_requests(4, num_tokens=7, max_tokens=16, ignore_eos=True)
    for request in requests:
        scheduler.add_request(request)
    preempted: list[str] = []
    tokens = run_to_completion(
        scheduler, on_step=lambda output, _: preempted.extend(output.preempted_req_ids)
    )
    assert tokens == {
        request.request_id: reference_tokens([int(request.request_id)] * 7, 16)
        for request in requests
    }
    for request in requests:
        assert request.num_preemptions == preempted.count(request.request_id)
    assert max(request.num_preemptions for request in requests) >= 2


@pytest.mark.parametrize("use_v2_model_runner", [True, False])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_heavy_run_produces_reference_tokens(use_v2_model_runner, policy):
    scheduler = make_scheduler(
        block_size=4,
        num_blocks=14,
        max_num_seqs=5,
        max_num_batched_tokens=24,
        max_model_len=64,
        policy=policy,
        use_v2_model_runner=use_v2_model_runner,
    )
    prompts = {str(i): [(7 * i + j) % 23 for j in range(5 + 3 * (i % 4))] for i in range(9)}
    requests = [
        make_request(req_id, prompt, max_tokens=14, priority=int(req_id) % 3)
        for req_id, prompt in prompts.items()
    ]
    for request in requests:
        scheduler.add_request(request)
    worker = SimWorker.for_scheduler(scheduler)
    slots = WorkerSlots(5) if use_v2_model_runner else None
    tokens = run_to_completion(scheduler, worker=worker, slots=slots)
    assert tokens == {req_id: reference_tokens(prompt, 14) for req_id, prompt in prompts.items()}
    assert sum(request.num_preemptions for request in requests) > 0
    assert scheduler.kv_cache_manager.usage == 0.0


def test_resumed_request_tokens_equal_reference_with_scheduler_view():
    scheduler = make_scheduler(block_size=4, num_blocks=7)
    for request in make_requests(3, num_tokens=8, max_tokens=10):
        scheduler.add_request(request)
    preempted: set[str] = set()
    tokens = run_to_completion(
        scheduler, on_step=lambda output, _: preempted.update(output.preempted_req_ids)
    )
    assert preempted
    assert tokens == {str(i): reference_tokens([i] * 8, 10) for i in range(3)}


def test_self_preemption_when_request_is_the_only_victim():
    scheduler = make_scheduler(block_size=4, num_blocks=5)
    scheduler.add_request(make_request("a", [1] * 8, max_tokens=10))
    step(scheduler)
    scheduler.add_request(make_request("b", [2] * 8, max_tokens=10))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 8}  # 5 blocks in use
    output, _ = step(scheduler)
    # a fits in its 3 blocks; b needs a 3rd block: b is the most recent and is preempted itself.
    assert output.preempted_req_ids == {"b"}
    assert output.num_scheduled_tokens == {"a": 1}
