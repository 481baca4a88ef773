"""The scheduler's side of prompt logprobs: no prefix-cache reads for such requests, and rows that reach the front
end once, complete and in order, on the request's first output token, however the prompt was chunked, preempted or
recomputed.

The model runner is played by `prompt_rows`: for every scheduled request that asks, the rows of the prompt positions
the step computes (from the worker's view: the step's `num_computed_tokens`), tagged by `attempt` so a test can tell
which computation a row came from.
"""

from __future__ import annotations

import msgspec
from sched_helpers import runner_output

from kvflow.core.sched.output import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from kvflow.core.sched.scheduler import Scheduler
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams
from kvflow.testing import make_request, make_scheduler

PROMPT = list(range(100, 120))  # 20 tokens: rows for tokens 1..19


def logprobs_request(request_id: str, prompt: list[int], num_logprobs: int = 1) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=num_logprobs)
    return Request(request_id, prompt, params, eos_token_id=None)


def computed_before(output: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's computed-token count before the step, as the worker sees it."""
    counts = {new_req.req_id: new_req.num_computed_tokens for new_req in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    counts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return counts


def prompt_rows(
    scheduler: Scheduler, output: SchedulerOutput, attempt: int
) -> dict[str, LogprobsLists]:
    """Rows for the prompt positions each asking request computes; row of token i has logprob -i - 1000 * attempt."""
    rows: dict[str, LogprobsLists] = {}
    for req_id, first in computed_before(output).items():
        request = scheduler.requests[req_id]
        if request.sampling_params.prompt_logprobs is None or request.num_output_tokens:
            continue
        stop = min(first + output.num_scheduled_tokens[req_id], request.num_prompt_tokens - 1)
        tokens = range(first + 1, stop + 1)
        if tokens:
            rows[req_id] = LogprobsLists(
                [[request.prompt_token_ids[i]] for i in tokens],
                [[-i - 1000.0 * attempt] for i in tokens],
                [1 for _ in tokens],
                start_index=first + 1,
            )
    return rows


def run_step(
    scheduler: Scheduler, attempt: int = 0
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    output = scheduler.schedule()
    model_output: ModelRunnerOutput = runner_output(scheduler, output)
    model_output.prompt_logprobs_dict = prompt_rows(scheduler, output, attempt) or None
    return output, scheduler.update_from_output(output, model_output)


def outputs_of(engine_outputs: list[EngineCoreOutput], request_id: str) -> list[EngineCoreOutput]:
    return [output for output in engine_outputs if output.request_id == request_id]


def test_chunked_prompt_rows_arrive_complete_with_the_first_token() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=8, max_model_len=64)
    scheduler.add_request(logprobs_request("a", PROMPT))
    for _ in range(2):  # prompt positions 0-7 and 8-15: partial prefills, no output
        _, engine_outputs = run_step(scheduler)
        assert outputs_of(engine_outputs, "a") == []
    _, engine_outputs = run_step(scheduler)
    [first] = outputs_of(engine_outputs, "a")
    assert len(first.new_token_ids) == 1
    rows = first.new_prompt_logprobs
    assert rows is not None and rows.start_index == 1
    assert rows.logprob_token_ids == [[token] for token in PROMPT[1:]]
    assert rows.logprobs == [[-float(i)] for i in range(1, 20)]
    _, engine_outputs = run_step(scheduler)
    [second] = outputs_of(engine_outputs, "a")
    assert second.new_token_ids and second.new_prompt_logprobs is None


def test_recompute_after_preemption_keeps_each_row_once() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=8, max_model_len=64)
    scheduler.add_request(logprobs_request("a", PROMPT))
    run_step(scheduler, attempt=0)  # tokens 1..8
    assert scheduler.reset_prefix_cache(reset_running_requests=True)  # preempted mid-prefill
    engine_outputs: list[EngineCoreOutput] = []
    while not engine_outputs:
        output, engine_outputs = run_step(scheduler, attempt=1)  # recomputes from token 1
        assert all(new.num_computed_tokens == 0 for new in output.scheduled_new_reqs)
    [first] = engine_outputs
    rows = first.new_prompt_logprobs
    assert rows is not None and rows.start_index == 1
    # Tokens 1..8 keep the first computation's rows; 9..19 come from the recompute.
    assert rows.logprobs == [[-float(i)] for i in range(1, 9)] + [
        [-i - 1000.0] for i in range(9, 20)
    ]
    assert [event.type for event in first.events or []] == [
        EngineCoreEventType.QUEUED,
        EngineCoreEventType.SCHEDULED,
        EngineCoreEventType.PREEMPTED,
    ]


def test_prompt_logprobs_request_reads_no_prefix_cache_but_fills_it() -> None:
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("plain", PROMPT))
    run_step(scheduler)
    queries_before = scheduler.prefix_cache_stats.num_queries
    scheduler.add_request(logprobs_request("scored", PROMPT))
    output, engine_outputs = run_step(scheduler)
    [new_req] = output.scheduled_new_reqs
    assert new_req.num_computed_tokens == 0 and output.num_scheduled_tokens["scored"] == 20
    assert outputs_of(engine_outputs, "scored")[0].num_cached_tokens == 0
    assert scheduler.prefix_cache_stats.num_queries == queries_before  # no lookup, no query
    # Its own blocks go into the cache: a later plain request with its prompt hits them.
    other = [7, *PROMPT[1:]]
    scheduler.add_request(logprobs_request("scored2", other))
    run_step(scheduler)
    scheduler.add_request(make_request("reader", [*other, 1]))
    output, _ = run_step(scheduler)
    [reader] = output.scheduled_new_reqs
    assert reader.num_computed_tokens == 20


def test_one_token_prompt_has_no_rows() -> None:
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(logprobs_request("a", [5]))
    _, engine_outputs = run_step(scheduler)
    [first] = engine_outputs
    assert first.new_token_ids and first.new_prompt_logprobs is None


def test_engine_core_output_with_rows_and_events_round_trips_through_msgspec() -> None:
    output = EngineCoreOutput(
        "a",
        [5],
        new_prompt_logprobs=LogprobsLists([[3, 9]], [[-0.5, -0.1]], [2], start_index=1),
        events=[
            EngineCoreEvent(EngineCoreEventType.QUEUED, 12.5),
            EngineCoreEvent(EngineCoreEventType.SCHEDULED, 12.75),
        ],
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=EngineCoreOutput)
    assert decoded == output
    assert decoded.events is not None and decoded.events[1].type is EngineCoreEventType.SCHEDULED


def test_rows_of_a_finished_namesake_in_flight_are_ignored() -> None:
    scheduler = make_scheduler(
        block_size=4, max_num_batched_tokens=8, max_model_len=64, async_scheduling=True
    )
    scheduler.add_request(logprobs_request("a", PROMPT))
    first_plan = scheduler.schedule()  # tokens 1..8 of the old "a"
    first_rows = prompt_rows(scheduler, first_plan, attempt=0)
    second_plan = scheduler.schedule()  # tokens 9..16, still in flight
    second_rows = prompt_rows(scheduler, second_plan, attempt=0)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    new_prompt = list(range(300, 320))
    scheduler.add_request(logprobs_request("a", new_prompt))  # the id is reused at once
    new_plan = scheduler.schedule()
    new_rows = prompt_rows(scheduler, new_plan, attempt=1)
    for plan, rows in ((first_plan, first_rows), (second_plan, second_rows)):
        stale = runner_output(scheduler, plan)
        stale.prompt_logprobs_dict = rows
        assert scheduler.update_from_output(plan, stale) == []
    assert scheduler.requests["a"].prompt_logprobs_rows is None  # other tokens, then a gap: ignored
    fresh = runner_output(scheduler, new_plan)
    fresh.prompt_logprobs_dict = new_rows
    scheduler.update_from_output(new_plan, fresh)
    held = scheduler.requests["a"].prompt_logprobs_rows
    assert held is not None and held.logprob_token_ids == [[token] for token in new_prompt[1:9]]
