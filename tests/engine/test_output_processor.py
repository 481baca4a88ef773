"""OutputProcessor: output kinds, finish handling, aborts."""

from __future__ import annotations

import time

import pytest

from kvflow.core.sched.output import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    LogprobsLists,
)
from kvflow.engine.output_processor import OutputProcessor
from kvflow.outputs import Logprob, RequestOutput
from kvflow.sampling_params import SamplingParams


def step(processor: OutputProcessor, engine_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
    processed = processor.process_outputs(engine_outputs)
    assert processed.reqs_to_abort == []  # no stop strings: the core decides every finish
    return processed.request_outputs


def processor_with(output_kind: str) -> OutputProcessor:
    processor = OutputProcessor()
    processor.add_request("a", None, [1, 2], SamplingParams(output_kind=output_kind))  # type: ignore[arg-type]
    return processor


def test_cumulative_outputs_grow_and_finish_once() -> None:
    processor = processor_with("cumulative")
    first = step(processor, [EngineCoreOutput("a", [5])])
    last = step(processor, [EngineCoreOutput("a", [6], finish_reason="length")])
    assert first[0].outputs[0].token_ids == [5] and not first[0].finished
    assert last[0].outputs[0].token_ids == [5, 6] and last[0].finished
    assert last[0].outputs[0].finish_reason == "length"
    assert not processor.has_unfinished_requests()
    assert step(processor, [EngineCoreOutput("a", [7])]) == []


def test_delta_outputs_carry_only_new_tokens() -> None:
    processor = processor_with("delta")
    deltas = [
        step(processor, [EngineCoreOutput("a", tokens)])[0].outputs[0].token_ids
        for tokens in ([5], [6, 7])
    ]
    assert deltas == [[5], [6, 7]]


def test_final_only_emits_nothing_until_finished() -> None:
    processor = processor_with("final_only")
    assert step(processor, [EngineCoreOutput("a", [5])]) == []
    final = step(processor, [EngineCoreOutput("a", [6], finish_reason="stop", stop_reason=6)])
    assert final[0].outputs[0].token_ids == [5, 6] and final[0].outputs[0].stop_reason == 6


def test_session_chunk_end_does_not_finish_the_request() -> None:
    processor = processor_with("cumulative")
    out = step(
        processor, [EngineCoreOutput("a", [5], finish_reason="length", session_continues=True)]
    )
    assert not out[0].finished and processor.has_unfinished_requests()


def test_abort_returns_partial_output_with_abort_reason() -> None:
    processor = processor_with("cumulative")
    step(processor, [EngineCoreOutput("a", [5])])
    aborted = processor.abort_requests(["a", "unknown"])
    assert len(aborted) == 1
    assert aborted[0].outputs[0].token_ids == [5] and aborted[0].outputs[0].finish_reason == "abort"
    assert aborted[0].finished


def test_finished_only_builds_just_the_final_output_with_everything() -> None:
    for output_kind in ("cumulative", "delta"):
        processor = processor_with(output_kind)
        assert (
            processor.process_outputs(
                [EngineCoreOutput("a", [5])], finished_only=True
            ).request_outputs
            == []
        )
        assert (
            processor.process_outputs(
                [EngineCoreOutput("a", [6])], finished_only=True
            ).request_outputs
            == []
        )
        [final] = processor.process_outputs(
            [EngineCoreOutput("a", [7], finish_reason="length")], finished_only=True
        ).request_outputs
        assert final.finished and final.outputs[0].token_ids == [5, 6, 7], output_kind


# ------------------------------------------------------------------------------------------------ lifecycle
def event(kind: EngineCoreEventType, timestamp: float) -> EngineCoreEvent:
    return EngineCoreEvent(kind, timestamp)


def test_core_events_become_wall_clock_metrics_and_finished_phases() -> None:
    processor = OutputProcessor()
    arrival = time.monotonic() - 100.0  # stamps in the past: the phases below are exact, not timed
    processor.add_request("a", None, [1, 2], SamplingParams(), arrival_time=arrival)
    events = [
        event(EngineCoreEventType.QUEUED, arrival + 1.0),
        event(EngineCoreEventType.SCHEDULED, arrival + 4.0),
        event(EngineCoreEventType.PREEMPTED, arrival + 5.0),
    ]
    [first] = step(processor, [EngineCoreOutput("a", [5], events=events)])
    metrics = first.metrics
    assert metrics is not None and metrics.num_preemptions == 1
    assert metrics.queued_time == pytest.approx(metrics.arrival_time + 1.0)
    assert metrics.first_scheduled_time == pytest.approx(metrics.arrival_time + 4.0)
    assert metrics.last_token_time == metrics.first_token_time
    preempted_again = [event(EngineCoreEventType.PREEMPTED, arrival + 99.0)]
    processed = processor.process_outputs(
        [EngineCoreOutput("a", [6], finish_reason="length", events=preempted_again)]
    )
    [stats] = processed.iteration_stats.finished_requests
    [last] = processed.request_outputs
    assert last.metrics is metrics and metrics.num_preemptions == 2 == stats.num_preemptions
    assert metrics.first_token_time is not None and metrics.last_token_time is not None
    assert stats.queue_time == pytest.approx(3.0)
    assert stats.prefill_time == pytest.approx(
        metrics.first_token_time - metrics.first_scheduled_time
    )
    assert stats.decode_time == pytest.approx(metrics.last_token_time - metrics.first_token_time)
    assert stats.inference_time == pytest.approx(stats.prefill_time + stats.decode_time)
    assert stats.prefill_time >= 96.0


def test_a_request_never_scheduled_has_no_phases() -> None:
    processor = OutputProcessor()
    processor.add_request("a", None, [1, 2], SamplingParams())
    processed = processor.process_outputs([EngineCoreOutput("a", [], finish_reason="abort")])
    [stats] = processed.iteration_stats.finished_requests
    phases = (stats.queue_time, stats.prefill_time, stats.decode_time, stats.inference_time)
    assert phases == (None, None, None, None) and stats.num_preemptions == 0


def test_a_parent_reports_its_samples_earliest_stamps_and_all_their_preemptions() -> None:
    processor = OutputProcessor()
    arrival = time.monotonic() - 50.0
    params = SamplingParams(n=2)
    parent = processor.add_parent_request("p", 2, None, [1, 2], "cumulative", arrival)
    for index in range(2):
        processor.add_request(
            f"{index}_p", None, [1, 2], params, arrival, parent=parent, index=index
        )
    step(
        processor,
        [
            EngineCoreOutput(
                "1_p",
                [5],
                events=[
                    event(EngineCoreEventType.QUEUED, arrival + 1.0),
                    event(EngineCoreEventType.SCHEDULED, arrival + 3.0),
                    event(EngineCoreEventType.PREEMPTED, arrival + 4.0),
                ],
            ),
            EngineCoreOutput(
                "0_p",
                [7],
                events=[
                    event(EngineCoreEventType.QUEUED, arrival + 2.0),
                    event(EngineCoreEventType.SCHEDULED, arrival + 2.5),
                    event(EngineCoreEventType.PREEMPTED, arrival + 6.0),
                ],
            ),
        ],
    )
    metrics = parent.metrics
    assert metrics.queued_time == pytest.approx(metrics.arrival_time + 1.0)
    assert metrics.first_scheduled_time == pytest.approx(metrics.arrival_time + 2.5)
    assert metrics.num_preemptions == 2


# ------------------------------------------------------------------------------------------------ prompt logprobs
def prompt_rows(start_index: int, tokens: list[int]) -> LogprobsLists:
    """Rows whose actual token ranks 2 behind token 0 (the top-1), with made-up logprobs."""
    return LogprobsLists(
        [[token, 0] for token in tokens],
        [[-2.0 - i, -0.5] for i, _ in enumerate(tokens)],
        [2 for _ in tokens],
        start_index=start_index,
    )


def test_prompt_logprobs_assemble_one_entry_per_prompt_token() -> None:
    processor = OutputProcessor()
    processor.add_request("a", None, [9, 3, 4], SamplingParams(prompt_logprobs=1))
    [first] = step(
        processor, [EngineCoreOutput("a", [5], new_prompt_logprobs=prompt_rows(1, [3, 4]))]
    )
    [second] = step(processor, [EngineCoreOutput("a", [6])])
    assert first.prompt_logprobs == [
        None,
        {3: Logprob(-2.0, 2), 0: Logprob(-0.5, 1)},
        {4: Logprob(-3.0, 2), 0: Logprob(-0.5, 1)},
    ]
    assert second.prompt_logprobs == first.prompt_logprobs  # cumulative: on every output after
    assert [list(entry) for entry in first.prompt_logprobs[1:]] == [[3, 0], [4, 0]]  # actual first


def test_prompt_logprobs_of_a_delta_stream_come_once() -> None:
    processor = processor_with("delta")
    processor.add_request("b", None, [1, 2], SamplingParams(prompt_logprobs=0, output_kind="delta"))
    [first] = step(processor, [EngineCoreOutput("b", [5], new_prompt_logprobs=prompt_rows(1, [2]))])
    [second] = step(processor, [EngineCoreOutput("b", [6])])
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 2
    assert second.prompt_logprobs is None
    [plain] = step(processor, [EngineCoreOutput("a", [5])])
    assert plain.prompt_logprobs is None  # not asked


def test_a_one_token_prompt_has_just_the_none_entry() -> None:
    processor = OutputProcessor()
    processor.add_request("a", None, [9], SamplingParams(prompt_logprobs=3))
    [first] = step(processor, [EngineCoreOutput("a", [5])])
    assert first.prompt_logprobs == [None]
