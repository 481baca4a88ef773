"""RequestMetrics: wall-clock times (like time.time() and vLLM's arrival_time) in order, whatever the front end."""

from __future__ import annotations

import asyncio
import time

from kvflow import LLM, AsyncLLM, RequestOutput, SamplingParams

OPTIONS = dict(max_model_len=64, num_kv_blocks=32, block_size=4)
PROMPT = {"prompt_token_ids": [3, 1, 4, 1, 5]}


def assert_wall_clock_in_order(output: RequestOutput, started: float, ended: float) -> None:
    metrics = output.metrics
    assert metrics is not None
    assert metrics.first_token_time is not None and metrics.finished_time is not None
    assert (
        started
        <= metrics.arrival_time
        <= metrics.first_token_time
        <= metrics.finished_time
        <= ended
    )


def test_llm_metrics_are_wall_clock_times() -> None:
    llm = LLM("hash", **OPTIONS)
    started = time.time()
    outputs = llm.generate(
        [PROMPT, PROMPT], [SamplingParams(max_tokens=3), SamplingParams(n=2)], use_tqdm=False
    )
    ended = time.time()
    for output in outputs:  # the second is a parallel-sampling parent
        assert_wall_clock_in_order(output, started, ended)


def test_async_llm_metrics_are_wall_clock_times() -> None:
    async def run() -> tuple[RequestOutput, float, float]:
        engine = AsyncLLM("hash", **OPTIONS)
        try:
            started = time.time()
            outputs = [out async for out in engine.generate(PROMPT, SamplingParams(max_tokens=4))]
            return outputs[-1], started, time.time()
        finally:
            engine.shutdown()

    assert_wall_clock_in_order(*asyncio.run(run()))
