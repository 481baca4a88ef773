"""OutputStream: outputs coalesce for a consumer that falls behind (deltas concatenated, cumulative replaced, never
across a finish reason), exceptions come after the outputs put before them, and one engine step wakes every
consumer of an event loop with one call."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from kvflow.engine.output_stream import OutputStream, Wakeups, merge_outputs
from kvflow.lora.request import LoRARequest
from kvflow.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def output(
    tokens: list[int],
    text: str,
    index: int = 0,
    finish_reason: str | None = None,
    finished: bool = False,
    logprob: float | None = None,
) -> RequestOutput:
    logprobs = None if logprob is None else [{t: Logprob(logprob, 1, str(t))} for t in tokens]
    completion = CompletionOutput(
        index, text, tokens, finish_reason, None, logprobs, logprob, weight_versions=[0]
    )
    return RequestOutput("r", "p", [1, 2], [completion], finished, RequestMetrics(0.0))


def test_merging_keeps_every_field_of_the_output_types() -> None:
    """merge_outputs builds new objects field by field: a field added to the output types must be merged too."""
    assert [f.name for f in dataclasses.fields(RequestOutput)] == [
        "request_id",
        "prompt",
        "prompt_token_ids",
        "outputs",
        "finished",
        "metrics",
        "prompt_logprobs",
        "lora_request",
    ]
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index",
        "text",
        "token_ids",
        "finish_reason",
        "stop_reason",
        "logprobs",
        "cumulative_logprob",
        "weight_versions",
        "client_error",
    ]


def test_deltas_concatenate_per_completion_and_cumulative_outputs_replace() -> None:
    first, second = output([1], "a", logprob=-1.0), output([2, 3], "bc", logprob=-2.0)
    second.prompt_logprobs = None
    first.prompt_logprobs = [None, {2: Logprob(-0.5)}]
    merged = merge_outputs(first, second, delta=True)
    [completion] = merged.outputs
    assert (completion.token_ids, completion.text, completion.cumulative_logprob) == (
        [1, 2, 3],
        "abc",
        -2.0,
    )
    assert [list(position) for position in completion.logprobs or []] == [[1], [2], [3]]
    assert merged.prompt_logprobs == first.prompt_logprobs  # a delta stream carries them once
    adapter = LoRARequest("tuned", 1, "/adapters/tuned")
    first.lora_request = second.lora_request = adapter
    assert merge_outputs(first, second, delta=True).lora_request == adapter
    assert first.outputs[0].token_ids == [1]  # the merged outputs were not changed in place
    other_sample = output([9], "z", index=1)
    both = merge_outputs(merged, other_sample, delta=True)
    assert [(c.index, c.token_ids) for c in both.outputs] == [(0, [1, 2, 3]), (1, [9])]
    assert merge_outputs(first, second, delta=False) is second


def run_consumer(stream_puts: list, delta: bool) -> list:
    """Put everything before the consumer looks, then take items until the stream ends."""

    async def main() -> list:
        stream = OutputStream(asyncio.get_running_loop(), delta=delta)
        for item in stream_puts:
            assert stream.put(item)
        taken = []
        while True:
            item = await asyncio.wait_for(
                stream.get(), 60
            )  # a stream that never ends fails, not hangs
            taken.append(item)
            if isinstance(item, BaseException) or item.finished:
                return taken

    return asyncio.run(main())


def test_a_consumer_behind_gets_one_output_for_what_it_missed_but_finish_reasons_stay_apart() -> (
    None
):
    chunk_end = output(
        [3], "c", finish_reason="length"
    )  # a streaming-input chunk's end: not finished
    taken = run_consumer(
        [
            output([1], "a"),
            output([2], "b"),
            chunk_end,
            output([4], "d"),
            output([5], "e", finish_reason="stop", finished=True),
        ],
        delta=True,
    )
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in taken] == [
        ([1, 2, 3], "length"),
        ([4, 5], "stop"),
    ]
    assert [o.finished for o in taken] == [False, True]


def test_an_exception_comes_after_the_outputs_put_before_it() -> None:
    error = ValueError("boom")
    taken = run_consumer([output([1], "a"), output([2], "b"), error], delta=False)
    assert taken[0].outputs[0].token_ids == [2] and taken[1] is error


class CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the callbacks other threads schedule on it."""

    num_threadsafe_calls = 0

    def call_soon_threadsafe(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.num_threadsafe_calls += 1
        return super().call_soon_threadsafe(*args, **kwargs)


@pytest.mark.parametrize("num_streams", [1, 50])
def test_one_step_wakes_every_waiting_consumer_of_a_loop_with_one_call(num_streams: int) -> None:
    loop = CountingLoop()
    streams = [OutputStream(loop, delta=True) for _ in range(num_streams)]
    waiting = threading.Event()

    async def consume(stream: OutputStream) -> RequestOutput:
        item = await stream.get()
        assert isinstance(item, RequestOutput)
        return item

    async def main() -> list[RequestOutput]:
        tasks = [asyncio.ensure_future(consume(stream)) for stream in streams]
        while not all(stream._waiter is not None for stream in streams):
            await asyncio.sleep(0)  # each consumer is parked on its waiter
        waiting.set()
        return await asyncio.gather(*tasks)

    def engine_step() -> None:
        assert waiting.wait(60), "the consumers never started waiting"
        wakeups = Wakeups()
        for index, stream in enumerate(streams):
            assert stream.put_deferred(output([index], str(index)), wakeups)
        assert wakeups.flush() == []

    producer = threading.Thread(target=engine_step)
    producer.start()
    try:
        results = loop.run_until_complete(asyncio.wait_for(main(), 60))
    finally:
        producer.join()
        loop.close()
    assert [r.outputs[0].token_ids for r in results] == [[i] for i in range(num_streams)]
    assert loop.num_threadsafe_calls == 1
    closed = OutputStream(loop)
    assert not closed.put(output([1], "a"))  # the consumer's loop is closed: it is gone
