"""Scheduler basics: token budget, max_num_seqs, chunked prefill, ordering, and end-to-end token correctness."""

from __future__ import annotations

import pytest
from sched_helpers import SimWorker, run_to_completion, runner_output, step

from kvflow.core.sched.output import ModelRunnerOutput
from kvflow.core.sched.scheduler import Scheduler
from kvflow.request import RequestStatus
from kvflow.testing import make_request, make_requests, make_scheduler
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.worker_slots import WorkerSlots


def test_token_budget_is_respected_and_last_admission_is_chunked():
    scheduler = make_scheduler(max_num_batched_tokens=25, max_model_len=128)
    for request in make_requests(3, num_tokens=10):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"0": 10, "1": 10, "2": 5}
    assert output.total_num_scheduled_tokens == 25


def test_token_budget_respected_every_step_of_a_run():
    scheduler = make_scheduler(max_num_batched_tokens=24, max_model_len=256)
    for i in range(6):
        scheduler.add_request(make_request(str(i), [i + 1] * (7 + 9 * i), max_tokens=5))
    totals: list[int] = []
    tokens = run_to_completion(
        scheduler, on_step=lambda output, _: totals.append(output.total_num_scheduled_tokens)
    )
    assert max(totals) == 24
    for i in range(6):
        assert tokens[str(i)] == reference_tokens([i + 1] * (7 + 9 * i), 5)


def test_max_num_seqs_extra_requests_wait():
    scheduler = make_scheduler(max_num_seqs=2)
    for request in make_requests(4, max_tokens=3):
        scheduler.add_request(request)
    output, _ = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"0", "1"}
    assert [request.request_id for request in scheduler.waiting] == ["2", "3"]
    assert all(scheduler.requests[i].status == RequestStatus.WAITING for i in ("2", "3"))


def test_max_num_seqs_waiting_request_admitted_when_slot_frees():
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add_request(make_request("short", [1] * 4, max_tokens=1))
    scheduler.add_request(make_request("long", [2] * 4, max_tokens=5))
    scheduler.add_request(make_request("late", [3] * 4, max_tokens=2))
    output, outputs = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"short", "long"}
    assert [o.request_id for o in outputs if o.finished] == ["short"]
    output, _ = step(scheduler)
    assert output.finished_req_ids == {"short"}
    assert [new_req.req_id for new_req in output.scheduled_new_reqs] == ["late"]


def test_max_num_seqs_never_exceeded_over_a_run():
    scheduler = make_scheduler(max_num_seqs=3)
    for request in make_requests(10, max_tokens=4):
        scheduler.add_request(request)
    slots = WorkerSlots(3)
    num_running: list[int] = []
    tokens = run_to_completion(
        scheduler,
        slots=slots,
        on_step=lambda output, _: num_running.append(len(output.num_scheduled_tokens)),
    )
    assert max(num_running) == 3
    assert tokens == {str(i): reference_tokens([i] * 10, 4) for i in range(10)}


def test_long_prefill_token_threshold_caps_each_chunk():
    scheduler = make_scheduler(long_prefill_token_threshold=8)
    scheduler.add_request(make_request("a", list(range(20)), max_tokens=2))
    scheduled = []
    for _ in range(3):
        output, _ = step(scheduler)
        scheduled.append(output.num_scheduled_tokens["a"])
    assert scheduled == [8, 8, 4]


def test_long_prefill_threshold_does_not_cap_other_requests_budget():
    scheduler = make_scheduler(
        max_num_batched_tokens=20, max_model_len=128, long_prefill_token_threshold=8
    )
    scheduler.add_request(make_request("a", [1] * 30))
    scheduler.add_request(make_request("b", [2] * 30))
    scheduler.add_request(make_request("c", [3] * 30))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 8, "b": 8, "c": 4}


def test_chunked_prefill_splits_long_prompt_with_before_step_counts():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=128)
    prompt = list(range(100, 140))
    scheduler.add_request(make_request("a", prompt, max_tokens=3))

    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 16}
    assert [(r.req_id, r.num_computed_tokens) for r in output.scheduled_new_reqs] == [("a", 0)]
    assert scheduler.requests["a"].num_computed_tokens == 16  # advanced inside schedule()
    model_output = runner_output(scheduler, output)
    assert model_output.sampled_token_ids == [[]]  # partial prefill samples nothing
    assert scheduler.update_from_output(output, model_output) == []

    output, outputs = step(scheduler)
    assert output.scheduled_new_reqs == []
    assert output.scheduled_cached_reqs.req_ids == ["a"]
    assert output.scheduled_cached_reqs.num_computed_tokens == [16]
    assert output.num_scheduled_tokens == {"a": 16}
    assert outputs == []

    output, outputs = step(scheduler)
    assert output.scheduled_cached_reqs.num_computed_tokens == [32]
    assert output.num_scheduled_tokens == {"a": 8}
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [
        ("a", reference_tokens(prompt, 1))
    ]

    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1}
    assert output.scheduled_cached_reqs.num_computed_tokens == [40]
    assert output.scheduled_cached_reqs.num_output_tokens == [1]


def test_chunked_prefill_produces_reference_tokens():
    scheduler = make_scheduler(max_num_batched_tokens=7, max_model_len=128)
    prompt = list(range(50))
    scheduler.add_request(make_request("a", prompt, max_tokens=6))
    worker = SimWorker.for_scheduler(scheduler)
    assert run_to_completion(scheduler, worker=worker) == {"a": reference_tokens(prompt, 6)}


def test_without_chunked_prefill_prompt_is_not_split_and_nothing_jumps_the_queue():
    scheduler = make_scheduler(
        max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False
    )
    scheduler.add_request(make_request("a", [1] * 20, max_tokens=4))
    scheduler.add_request(make_request("b", [2] * 20, max_tokens=4))
    scheduler.add_request(make_request("c", [3] * 5, max_tokens=4))
    output, _ = step(scheduler)
    # b (20) does not fit in the remaining 12 tokens and is not split; c (5) would fit but must not overtake b.
    assert output.num_scheduled_tokens == {"a": 20}
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 20, "c": 5}


def test_without_chunked_prefill_tokens_are_correct():
    scheduler = make_scheduler(
        max_num_batched_tokens=40, max_model_len=40, enable_chunked_prefill=False
    )
    prompts = {str(i): [i + 7] * (10 + 7 * i) for i in range(4)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=3))

    def check_whole_prompts(output, _):
        for new_req in output.scheduled_new_reqs:
            assert output.num_scheduled_tokens[new_req.req_id] == len(new_req.prompt_token_ids)

    tokens = run_to_completion(scheduler, on_step=check_whole_prompts)
    assert tokens == {req_id: reference_tokens(prompt, 3) for req_id, prompt in prompts.items()}


def test_running_requests_are_scheduled_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=10, max_model_len=256)
    scheduler.add_request(make_request("old", [1] * 10, max_tokens=8))
    step(scheduler)
    scheduler.add_request(make_request("new", [2] * 100, max_tokens=8))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"old": 1, "new": 9}
    assert list(output.num_scheduled_tokens) == ["old", "new"]


def test_running_partial_prefill_continues_before_new_admissions():
    scheduler = make_scheduler(max_num_batched_tokens=10, max_model_len=256)
    scheduler.add_request(make_request("first", [1] * 30))
    step(scheduler)
    scheduler.add_request(make_request("second", [2] * 3))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"first": 10}
    assert scheduler.requests["second"].status == RequestStatus.WAITING


def test_new_request_data_carries_prompt_and_block_ids():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", list(range(10))))
    output = scheduler.schedule()
    (new_req,) = output.scheduled_new_reqs
    assert new_req.prompt_token_ids == list(range(10))
    assert new_req.prefill_token_ids is None
    assert len(new_req.block_ids[0]) == 3
    assert new_req.block_ids == scheduler.kv_cache_manager.get_block_ids("a")


def test_decode_step_gets_new_block_only_at_block_boundary():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", [5] * 7, max_tokens=4))
    step(scheduler)  # 7 prompt tokens in 2 blocks
    output, _ = step(scheduler)  # position 7: still block 2
    assert output.scheduled_cached_reqs.new_block_ids == [None]
    output, _ = step(scheduler)  # position 8: needs a third block
    (new_block_ids,) = output.scheduled_cached_reqs.new_block_ids
    assert new_block_ids is not None and len(new_block_ids[0]) == 1
    assert scheduler.kv_cache_manager.get_block_ids("a")[0][-1] == new_block_ids[0][0]


def test_many_requests_produce_reference_tokens():
    scheduler = make_scheduler(
        max_num_seqs=4, max_num_batched_tokens=32, block_size=4, max_model_len=256
    )
    prompts = {str(i): [(i * 31 + j) % 97 for j in range(3 + 5 * i)] for i in range(8)}
    max_tokens = {str(i): 1 + i for i in range(8)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=max_tokens[req_id]))
    worker = SimWorker.for_scheduler(scheduler)
    tokens = run_to_completion(scheduler, worker=worker, slots=WorkerSlots(4))
    assert tokens == {
        req_id: reference_tokens(prompt, max_tokens[req_id]) for req_id, prompt in prompts.items()
    }
    assert scheduler.requests == {}
    assert scheduler.kv_cache_manager.usage == 0.0


def test_get_num_unfinished_requests_counts_waiting_and_running():
    scheduler = make_scheduler(max_num_seqs=1)
    assert not scheduler.has_unfinished_requests()
    for request in make_requests(3, max_tokens=2):
        scheduler.add_request(request)
    assert scheduler.get_num_unfinished_requests() == 3
    step(scheduler)
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 2
    assert scheduler.get_num_unfinished_requests() == 3


def test_empty_schedule_when_idle():
    scheduler = make_scheduler()
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {}
    assert output.total_num_scheduled_tokens == 0
    assert scheduler.update_from_output(output, ModelRunnerOutput.make_empty()) == []


@pytest.mark.parametrize("use_v2_model_runner", [True, False])
def test_num_output_tokens_in_cached_data(use_v2_model_runner):
    scheduler = make_scheduler(use_v2_model_runner=use_v2_model_runner)
    scheduler.add_request(make_request("a", [3] * 5, max_tokens=5))
    num_output_tokens = []
    run_to_completion(
        scheduler,
        on_step=lambda output, _: num_output_tokens.extend(
            output.scheduled_cached_reqs.num_output_tokens
        ),
    )
    assert num_output_tokens == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------ common prefix blocks
def _scheduler_counting_common_prefix_blocks(**kwargs) -> Scheduler:
    config_source = make_scheduler(**kwargs)
    return Scheduler(
        config_source.scheduler_config,
        config_source.cache_config,
        compute_common_prefix_blocks=True,
    )


def test_common_prefix_blocks_not_counted_by_default():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", [*range(8), 20, 21]))
    scheduler.add_request(make_request("b", [*range(8), 30, 31]))
    step(scheduler)
    output = scheduler.schedule()
    assert output.num_common_prefix_blocks == []


def test_common_prefix_blocks_counted_when_asked():
    scheduler = _scheduler_counting_common_prefix_blocks(block_size=4)
    assert scheduler.schedule().num_common_prefix_blocks == [0]  # nothing running
    scheduler.add_request(make_request("a", [*range(8), 20, 21]))
    step(scheduler)
    scheduler.add_request(make_request("b", [*range(8), 30, 31]))
    output, _ = step(scheduler)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 8  # "b" shares a's first two blocks
    assert output.num_common_prefix_blocks == [2]
