"""The two runner protocols: slot runner (use_v2_model_runner=True) and persistent batch (False)."""

from __future__ import annotations

import random

import pytest
from sched_helpers import SimWorker, run_to_completion, runner_output, step

from kvflow.core.sched.output import ModelRunnerOutput
from kvflow.core.sched.scheduler import PauseState
from kvflow.request import RequestStatus
from kvflow.testing import make_request, make_requests, make_scheduler
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.worker_slots import WorkerSlots


def preempt_then_resume(use_v2_model_runner: bool):
    """Three 8-token requests in 7 blocks of 4: step 2 preempts "2" and finishes "0"; step 3 resumes "2"."""
    scheduler = make_scheduler(block_size=4, num_blocks=7, use_v2_model_runner=use_v2_model_runner)
    scheduler.add_request(make_request("0", [0] * 8, max_tokens=2))
    scheduler.add_request(make_request("1", [1] * 8, max_tokens=10))
    scheduler.add_request(make_request("2", [2] * 8, max_tokens=10))
    outputs = [step(scheduler)[0]]
    first_token_of_2 = scheduler.requests["2"].output_token_ids[0]
    outputs.append(step(scheduler)[0])
    assert outputs[1].preempted_req_ids == {"2"}
    assert outputs[1].num_scheduled_tokens == {"0": 1, "1": 1}
    assert "0" not in scheduler.requests
    outputs.append(step(scheduler)[0])
    return scheduler, outputs, first_token_of_2


# ------------------------------------------------------------------------------------------------ slot runner
def test_slot_runner_resumed_request_comes_back_as_new_with_prefill_tokens():
    scheduler, outputs, first_token = preempt_then_resume(use_v2_model_runner=True)
    resumed = outputs[2]
    assert resumed.preempted_req_ids == set()  # reported once, in the step that preempted
    assert resumed.finished_req_ids == {"0"}
    (new_req,) = resumed.scheduled_new_reqs
    assert new_req.req_id == "2"
    assert new_req.prompt_token_ids == [2] * 8
    assert new_req.prefill_token_ids == [2] * 8 + [first_token]
    assert new_req.block_ids == scheduler.kv_cache_manager.get_block_ids("2")
    assert resumed.num_scheduled_tokens["2"] == 9 - new_req.num_computed_tokens
    assert resumed.scheduled_cached_reqs.req_ids == ["1"]
    assert resumed.scheduled_cached_reqs.resumed_req_ids == set()


def test_slot_runner_cached_data_never_carries_all_token_ids():
    scheduler = make_scheduler(
        block_size=4, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64
    )
    for request in make_requests(6, num_tokens=9, max_tokens=12):
        scheduler.add_request(request)
    seen_cached = []

    def check(output, _):
        assert output.scheduled_cached_reqs.all_token_ids == {}
        assert output.scheduled_cached_reqs.resumed_req_ids == set()
        seen_cached.extend(output.scheduled_cached_reqs.req_ids)

    run_to_completion(
        scheduler, worker=SimWorker.for_scheduler(scheduler), slots=WorkerSlots(4), on_step=check
    )
    assert seen_cached


def test_slot_runner_preempted_request_reported_exactly_once_per_preemption():
    scheduler = make_scheduler(block_size=4, num_blocks=9, max_num_batched_tokens=64)
    requests = make_requests(4, num_tokens=7, max_tokens=16)
    for request in requests:
        scheduler.add_request(request)
    reports: list[str] = []
    run_to_completion(
        scheduler,
        slots=WorkerSlots(16),
        on_step=lambda output, _: reports.extend(output.preempted_req_ids),
    )
    for request in requests:
        assert reports.count(request.request_id) == request.num_preemptions


@pytest.mark.parametrize("seed", range(8))
def test_worker_slots_never_overflow_in_preemption_heavy_runs(seed):
    rng = random.Random(seed)
    max_num_seqs = rng.choice([1, 2, 3, 5])
    scheduler = make_scheduler(
        block_size=4,
        num_blocks=rng.randint(10, 16),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.choice([8, 16, 32]),
        max_model_len=64,
        policy=rng.choice(["fcfs", "priority"]),
    )
    prompts = {}
    for i in range(10):
        prompts[str(i)] = [rng.randrange(50) for _ in range(rng.randint(1, 12))]
        scheduler.add_request(
            make_request(
                str(i), prompts[str(i)], max_tokens=rng.randint(1, 20), priority=rng.randrange(3)
            )
        )
    max_tokens = {req_id: scheduler.requests[req_id].max_tokens for req_id in prompts}
    slots = WorkerSlots(max_num_seqs)
    tokens = run_to_completion(scheduler, worker=SimWorker.for_scheduler(scheduler), slots=slots)
    assert tokens == {
        req_id: reference_tokens(prompt, max_tokens[req_id]) for req_id, prompt in prompts.items()
    }


# ------------------------------------------------------------------------------------------------ persistent batch
def test_persistent_batch_resumed_request_is_cached_with_full_state():
    scheduler, outputs, first_token = preempt_then_resume(use_v2_model_runner=False)
    resumed = outputs[2]
    assert resumed.scheduled_new_reqs == []
    cached = resumed.scheduled_cached_reqs
    assert cached.req_ids == ["1", "2"]
    assert cached.resumed_req_ids == {"2"}
    index = cached.req_ids.index("2")
    assert cached.new_block_ids[index] == scheduler.kv_cache_manager.get_block_ids("2")
    assert cached.all_token_ids["2"] == [2] * 8 + [first_token]
    assert "1" not in cached.all_token_ids  # scheduled in the previous step
    assert resumed.num_scheduled_tokens["2"] == 9 - cached.num_computed_tokens[index]


def test_persistent_batch_preempted_and_resumed_tokens_are_correct():
    scheduler, _, _ = preempt_then_resume(use_v2_model_runner=False)
    tokens = run_to_completion(scheduler)
    assert (
        tokens["2"] == reference_tokens([2] * 8, 10)[2:]
    )  # tokens 0 and 1 came out of the first steps


def check_all_token_ids_rule():
    """on_step callback: all_token_ids holds exactly the cached ids not scheduled in the previous step (plus
    resumed ones), each with the request's full token list at scheduling time."""
    state: dict[str, set[str]] = {"prev": set()}

    def check(output, _):
        cached = output.scheduled_cached_reqs
        expected = {
            req_id
            for req_id in cached.req_ids
            if req_id not in state["prev"] or req_id in cached.resumed_req_ids
        }
        assert set(cached.all_token_ids) == expected
        state["prev"] = set(output.num_scheduled_tokens)

    return check


def test_persistent_batch_running_request_skipped_for_a_step_gets_all_token_ids():
    # PRIORITY: "worst" runs out of blocks and is its own victim, which ends the running loop: "other" behind it
    # is skipped for that step although it is running.
    scheduler = make_scheduler(
        block_size=4, num_blocks=5, policy="priority", use_v2_model_runner=False
    )
    scheduler.add_request(make_request("hi", [1], max_tokens=20))
    step(scheduler)
    scheduler.add_request(make_request("worst", [2] * 11, max_tokens=20, priority=9))
    step(scheduler)
    scheduler.add_request(make_request("other", [3] * 2, max_tokens=20))
    step(scheduler)
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"worst"}
    assert output.num_scheduled_tokens == {"hi": 1}
    assert scheduler.requests["other"].status == RequestStatus.RUNNING
    output = scheduler.schedule()
    cached = output.scheduled_cached_reqs
    assert cached.req_ids == ["hi", "other"]
    assert set(cached.all_token_ids) == {"other"}
    assert cached.all_token_ids["other"] == list(scheduler.requests["other"].all_token_ids)


def test_persistent_batch_all_token_ids_after_budget_pause():
    scheduler = make_scheduler(use_v2_model_runner=False)
    for request in make_requests(2, max_tokens=10):
        scheduler.add_request(request)
    step(scheduler)
    output, _ = step(scheduler)
    assert output.scheduled_cached_reqs.all_token_ids == {}
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    output = scheduler.schedule()  # no budget: every running request is skipped
    assert output.num_scheduled_tokens == {}
    scheduler.update_from_output(output, ModelRunnerOutput.make_empty())
    scheduler.set_pause_state(PauseState.UNPAUSED)
    output, _ = step(scheduler)
    cached = output.scheduled_cached_reqs
    assert cached.req_ids == ["0", "1"]
    assert cached.all_token_ids == {
        "0": [0] * 10 + cached.all_token_ids["0"][10:],
        "1": [1] * 10 + cached.all_token_ids["1"][10:],
    }
    assert [len(cached.all_token_ids[req_id]) for req_id in ("0", "1")] == [12, 12]
    output, _ = step(scheduler)
    assert output.scheduled_cached_reqs.all_token_ids == {}


def test_persistent_batch_tokens_correct_with_worker_using_all_token_ids():
    scheduler = make_scheduler(
        block_size=4,
        num_blocks=12,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        max_model_len=64,
        policy="priority",
        use_v2_model_runner=False,
    )
    prompts = {str(i): [i + 3] * (4 + 2 * i) for i in range(7)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(
            make_request(req_id, prompt, max_tokens=10, priority=(3 - int(req_id)) % 3)
        )
    worker = SimWorker.for_scheduler(scheduler)
    tokens = run_to_completion(scheduler, worker=worker, on_step=check_all_token_ids_rule())
    assert tokens == {req_id: reference_tokens(prompt, 10) for req_id, prompt in prompts.items()}


def test_persistent_batch_steady_decoding_sends_no_token_lists():
    scheduler = make_scheduler(use_v2_model_runner=False)
    for request in make_requests(3, max_tokens=6):
        scheduler.add_request(request)
    step(scheduler)
    for _ in range(4):
        output, _ = step(scheduler)
        assert output.scheduled_cached_reqs.all_token_ids == {}
        assert output.scheduled_cached_reqs.new_token_ids == [[], [], []]


def test_runner_output_helper_gives_empty_list_for_partial_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    scheduler.add_request(make_request("a", [1] * 5))
    scheduler.add_request(make_request("b", [2] * 20))
    output = scheduler.schedule()
    model_output = runner_output(scheduler, output)
    assert model_output.sampled_token_ids == [reference_tokens([1] * 5, 1), []]
