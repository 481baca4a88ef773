"""Pause states: PAUSED_NEW admits nothing, PAUSED_ALL schedules nothing; reports still go out."""

from __future__ import annotations

from sched_helpers import SimWorker, run_to_completion, step

from kvflow.core.sched.output import ModelRunnerOutput
from kvflow.core.sched.scheduler import PauseState
from kvflow.request import RequestStatus
from kvflow.testing import make_request, make_scheduler
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.worker_slots import WorkerSlots


def test_default_is_unpaused():
    assert make_scheduler().pause_state == PauseState.UNPAUSED


def test_paused_new_runs_running_requests_but_admits_nothing():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 4, max_tokens=4))
    step(scheduler)
    scheduler.set_pause_state(PauseState.PAUSED_NEW)
    scheduler.add_request(make_request("b", [2] * 4, max_tokens=2))
    assert scheduler.get_num_unfinished_requests() == 2  # queued visibly
    for _ in range(3):
        output, _ = step(scheduler)
        assert set(output.num_scheduled_tokens) == {"a"}
    assert "a" not in scheduler.requests
    assert scheduler.requests["b"].status == RequestStatus.WAITING
    scheduler.set_pause_state(PauseState.UNPAUSED)
    assert run_to_completion(scheduler) == {"b": reference_tokens([2] * 4, 2)}


def test_paused_all_schedules_nothing_but_reports_finished():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 4, max_tokens=1))
    scheduler.add_request(make_request("b", [2] * 4, max_tokens=5))
    step(scheduler)
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {}
    assert output.finished_req_ids == {"a"}
    scheduler.update_from_output(output, ModelRunnerOutput.make_empty())
    assert scheduler.schedule().num_scheduled_tokens == {}


def test_paused_all_with_forced_reset_reports_preemptions_and_resumes_after():
    scheduler = make_scheduler(max_num_seqs=2)
    prompts = {"a": [1] * 6, "b": [2] * 9}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=5))
    worker = SimWorker.for_scheduler(scheduler)
    slots = WorkerSlots(2)
    tokens: dict[str, list[int]] = {}
    for output in step(scheduler, worker=worker, slots=slots)[1]:
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    output, _ = step(scheduler, worker=worker, slots=slots)
    assert output.preempted_req_ids == {"a", "b"}
    assert output.num_scheduled_tokens == {}
    assert scheduler.schedule().preempted_req_ids == set()
    scheduler.set_pause_state(PauseState.UNPAUSED)
    for req_id, new_tokens in run_to_completion(scheduler, worker=worker, slots=slots).items():
        tokens.setdefault(req_id, []).extend(new_tokens)
    assert tokens == {req_id: reference_tokens(prompt, 5) for req_id, prompt in prompts.items()}
