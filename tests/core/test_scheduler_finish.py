"""Stopping through the scheduler (EOS, stop tokens, min/max tokens, max_model_len) and finish_requests (abort)."""

from __future__ import annotations

import pytest
from sched_helpers import SimWorker, run_to_completion, runner_output, step

from kvflow.core.sched.output import ModelRunnerOutput
from kvflow.request import RequestStatus
from kvflow.testing import DEFAULT_EOS_TOKEN_ID, make_request, make_requests, make_scheduler
from kvflow.testing.hash_model import reference_tokens

EOS = DEFAULT_EOS_TOKEN_ID


def tokens_then(fixed: list[int]):
    """A token source emitting `fixed[i]` as the i-th output token of every request, then 7s."""
    return lambda request: (
        fixed[request.num_output_tokens] if request.num_output_tokens < len(fixed) else 7
    )


def run_one(request, token_fn=None, **scheduler_kwargs):
    scheduler = make_scheduler(**scheduler_kwargs)
    scheduler.add_request(request)
    finals = []
    tokens = run_to_completion(
        scheduler,
        token_fn=token_fn,
        on_step=lambda _, outputs: finals.extend(o for o in outputs if o.finished),
    )
    assert len(finals) == 1
    return scheduler, tokens[request.request_id], finals[0]


# ------------------------------------------------------------------------------------------------ stop checks
def test_eos_stops_with_reason_stop():
    _, tokens, final = run_one(
        make_request("a", [1] * 5, max_tokens=10), tokens_then([3, 4, EOS, 5])
    )
    assert tokens == [3, 4, EOS]
    assert final.finish_reason == "stop"
    assert final.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    _, tokens, final = run_one(
        make_request("a", [1] * 5, max_tokens=6, ignore_eos=True), tokens_then([EOS, EOS, 1, EOS])
    )
    assert tokens == [EOS, EOS, 1, EOS, 7, 7]
    assert final.finish_reason == "length"


def test_custom_eos_token_id():
    _, tokens, final = run_one(
        make_request("a", [1] * 5, max_tokens=10, eos_token_id=4), tokens_then([3, 4, 5])
    )
    assert tokens == [3, 4]
    assert final.finish_reason == "stop"


def test_no_eos_token_id_never_stops_on_eos():
    _, tokens, final = run_one(
        make_request("a", [1] * 5, max_tokens=3, eos_token_id=None), tokens_then([EOS, EOS, EOS])
    )
    assert tokens == [EOS, EOS, EOS]
    assert final.finish_reason == "length"


def test_stop_token_id_sets_stop_reason():
    _, tokens, final = run_one(
        make_request("a", [1] * 5, max_tokens=10, stop_token_ids=[9, 11]), tokens_then([3, 11, 5])
    )
    assert tokens == [3, 11]
    assert final.finish_reason == "stop"
    assert final.stop_reason == 11


def test_min_tokens_suppresses_eos_and_stop_tokens():
    _, tokens, final = run_one(
        make_request("a", [1] * 5, max_tokens=10, min_tokens=3, stop_token_ids=[9]),
        tokens_then([EOS, 9, EOS, 2]),
    )
    assert tokens == [EOS, 9, EOS]
    assert final.finish_reason == "stop"


def test_min_tokens_suppresses_stop_token_until_reached():
    _, tokens, final = run_one(
        make_request("a", [1] * 5, max_tokens=10, min_tokens=2, stop_token_ids=[9]),
        tokens_then([9, 2, 9]),
    )
    assert tokens == [9, 2, 9]
    assert final.stop_reason == 9


def test_max_tokens_finishes_with_length():
    _, tokens, final = run_one(make_request("a", [1] * 5, max_tokens=4))
    assert tokens == reference_tokens([1] * 5, 4)
    assert final.finish_reason == "length"


def test_max_model_len_caps_generation_with_length():
    prompt = list(range(15))
    _, tokens, final = run_one(make_request("a", prompt, max_tokens=100), max_model_len=20)
    assert tokens == reference_tokens(prompt, 5)
    assert final.finish_reason == "length"


def test_max_model_len_never_scheduled_past():
    scheduler = make_scheduler(max_model_len=20, block_size=4)
    scheduler.add_request(make_request("a", list(range(15)), max_tokens=100))
    seq_lens = []

    def record(output, _):
        for cached_index, req_id in enumerate(output.scheduled_cached_reqs.req_ids):
            seq_lens.append(
                output.scheduled_cached_reqs.num_computed_tokens[cached_index]
                + output.num_scheduled_tokens[req_id]
            )

    run_to_completion(scheduler, worker=SimWorker.for_scheduler(scheduler), on_step=record)
    assert max(seq_lens) <= 20


def test_prompt_of_exactly_max_model_len_generates_one_token():
    _, tokens, final = run_one(make_request("a", list(range(20)), max_tokens=10), max_model_len=20)
    assert len(tokens) == 1
    assert final.finish_reason == "length"


def test_stop_token_as_last_allowed_token_finishes_stop():
    # vLLM's order: the max_tokens-th token is a stop token, so the request stopped rather than ran out.
    _, tokens, final = run_one(
        make_request("a", [1] * 5, max_tokens=2, stop_token_ids=[9]), tokens_then([3, 9])
    )
    assert tokens == [3, 9]
    assert final.finish_reason == "stop"
    assert final.stop_reason == 9


def test_eos_as_last_allowed_token_finishes_stop():
    _, tokens, final = run_one(make_request("a", [1] * 5, max_tokens=2), tokens_then([3, EOS]))
    assert tokens == [3, EOS]
    assert final.finish_reason == "stop"
    assert final.stop_reason is None


def test_eos_at_max_model_len_finishes_stop():
    _, tokens, final = run_one(
        make_request("a", list(range(19)), max_tokens=10), tokens_then([EOS]), max_model_len=20
    )
    assert tokens == [EOS]
    assert final.finish_reason == "stop"


def test_ignored_eos_as_last_allowed_token_finishes_length():
    _, tokens, final = run_one(
        make_request("a", [1] * 5, max_tokens=2, ignore_eos=True), tokens_then([3, EOS])
    )
    assert tokens == [3, EOS]
    assert final.finish_reason == "length"


def test_only_the_finishing_output_has_finish_reason():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 5, max_tokens=3))
    reasons = []
    run_to_completion(
        scheduler, on_step=lambda _, outputs: reasons.extend(o.finish_reason for o in outputs)
    )
    assert reasons == [None, None, "length"]


# ------------------------------------------------------------------------------------------------ finishing
def test_finished_request_leaves_requests_and_frees_blocks():
    scheduler = make_scheduler(block_size=4, num_blocks=10)
    scheduler.add_request(make_request("a", [1] * 9, max_tokens=2))
    step(scheduler)
    assert scheduler.kv_cache_manager.get_block_ids("a") == ([0, 1, 2],)
    _, outputs = step(scheduler)
    assert outputs[0].finished
    assert "a" not in scheduler.requests
    assert scheduler.running == []
    assert scheduler.kv_cache_manager.get_block_ids("a") == ([],)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 10


def test_finished_request_reported_once_in_next_output():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 5, max_tokens=1))
    scheduler.add_request(make_request("b", [2] * 5, max_tokens=4))
    output, outputs = step(scheduler)
    assert output.finished_req_ids == set()
    assert [o.request_id for o in outputs if o.finished] == ["a"]
    output, _ = step(scheduler)
    assert output.finished_req_ids == {"a"}
    output, _ = step(scheduler)
    assert output.finished_req_ids == set()


def test_finished_request_id_can_be_reused():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 5, max_tokens=2))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("a", [2] * 6, max_tokens=2))
    assert run_to_completion(scheduler) == {"a": reference_tokens([2] * 6, 2)}


# ------------------------------------------------------------------------------------------------ abort
def test_abort_unknown_id_is_a_no_op():
    scheduler = make_scheduler()
    scheduler.finish_requests("nope", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests(["nope", "nada"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.schedule().finished_req_ids == set()


def test_abort_waiting_request():
    scheduler = make_scheduler(max_num_seqs=1)
    for request in make_requests(2):
        scheduler.add_request(request)
    step(scheduler)
    waiting = scheduler.requests["1"]
    scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert waiting.status == RequestStatus.FINISHED_ABORTED
    assert "1" not in scheduler.requests
    assert list(scheduler.waiting) == []
    output, _ = step(scheduler)
    assert output.finished_req_ids == {"1"}
    assert "1" not in output.num_scheduled_tokens


def test_abort_running_request_frees_blocks():
    scheduler = make_scheduler(block_size=4, num_blocks=8)
    scheduler.add_request(make_request("a", [1] * 10))
    step(scheduler)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 5
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.running == []
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 8
    assert not scheduler.has_unfinished_requests()
    output = scheduler.schedule()
    assert output.finished_req_ids == {"a"}
    assert output.num_scheduled_tokens == {}


def test_abort_preempted_request():
    scheduler = make_scheduler(block_size=4, num_blocks=7)
    for request in make_requests(3, num_tokens=8, max_tokens=10):
        scheduler.add_request(request)
    step(scheduler)
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"2"}
    assert scheduler.requests["2"].status == RequestStatus.PREEMPTED
    scheduler.finish_requests("2", RequestStatus.FINISHED_ABORTED)
    assert "2" not in scheduler.requests
    assert all(request.request_id != "2" for request in scheduler.waiting)
    tokens = run_to_completion(scheduler)
    assert set(tokens) == {"0", "1"}


def test_abort_finished_request_is_a_no_op():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 5, max_tokens=1))
    step(scheduler)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    output = scheduler.schedule()
    assert output.finished_req_ids == {"a"}  # reported once, for the natural finish
    assert scheduler.schedule().finished_req_ids == set()


def test_abort_is_idempotent():
    scheduler = make_scheduler(block_size=4, num_blocks=8)
    scheduler.add_request(make_request("a", [1] * 10))
    scheduler.add_request(make_request("b", [2] * 10))
    step(scheduler)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    free_after_first = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests(["a", "a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_after_first
    assert [request.request_id for request in scheduler.running] == ["b"]
    output, _ = step(scheduler)
    assert output.finished_req_ids == {"a"}
    assert scheduler.schedule().finished_req_ids == set()


def test_abort_accepts_str_and_iterables():
    scheduler = make_scheduler()
    for request in make_requests(4):
        scheduler.add_request(request)
    scheduler.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests(["1"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests({"2"}, RequestStatus.FINISHED_ABORTED)
    assert list(scheduler.requests) == ["3"]


def test_abort_between_schedule_and_update_drops_the_output():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 5))
    scheduler.add_request(make_request("b", [2] * 5))
    output = scheduler.schedule()
    model_output = runner_output(scheduler, output)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(output, model_output)
    assert [o.request_id for o in outputs] == ["b"]
    assert scheduler.schedule().finished_req_ids == {"a"}


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
def test_finish_sets_status(status):
    scheduler = make_scheduler()
    request = make_request("a", [1] * 5)
    scheduler.add_request(request)
    scheduler.finish_requests("a", status)
    assert request.status == status


def test_stop_inside_a_multi_token_output_cuts_a_copy_and_leaves_the_runner_lists_alone():
    """The scheduler reads the runner's sampled lists without copying them; a stop that drops tokens returns
    a new list. Two requests share one sampled list object: one stops inside it, the other keeps all of it."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("stops", [1] * 4, max_tokens=10))
    scheduler.add_request(make_request("goes_on", [2] * 4, max_tokens=10, ignore_eos=True))
    output = scheduler.schedule()
    shared = [5, EOS, 9]
    req_ids = list(output.num_scheduled_tokens)
    model_output = ModelRunnerOutput(
        req_ids, {req_id: i for i, req_id in enumerate(req_ids)}, [shared, shared]
    )
    outputs = {o.request_id: o for o in scheduler.update_from_output(output, model_output)}
    assert outputs["stops"].new_token_ids == [5, EOS]
    assert outputs["stops"].finish_reason == "stop"
    assert outputs["goes_on"].new_token_ids == [5, EOS, 9]
    assert outputs["goes_on"].finish_reason is None
    assert shared == [5, EOS, 9]
    assert scheduler.requests["goes_on"].output_token_ids == [5, EOS, 9]


def test_steady_decoding_sends_no_token_lists_and_shares_one_empty_list():
    """Slot runner, steady decoding: every cached request's `new_token_ids` is empty (the worker feeds its own
    samples), and the scheduler allocates no list per request for that."""
    scheduler = make_scheduler(max_num_seqs=8)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 5, max_tokens=20, ignore_eos=True))
    step(scheduler)  # prefill
    output, _ = step(scheduler)
    new_token_ids = output.scheduled_cached_reqs.new_token_ids
    assert len(new_token_ids) == 4
    assert all(chunk == [] for chunk in new_token_ids)
    assert len({id(chunk) for chunk in new_token_ids}) == 1
