"""AsyncScheduler: planning step N+1 before step N's output, placeholders, and stale ones after a forced reset."""

from __future__ import annotations

import random

import pytest
from sched_helpers import AsyncDriver

from kvflow.core.sched.async_scheduler import AsyncScheduler
from kvflow.request import RequestStatus
from kvflow.testing import make_request, make_scheduler
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.worker_slots import WorkerSlots


def async_scheduler(**kwargs):
    scheduler = make_scheduler(async_scheduling=True, **kwargs)
    assert isinstance(scheduler, AsyncScheduler)
    return scheduler


def test_schedules_next_step_before_previous_output():
    scheduler = async_scheduler()
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=5))
    driver = AsyncDriver(scheduler)
    first = driver.schedule()
    assert first.num_scheduled_tokens == {"a": 10}
    request = scheduler.requests["a"]
    assert request.num_output_placeholders == 1
    second = driver.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.scheduled_cached_reqs.num_computed_tokens == [10]
    assert second.scheduled_cached_reqs.num_output_tokens == [1]  # the in-flight token counts
    assert request.num_output_placeholders == 2
    assert request.num_computed_tokens == 11
    assert request.num_output_tokens == 0
    (engine_output,) = driver.update()
    assert engine_output.new_token_ids == reference_tokens(list(range(10)), 1)
    assert request.num_output_placeholders == 1
    assert request.num_output_tokens == 1


def test_decode_requests_scheduled_with_one_token_per_step():
    scheduler = async_scheduler()
    for i in range(3):
        scheduler.add_request(make_request(str(i), [i] * 5, max_tokens=10))
    driver = AsyncDriver(scheduler)
    driver.schedule()
    for _ in range(3):
        assert driver.schedule().num_scheduled_tokens == {"0": 1, "1": 1, "2": 1}
    assert [request.num_output_placeholders for request in scheduler.running] == [4, 4, 4]


def test_partial_prefill_step_has_no_placeholder():
    scheduler = async_scheduler(max_num_batched_tokens=8, max_model_len=64)
    prompt = list(range(20))
    scheduler.add_request(make_request("a", prompt, max_tokens=3))
    driver = AsyncDriver(scheduler)
    assert driver.schedule().num_scheduled_tokens == {"a": 8}
    assert scheduler.requests["a"].num_output_placeholders == 0
    assert driver.schedule().num_scheduled_tokens == {"a": 8}
    assert driver.schedule().num_scheduled_tokens == {"a": 4}
    assert scheduler.requests["a"].num_output_placeholders == 1
    assert driver.run(depth=3) == {"a": reference_tokens(prompt, 3)}


def test_never_plans_more_placeholders_than_max_tokens():
    scheduler = async_scheduler()
    scheduler.add_request(make_request("a", [3] * 6, max_tokens=2))
    driver = AsyncDriver(scheduler)
    driver.schedule()
    driver.schedule()
    third = driver.schedule()
    assert "a" not in third.num_scheduled_tokens
    assert scheduler.requests["a"].num_output_placeholders == 2
    while driver.in_flight:
        driver.update()
    assert driver.tokens == {"a": reference_tokens([3] * 6, 2)}
    assert driver.finish_reasons == {"a": "length"}
    assert sum("a" in output.num_scheduled_tokens for output in driver.outputs) == 2


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_pipelined_run_produces_reference_tokens(depth):
    scheduler = async_scheduler(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64)
    prompts = {str(i): [(5 * i + j) % 31 for j in range(2 + 4 * i)] for i in range(6)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=1 + int(req_id)))
    driver = AsyncDriver(scheduler, WorkerSlots(3))
    tokens = driver.run(depth=depth)
    assert tokens == {
        req_id: reference_tokens(prompt, 1 + int(req_id)) for req_id, prompt in prompts.items()
    }
    for req_id, prompt in prompts.items():
        num_scheduled_steps = sum(
            1 for output in driver.outputs if req_id in output.num_scheduled_tokens
        )
        assert num_scheduled_steps <= len(prompt) + 1 + int(req_id)


def test_max_model_len_caps_async_planning():
    scheduler = async_scheduler(max_model_len=12, max_num_batched_tokens=64)
    prompt = list(range(9))
    scheduler.add_request(make_request("a", prompt, max_tokens=100))
    driver = AsyncDriver(scheduler)
    tokens = driver.run(depth=4)
    assert tokens == {"a": reference_tokens(prompt, 3)}
    assert driver.finish_reasons == {"a": "length"}
    for output in driver.outputs:
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            assert cached.num_computed_tokens[index] + output.num_scheduled_tokens[req_id] <= 12


def run_with_forced_reset(placeholders_in_flight: int, resets: list[str]):
    """Run two requests, then with `placeholders_in_flight` sampling steps planned but not delivered do the
    `resets` actions ("reset" or "schedule"), then finish the run. Returns (driver, prompts, discards after the
    resets)."""
    scheduler = async_scheduler(max_num_seqs=4)
    prompts = {"a": list(range(10)), "b": [4] * 6}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=8))
    driver = AsyncDriver(scheduler, WorkerSlots(4))
    for _ in range(2):  # two tokens each, delivered
        driver.schedule()
        driver.update()
    for _ in range(placeholders_in_flight):
        driver.schedule()
    assert [scheduler.requests[r].num_output_placeholders for r in prompts] == [
        placeholders_in_flight
    ] * 2
    for action in resets:
        if action == "reset":
            assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
        else:
            driver.schedule()
    discards = {req_id: scheduler.requests[req_id].async_tokens_to_discard for req_id in prompts}
    for req_id in prompts:
        assert scheduler.requests[req_id].status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
    driver.run(depth=2)
    return driver, prompts, discards


@pytest.mark.parametrize("placeholders_in_flight", [1, 2])
def test_forced_reset_drops_exactly_the_stale_placeholders(placeholders_in_flight):
    driver, prompts, discards = run_with_forced_reset(placeholders_in_flight, ["reset"])
    assert discards == {"a": placeholders_in_flight, "b": placeholders_in_flight}
    assert driver.tokens == {
        req_id: reference_tokens(prompt, 8) for req_id, prompt in prompts.items()
    }
    assert driver.finish_reasons == {"a": "length", "b": "length"}


@pytest.mark.parametrize("placeholders_in_flight", [1, 2])
def test_forced_reset_twice_before_placeholders_arrive(placeholders_in_flight):
    driver, prompts, discards = run_with_forced_reset(placeholders_in_flight, ["reset", "reset"])
    assert discards == {"a": placeholders_in_flight, "b": placeholders_in_flight}
    assert driver.tokens == {
        req_id: reference_tokens(prompt, 8) for req_id, prompt in prompts.items()
    }


@pytest.mark.parametrize("placeholders_in_flight", [1, 2])
def test_forced_reset_again_after_resumed_step_planned(placeholders_in_flight):
    driver, prompts, discards = run_with_forced_reset(
        placeholders_in_flight, ["reset", "schedule", "reset"]
    )
    # The resumed prefill step samples too and becomes stale with the second reset.
    assert discards == {"a": placeholders_in_flight + 1, "b": placeholders_in_flight + 1}
    assert driver.tokens == {
        req_id: reference_tokens(prompt, 8) for req_id, prompt in prompts.items()
    }


def test_forced_reset_reports_preempted_and_resumes_as_new():
    scheduler = async_scheduler()
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=6))
    driver = AsyncDriver(scheduler)
    driver.schedule()
    driver.update()
    driver.schedule()
    scheduler.reset_prefix_cache(reset_running_requests=True)
    output = driver.schedule()
    assert output.preempted_req_ids == {"a"}
    (new_req,) = output.scheduled_new_reqs
    assert new_req.prefill_token_ids == list(range(10)) + reference_tokens(list(range(10)), 1)
    driver.run()
    assert driver.tokens == {"a": reference_tokens(list(range(10)), 6)}


def test_kv_pressure_preemption_with_placeholders_in_flight():
    scheduler = async_scheduler(
        block_size=4, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64
    )
    prompts = {str(i): [i + 1] * (5 + 2 * i) for i in range(4)}
    requests = [make_request(req_id, prompt, max_tokens=12) for req_id, prompt in prompts.items()]
    for request in requests:
        scheduler.add_request(request)
    driver = AsyncDriver(scheduler, WorkerSlots(4))
    tokens = driver.run(depth=3)
    assert tokens == {req_id: reference_tokens(prompt, 12) for req_id, prompt in prompts.items()}
    assert sum(request.num_preemptions for request in requests) > 0


def test_stop_with_placeholders_in_flight_drops_them():
    prompt = list(range(12))
    expected = reference_tokens(prompt, 6)
    scheduler = async_scheduler()
    scheduler.add_request(make_request("a", prompt, max_tokens=6, eos_token_id=expected[1]))
    driver = AsyncDriver(scheduler)
    assert driver.run(depth=4) == {"a": expected[:2]}
    assert driver.finish_reasons == {"a": "stop"}
    assert "a" not in scheduler.requests


def test_streaming_session_stop_with_placeholders_in_flight_then_next_chunk():
    prompt = list(range(12))
    first = reference_tokens(prompt, 6)
    scheduler = async_scheduler()
    scheduler.add_request(
        make_request("s", prompt, max_tokens=6, eos_token_id=first[1], resumable=True)
    )
    driver = AsyncDriver(scheduler, WorkerSlots(16))
    driver.schedule()
    driver.schedule()
    driver.schedule()
    driver.schedule()
    driver.update()
    driver.update()  # second token is EOS: the session stops with two placeholders still in flight
    request = scheduler.requests["s"]
    assert request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert request.async_tokens_to_discard == 2
    assert request.num_output_placeholders == 0
    chunk = [5, 6, 7]
    scheduler.add_request(make_request("s", chunk, max_tokens=3, resumable=True))
    output = driver.schedule()
    assert output.num_scheduled_tokens == {"s": len(chunk)}
    driver.tokens.clear()
    driver.run(depth=2)
    assert driver.tokens == {"s": reference_tokens(prompt + first[:1] + chunk, 3)}


@pytest.mark.parametrize("seed", range(6))
def test_randomized_async_run_with_resets(seed):
    rng = random.Random(seed)
    max_num_seqs = rng.choice([2, 3, 4])
    scheduler = async_scheduler(
        block_size=4,
        num_blocks=rng.randint(12, 20),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.choice([8, 16, 32]),
        max_model_len=64,
    )
    prompts = {str(i): [rng.randrange(40) for _ in range(rng.randint(1, 10))] for i in range(8)}
    max_tokens = {req_id: rng.randint(1, 12) for req_id in prompts}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=max_tokens[req_id]))
    driver = AsyncDriver(scheduler, WorkerSlots(max_num_seqs))
    depth = rng.choice([2, 3])
    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and not driver.in_flight:
            break
        if rng.random() < 0.1:
            assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
        if scheduler.has_unfinished_requests():
            driver.schedule()
        while driver.in_flight and (
            len(driver.in_flight) >= depth
            or rng.random() < 0.3
            or not scheduler.has_unfinished_requests()
        ):
            driver.update()
    assert driver.tokens == {
        req_id: reference_tokens(prompt, max_tokens[req_id]) for req_id, prompt in prompts.items()
    }


def test_priority_preemption_of_unscheduled_earlier_request_does_not_skip_the_next():
    # X (worst priority) has its only token in flight, so it is skipped; R then needs a block and X is the victim.
    # Removing X (before R in `running`) must not make the loop skip Y, which has a token to run and fits.
    scheduler = async_scheduler(policy="priority", block_size=4, num_blocks=3)
    driver = AsyncDriver(scheduler)
    scheduler.add_request(make_request("X", [1] * 4, max_tokens=1, priority=9))
    driver.schedule()
    scheduler.add_request(make_request("R", [2] * 4, max_tokens=5))
    scheduler.add_request(make_request("Y", [3] * 3, max_tokens=5))
    assert driver.schedule().num_scheduled_tokens == {"R": 4, "Y": 3}
    assert [request.request_id for request in scheduler.running] == ["X", "R", "Y"]
    output = driver.schedule()
    assert output.preempted_req_ids == {"X"}
    assert output.num_scheduled_tokens == {"R": 1, "Y": 1}


def test_stale_placeholders_of_aborted_request_do_not_reach_a_new_request_with_the_same_id():
    scheduler = async_scheduler()
    driver = AsyncDriver(scheduler, WorkerSlots(16))
    scheduler.add_request(make_request("a", [1] * 5, max_tokens=5))
    driver.schedule()
    driver.schedule()  # two placeholders of the first "a" in flight
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("a", [2] * 7, max_tokens=3))  # the id is free again
    driver.tokens.clear()
    driver.run(depth=2)
    assert driver.tokens == {"a": reference_tokens([2] * 7, 3)}


@pytest.mark.parametrize("close_by", ["close_session", "empty_request"])
def test_stale_placeholders_of_closed_session_do_not_reach_a_reopened_session(close_by):
    prompt = list(range(12))
    first = reference_tokens(prompt, 4)
    scheduler = async_scheduler()
    driver = AsyncDriver(scheduler, WorkerSlots(16))
    scheduler.add_request(
        make_request("s", prompt, max_tokens=4, eos_token_id=first[0], resumable=True)
    )
    for _ in range(3):
        driver.schedule()
    driver.update()  # EOS: the session parks with two stale placeholders in flight
    assert scheduler.requests["s"].async_tokens_to_discard == 2
    if close_by == "close_session":
        assert scheduler.close_session("s") is True
    else:
        scheduler.add_request(make_request("s", [], resumable=False))
    assert "s" not in scheduler.requests
    scheduler.add_request(
        make_request("s", [3] * 6, max_tokens=3, resumable=True)
    )  # a new session, same id
    driver.tokens.clear()
    driver.run(depth=2)
    assert driver.tokens == {"s": reference_tokens([3] * 6, 3)}


def test_persistent_batch_all_token_ids_keep_in_flight_tokens_after_a_skipped_step():
    # Async + persistent-batch runner: "a" has sampled tokens in flight when a step skips it (no budget while
    # paused). The next step resends its token list; the worker must not lose the in-flight token it already
    # holds (the step schedules that token's position).
    from kvflow.core.sched.scheduler import PauseState

    scheduler = async_scheduler(use_v2_model_runner=False)
    prompt = [1] * 5
    scheduler.add_request(make_request("a", prompt, max_tokens=6))
    driver = AsyncDriver(scheduler)
    driver.schedule()
    driver.schedule()
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    assert driver.schedule().num_scheduled_tokens == {}
    scheduler.set_pause_state(PauseState.UNPAUSED)
    driver.update()
    driver.run(depth=2)
    assert driver.tokens == {"a": reference_tokens(prompt, 6)}
