"""reset_prefix_cache(): plain (only when idle) and forced (reset_running_requests=True preempts everything)."""

from __future__ import annotations

import pytest
from sched_helpers import SimWorker, run_to_completion, step

from kvflow.request import RequestStatus
from kvflow.testing import make_request, make_scheduler
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.worker_slots import WorkerSlots

PREFIX = list(range(300, 332))


def test_reset_fails_while_blocks_in_use_and_changes_nothing():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [*PREFIX, 1], max_tokens=5))
    step(scheduler)
    blocks_before = scheduler.kv_cache_manager.get_block_ids("a")
    assert scheduler.reset_prefix_cache() is False
    assert scheduler.kv_cache_manager.get_block_ids("a") == blocks_before
    assert scheduler.requests["a"].status == RequestStatus.RUNNING
    scheduler.add_request(make_request("b", [*PREFIX, 2]))
    output, _ = step(scheduler)
    (new_req,) = output.scheduled_new_reqs
    assert new_req.num_computed_tokens == 32  # the cache survived the refused reset


def test_reset_succeeds_when_idle_and_forgets_prefixes():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [*PREFIX, 1], max_tokens=2))
    run_to_completion(scheduler)
    assert scheduler.reset_prefix_cache() is True
    scheduler.add_request(make_request("b", [*PREFIX, 2]))
    output, _ = step(scheduler)
    (new_req,) = output.scheduled_new_reqs
    assert new_req.num_computed_tokens == 0


def test_reset_on_fresh_scheduler_returns_true():
    assert make_scheduler().reset_prefix_cache() is True


def running_abc_waiting_d(use_v2_model_runner=True):
    scheduler = make_scheduler(
        max_num_seqs=3, block_size=4, use_v2_model_runner=use_v2_model_runner
    )
    prompts = {"a": [1] * 6, "b": [2] * 9, "c": [3] * 3, "d": [4] * 5}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=6))
    return scheduler, prompts


def test_forced_reset_preempts_running_in_fifo_order_at_head_of_waiting():
    scheduler, _ = running_abc_waiting_d()
    step(scheduler)
    step(scheduler)
    assert [request.request_id for request in scheduler.running] == ["a", "b", "c"]
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert scheduler.running == []
    assert [request.request_id for request in scheduler.waiting] == ["a", "b", "c", "d"]
    for req_id in "abc":
        request = scheduler.requests[req_id]
        assert request.status == RequestStatus.PREEMPTED
        assert request.num_computed_tokens == 0
        assert request.num_preemptions == 1
        assert scheduler.kv_cache_manager.get_block_ids(req_id) == ([],)
    assert scheduler.kv_cache_manager.usage == 0.0


def test_forced_reset_reports_preempted_once_in_next_output():
    scheduler, _ = running_abc_waiting_d()
    step(scheduler)
    scheduler.reset_prefix_cache(reset_running_requests=True)
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"a", "b", "c"}
    assert [new_req.req_id for new_req in output.scheduled_new_reqs] == ["a", "b", "c"]
    for new_req in output.scheduled_new_reqs:
        request = scheduler.requests[new_req.req_id]
        assert new_req.prefill_token_ids == list(request.all_token_ids)[: request.num_tokens - 1]
        assert new_req.num_computed_tokens == 0  # the cache was cleared
    output, _ = step(scheduler)
    assert output.preempted_req_ids == set()


def test_forced_reset_when_idle_reports_nothing():
    scheduler = make_scheduler()
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert scheduler.schedule().preempted_req_ids == set()


@pytest.mark.parametrize("use_v2_model_runner", [True, False])
def test_forced_reset_run_still_produces_reference_tokens(use_v2_model_runner):
    scheduler, prompts = running_abc_waiting_d(use_v2_model_runner)
    worker = SimWorker.for_scheduler(scheduler)
    slots = WorkerSlots(3) if use_v2_model_runner else None
    tokens = {}
    for _ in range(3):
        _, outputs = step(scheduler, worker=worker, slots=slots)
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    for req_id, new_tokens in run_to_completion(scheduler, worker=worker, slots=slots).items():
        tokens.setdefault(req_id, []).extend(new_tokens)
    assert tokens == {req_id: reference_tokens(prompt, 6) for req_id, prompt in prompts.items()}


def test_forced_reset_twice_before_schedule():
    scheduler, prompts = running_abc_waiting_d()
    worker = SimWorker.for_scheduler(scheduler)
    slots = WorkerSlots(3)
    tokens: dict[str, list[int]] = {}
    for _ in range(2):
        for output in step(scheduler, worker=worker, slots=slots)[1]:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert [request.request_id for request in scheduler.waiting] == ["a", "b", "c", "d"]
    assert all(scheduler.requests[req_id].num_preemptions == 1 for req_id in "abc")
    output, outputs = step(scheduler, worker=worker, slots=slots)
    assert output.preempted_req_ids == {"a", "b", "c"}
    for engine_output in outputs:
        tokens.setdefault(engine_output.request_id, []).extend(engine_output.new_token_ids)
    for req_id, new_tokens in run_to_completion(scheduler, worker=worker, slots=slots).items():
        tokens.setdefault(req_id, []).extend(new_tokens)
    assert tokens == {req_id: reference_tokens(prompt, 6) for req_id, prompt in prompts.items()}


def test_forced_reset_between_schedule_and_update_keeps_the_sampled_token():
    scheduler = make_scheduler(max_num_seqs=2)
    prompts = {"a": [1] * 5, "b": [2] * 7}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=4))
    worker = SimWorker.for_scheduler(scheduler)
    slots = WorkerSlots(2)
    tokens: dict[str, list[int]] = {}
    output = scheduler.schedule()
    slots.apply(output)
    model_output = worker.execute(output)
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    for engine_output in scheduler.update_from_output(output, model_output):
        tokens.setdefault(engine_output.request_id, []).extend(engine_output.new_token_ids)
    for req_id, new_tokens in run_to_completion(scheduler, worker=worker, slots=slots).items():
        tokens.setdefault(req_id, []).extend(new_tokens)
    assert tokens == {req_id: reference_tokens(prompt, 4) for req_id, prompt in prompts.items()}


def test_forced_reset_keeps_finished_report():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("done", [1] * 4, max_tokens=1))
    scheduler.add_request(make_request("live", [2] * 4, max_tokens=5))
    step(scheduler)
    assert "done" not in scheduler.requests
    scheduler.reset_prefix_cache(reset_running_requests=True)
    output, _ = step(scheduler)
    assert output.finished_req_ids == {"done"}
    assert output.preempted_req_ids == {"live"}


def test_forced_reset_then_abort_reports_only_finished():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 4, max_tokens=5))
    step(scheduler)
    scheduler.reset_prefix_cache(reset_running_requests=True)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    output = scheduler.schedule()
    assert output.finished_req_ids == {"a"}
    assert output.preempted_req_ids == set()


def test_forced_reset_preempts_partial_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    prompt = list(range(20))
    scheduler.add_request(make_request("a", prompt, max_tokens=3))
    step(scheduler)
    assert scheduler.requests["a"].num_computed_tokens == 8
    scheduler.reset_prefix_cache(reset_running_requests=True)
    output, _ = step(scheduler)
    (new_req,) = output.scheduled_new_reqs
    assert new_req.num_computed_tokens == 0
    assert new_req.prefill_token_ids == prompt
    assert run_to_completion(scheduler) == {"a": reference_tokens(prompt, 3)}


def test_forced_reset_with_priority_policy_keeps_priority_order():
    scheduler = make_scheduler(policy="priority", max_num_seqs=2)
    scheduler.add_request(make_request("low", [1] * 4, max_tokens=5, priority=2))
    scheduler.add_request(make_request("high", [2] * 4, max_tokens=5, priority=0))
    scheduler.add_request(make_request("mid", [3] * 4, max_tokens=5, priority=1))
    step(scheduler)
    assert [request.request_id for request in scheduler.running] == ["high", "mid"]
    scheduler.reset_prefix_cache(reset_running_requests=True)
    assert [request.request_id for request in scheduler.waiting] == ["high", "mid", "low"]
