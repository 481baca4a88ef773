"""AsyncLLM end to end on the default model: text streaming, stop strings, session chunks as text, and a weight
update between pause and resume."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kvflow import SamplingParams, StreamingInput
from kvflow.engine.async_llm import AsyncLLM
from tests.engine.async_llm_helpers import (
    ChunkFeed,
    collect,
    read_chunk,
    run,
    tokens_of,
)


# ------------------------------------------------------------------------------------------------ default model
@pytest.fixture(scope="module", params=[False, True], ids=["inproc", "proc"])
def text_llm(request: pytest.FixtureRequest) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(
        max_model_len=256, num_kv_blocks=64, max_num_seqs=4, engine_process=request.param
    )
    yield engine
    engine.shutdown()


def greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kwargs)


def test_default_model_streams_text_and_honours_stop_strings(text_llm: AsyncLLM) -> None:
    text = "The quick brown fox jumps over the lazy dog. Once upon a time"

    async def main() -> None:
        full = (await collect(text_llm, text, greedy(max_tokens=30)))[-1].outputs[0]
        assert full.text == text_llm.get_tokenizer().decode(full.token_ids) and full.text
        delta = await collect(text_llm, text, greedy(max_tokens=30, output_kind="delta"))
        assert "".join(output.outputs[0].text for output in delta) == full.text
        stop = full.text[8:11]
        first_match = full.text.index(stop)
        stopped = await collect(
            text_llm, text, greedy(max_tokens=30, stop=[stop], output_kind="delta")
        )
        assert "".join(output.outputs[0].text for output in stopped) == full.text[:first_match]
        assert stopped[-1].finished and stopped[-1].outputs[0].finish_reason == "stop"
        assert stopped[-1].outputs[0].stop_reason == stop
        assert not await text_llm.run_in_engine(
            lambda core: core.scheduler.requests
        )  # aborted in the core

    run(main())


def test_default_model_session_chunks_stream_text_and_a_stop_string_ends_the_session(
    text_llm: AsyncLLM,
) -> None:
    tokenizer = text_llm.get_tokenizer()
    first, second = "Once upon a time", " there was a fox"

    async def main() -> None:
        feed = ChunkFeed()
        stream = text_llm.generate(feed.items(), greedy(max_tokens=6, output_kind="delta"))
        feed.queue.put_nowait(StreamingInput(first))
        chunk = await read_chunk(stream)
        assert "".join(output.outputs[0].text for output in chunk) == tokenizer.decode(
            tokens_of(chunk, "delta")
        )
        feed.queue.put_nowait(
            StreamingInput({"prompt": second, "prompt_token_ids": tokenizer.encode(second)})
        )
        chunk = await read_chunk(stream)
        assert (
            chunk[-1].prompt == second
            and len(tokens_of(chunk, "delta")) == 6
            and not chunk[-1].finished
        )
        feed.end()
        assert [output.finished for output in [output async for output in stream]] == [True]

        full = (await collect(text_llm, first, greedy(max_tokens=30)))[-1].outputs[0].text
        stop = full[8:11]
        feed = ChunkFeed()
        feed.queue.put_nowait(StreamingInput(first, greedy(max_tokens=30, stop=[stop])))
        outputs = await collect(text_llm, feed.items())
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "stop"
        assert outputs[-1].outputs[0].text == full[: full.index(stop)]
        await asyncio.sleep(0.02)
        assert feed.closed and not await text_llm.run_in_engine(
            lambda core: core.scheduler.requests
        )

    run(main())


def test_default_model_weight_update_between_pause_and_resume(text_llm: AsyncLLM) -> None:
    async def main() -> None:
        before = (await collect(text_llm, "Hello", greedy(max_tokens=4)))[-1].outputs[0]
        await text_llm.pause_generation(mode="keep")
        version = await text_llm.update_weights(str(text_llm.model_info.path))
        assert version >= 1
        await text_llm.resume_generation()
        after = (await collect(text_llm, "Hello", greedy(max_tokens=4)))[-1].outputs[0]
        assert (
            after.weight_versions == [version] and after.token_ids == before.token_ids
        )  # same weights reloaded

    run(main())
