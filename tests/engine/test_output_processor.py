"""OutputProcessor: output kinds, finish handling, aborts."""

from __future__ import annotations

from kvflow.core.sched.output import EngineCoreOutput
from kvflow.engine.output_processor import OutputProcessor
from kvflow.outputs import RequestOutput
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
