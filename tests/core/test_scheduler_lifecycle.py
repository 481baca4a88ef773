"""Lifecycle events on EngineCoreOutputs (queued, first scheduled, preempted) and prefix-cache statistics that a
recompute after preemption does not inflate."""

from __future__ import annotations

from collections import defaultdict

from sched_helpers import AsyncDriver, run_to_completion, step

from kvflow.core.sched.output import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput
from kvflow.testing import make_request, make_requests, make_scheduler
from kvflow.testing.hash_model import reference_tokens

QUEUED, SCHEDULED, PREEMPTED = (
    EngineCoreEventType.QUEUED,
    EngineCoreEventType.SCHEDULED,
    EngineCoreEventType.PREEMPTED,
)


def collect_events(
    events: dict[str, list[EngineCoreEvent]], engine_outputs: list[EngineCoreOutput]
) -> None:
    for output in engine_outputs:
        events[output.request_id] += output.events or []


def test_first_output_carries_queued_and_scheduled_then_nothing() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=8, max_model_len=64)
    scheduler.add_request(make_request("a", list(range(20)), max_tokens=3))
    outputs: list[EngineCoreOutput] = []
    while scheduler.has_unfinished_requests():
        _, engine_outputs = step(scheduler)
        outputs += engine_outputs
    assert (
        len(outputs) == 3
    )  # two partial prefills said nothing; the events waited for the first token
    events = outputs[0].events
    assert events is not None and [event.type for event in events] == [QUEUED, SCHEDULED]
    assert events[0].timestamp <= events[1].timestamp
    assert [output.events for output in outputs[1:]] == [None, None]


def test_preemptions_are_reported_once_each_and_scheduling_once() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=8, max_num_batched_tokens=64)
    requests = make_requests(4, num_tokens=7, max_tokens=16, ignore_eos=True)
    for request in requests:
        scheduler.add_request(request)
    events: dict[str, list[EngineCoreEvent]] = defaultdict(list)
    run_to_completion(scheduler, on_step=lambda _, outputs: collect_events(events, outputs))
    assert sum(request.num_preemptions for request in requests) >= 2
    for request in requests:
        types = [event.type for event in events[request.request_id]]
        assert types[:2] == [QUEUED, SCHEDULED]
        assert types[2:] == [PREEMPTED] * request.num_preemptions
        stamps = [event.timestamp for event in events[request.request_id]]
        assert stamps == sorted(stamps)


def test_async_scheduler_reports_the_same_events() -> None:
    scheduler = make_scheduler(
        block_size=4, num_blocks=8, max_num_batched_tokens=64, async_scheduling=True
    )
    requests = make_requests(4, num_tokens=7, max_tokens=16, ignore_eos=True)
    for request in requests:
        scheduler.add_request(request)
    driver = AsyncDriver(scheduler)
    events: dict[str, list[EngineCoreEvent]] = defaultdict(list)
    while scheduler.has_unfinished_requests() or driver.in_flight:
        if scheduler.has_unfinished_requests():
            driver.schedule()
        while driver.in_flight and (len(driver.in_flight) >= 2 or not scheduler.requests):
            collect_events(events, driver.update())
    assert driver.tokens == {
        r.request_id: reference_tokens([int(r.request_id)] * 7, 16) for r in requests
    }
    assert sum(request.num_preemptions for request in requests) >= 1
    for request in requests:
        types = [event.type for event in events[request.request_id]]
        assert types == [QUEUED, SCHEDULED] + [PREEMPTED] * request.num_preemptions


def test_streaming_session_chunk_is_queued_and_scheduled_again() -> None:
    scheduler = make_scheduler(block_size=4, max_model_len=64)
    scheduler.add_request(make_request("s", [1, 2, 3], max_tokens=2, resumable=True))
    events: dict[str, list[EngineCoreEvent]] = defaultdict(list)
    while scheduler.requests["s"].status.name != "WAITING_FOR_STREAMING_REQ":
        collect_events(events, step(scheduler)[1])
    scheduler.add_request(make_request("s", [4, 5], max_tokens=2, resumable=True))
    while scheduler.requests["s"].status.name != "WAITING_FOR_STREAMING_REQ":
        collect_events(events, step(scheduler)[1])
    assert [event.type for event in events["s"]] == [QUEUED, SCHEDULED, QUEUED, SCHEDULED]


def test_prefix_cache_stats_count_first_admissions_only_under_preemption() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=8, max_num_batched_tokens=64)
    prompts = {str(i): [50 + 20 * i + j for j in range(9)] for i in range(4)}  # no shared prefix
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=12, ignore_eos=True))
    recompute_hits: list[int] = []

    def watch(output, _outputs) -> None:  # type: ignore[no-untyped-def]
        recompute_hits.extend(
            new_req.num_computed_tokens
            for new_req in output.scheduled_new_reqs
            if new_req.prefill_token_ids is not None
        )

    tokens = run_to_completion(scheduler, on_step=watch)
    assert tokens == {req_id: reference_tokens(prompt, 12) for req_id, prompt in prompts.items()}
    # Resumed requests found their own blocks in the cache, but those lookups are not counted.
    assert recompute_hits and min(recompute_hits) > 0
    stats = scheduler.prefix_cache_stats
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (4, 36, 0)
    snapshot = scheduler.make_stats()
    assert (snapshot.prefix_cache_query_tokens, snapshot.prefix_cache_hit_tokens) == (36, 0)
    assert snapshot.num_preemptions_total == len(recompute_hits)
