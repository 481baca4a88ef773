"""AsyncLLM end to end: streaming-input sessions (chunks fed one by one or queued up front, aborts, consumers
leaving, chunks past max_model_len, input errors). The hash model is the oracle (exact tokens)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvflow.engine.async_llm import AsyncLLM
from kvflow.request import RequestStatus
from kvflow.testing.hash_model import reference_tokens
from tests.engine.async_llm_helpers import (
    LONG,
    ChunkFeed,
    collect,
    engine_snapshot,
    next_output,
    params,
    prompt,
    read_chunk,
    run,
    session_reference,
    tokens_of,
    wait_until_clean,
)

# ------------------------------------------------------------------------------------------------ sessions
CHUNKS = [([5, 6, 7, 8, 9, 10, 11, 12, 13], 3), ([21, 22, 23, 24, 25], 4), ([31, 32], 2)]


@pytest.mark.parametrize("output_kind", ["cumulative", "delta", "final_only"])
def test_session_waits_for_each_chunk_and_closes_after_the_input_ends(
    make_llm: Callable[..., AsyncLLM], output_kind: str
) -> None:
    llm = make_llm()
    chunks = [(CHUNKS[0][0], 3), (CHUNKS[1][0], 4), (CHUNKS[2][0], 4)]
    # chunk 0 runs with generate()'s params, chunk 1 brings its own, chunk 2 (None) reuses chunk 1's
    chunk_params = [None, params(4, output_kind), None]
    expected = session_reference(chunks)

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3, output_kind), request_id="session")
        for index, (chunk, _) in enumerate(chunks):
            feed.send(chunk, chunk_params[index])
            outputs = await read_chunk(stream)
            assert tokens_of(outputs, output_kind) == expected[index]
            assert outputs[-1].outputs[0].finish_reason == "length"
            assert not any(output.finished for output in outputs), (
                "a chunk end is not the session's end"
            )
            if output_kind == "final_only":
                assert len(outputs) == 1
            request = await llm.run_in_engine(lambda core: core.scheduler.requests["session"])
            assert request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
            with pytest.raises(
                ValueError, match="already in use"
            ):  # never mistaken for the session's next chunk
                await collect(llm, prompt(2), params(2), request_id="session")
            snapshot = await llm.run_in_engine(engine_snapshot)
            assert (
                snapshot["slot_holders"] == 1 and snapshot["usage"] > 0
            )  # it keeps its slot and blocks
            if (
                index == 0
            ):  # a cache-clearing pause releases the idle session; its next chunk recomputes
                await llm.pause_generation(mode="keep", clear_cache=True)
                assert (await llm.run_in_engine(engine_snapshot))["slot_holders"] == 0
                await llm.resume_generation()
        feed.end()
        [closing] = [output async for output in stream]
        assert closing.finished and closing.outputs[0].finish_reason == "length"
        assert closing.outputs[0].token_ids == ([] if output_kind == "delta" else expected[-1])
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize(
    ("async_scheduling", "use_v2_model_runner"), [(True, True), (False, True), (True, False)]
)
def test_session_with_all_chunks_queued_up_front(
    make_llm: Callable[..., AsyncLLM], async_scheduling: bool, use_v2_model_runner: bool
) -> None:
    llm = make_llm(async_scheduling=async_scheduling, use_v2_model_runner=use_v2_model_runner)
    expected = session_reference(CHUNKS)

    async def main() -> None:
        feed = ChunkFeed()
        for chunk, max_tokens in CHUNKS:
            feed.send(chunk, params(max_tokens))
        feed.end()
        outputs = await collect(llm, feed.items())
        chunk_ends = [output for output in outputs if output.outputs[0].finish_reason is not None]
        assert [output.outputs[0].token_ids for output in chunk_ends] == expected
        assert [output.finished for output in chunk_ends] == [False, False, True]
        assert outputs[-1] is chunk_ends[-1]  # the last chunk's end is the session's end
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("when", ["idle", "running", "paused_abort"])
def test_session_abort_ends_it_with_abort(make_llm: Callable[..., AsyncLLM], when: str) -> None:
    llm = make_llm()
    expected = session_reference([(CHUNKS[0][0], 3), ([40, 41], LONG)])

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3), request_id="session")
        feed.send(CHUNKS[0][0])
        await read_chunk(stream)
        if when == "running":
            feed.send([40, 41], params(LONG))
            await next_output(stream)
        if when == "paused_abort":
            await llm.pause_generation(mode="abort")
        else:
            await llm.abort("session")
        rest = [output async for output in stream]
        final = rest[-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        if when == "running":
            tokens = final.outputs[0].token_ids
            assert 1 <= len(tokens) < LONG and tokens == expected[1][: len(tokens)]
        else:
            assert rest == [final] and final.outputs[0].token_ids == expected[0]
        await asyncio.sleep(0.02)
        assert feed.closed, "the input iterator was not cancelled"
        if when == "paused_abort":
            await llm.resume_generation()
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("when", ["idle", "running"])
def test_session_consumer_leaving_cancels_input_and_frees_everything(
    make_llm: Callable[..., AsyncLLM], when: str
) -> None:
    llm = make_llm()

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3), request_id="session")
        feed.send(CHUNKS[0][0])
        await read_chunk(stream)
        if when == "running":
            feed.send([40, 41], params(LONG))
            await next_output(stream)
        assert (await llm.run_in_engine(engine_snapshot))["slot_holders"] == 1
        await stream.aclose()
        await wait_until_clean(llm)
        await asyncio.sleep(0.02)
        assert feed.closed

    run(main())


@pytest.mark.parametrize("queued", [False, True])
def test_session_chunk_past_max_model_len_raises_and_ends_it(
    make_llm: Callable[..., AsyncLLM], queued: bool
) -> None:
    llm = make_llm(max_model_len=64, num_kv_blocks=64)

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3), request_id="session")
        feed.send(list(range(1, 41)))
        if queued:
            feed.send(
                list(range(100, 125))
            )  # 40 + 2 kept outputs + 25 > 64, arrives while chunk 1 runs
        outputs = await read_chunk(stream)
        assert tokens_of(outputs) == reference_tokens(list(range(1, 41)), 3)
        if not queued:
            feed.send(list(range(100, 125)))
        with pytest.raises(ValueError, match="max_model_len=64"):
            await next_output(stream)
        await asyncio.sleep(0.02)
        assert feed.closed
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("when", ["first", "idle", "running"])
def test_session_input_error_is_raised_to_the_consumer(
    make_llm: Callable[..., AsyncLLM], when: str
) -> None:
    llm = make_llm()

    class Boom(Exception):
        pass

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3), request_id="session")
        if when != "first":
            feed.send(CHUNKS[0][0])
            await read_chunk(stream)
        if when == "running":
            feed.send([40, 41], params(LONG))
            await next_output(stream)
        feed.fail(Boom("input broke"))
        with pytest.raises(Boom, match="input broke"):
            async for output in stream:
                assert not output.finished
        await wait_until_clean(llm)
        # an invalid chunk is a ValueError, raised the same way
        bad = ChunkFeed()
        bad.send([1, -2])
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await collect(llm, bad.items(), request_id="session")
        with pytest.raises(ValueError, match="n=1"):
            await collect(llm, ChunkFeed().items(), params(3, n=2))

    run(main())
