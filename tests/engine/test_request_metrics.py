"""RequestMetrics: wall-clock times (like time.time() and vLLM's arrival_time) in order, whatever the front end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvflow import LLM, AsyncLLM, RequestOutput, SamplingParams
from kvflow.core.sched.output import SchedulerStats
from kvflow.engine.stats import FinishedRequestStats, IterationStats
from kvflow.outputs import RequestMetrics

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


# ------------------------------------------------------------------------------------------------ lifecycle
class FinishedStats:
    """A StatLogger that keeps every finished request's stats and the latest scheduler snapshot."""

    def __init__(self) -> None:
        self.finished: list[FinishedRequestStats] = []
        self.scheduler_stats: SchedulerStats | None = None

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.finished += iteration_stats.finished_requests
        self.scheduler_stats = scheduler_stats


def assert_lifecycle_in_order(metrics: RequestMetrics | None) -> None:
    """arrival <= queued <= first scheduled <= first token <= last token <= finished, all set."""
    assert metrics is not None
    stamps = [
        metrics.arrival_time,
        metrics.queued_time,
        metrics.first_scheduled_time,
        metrics.first_token_time,
        metrics.last_token_time,
        metrics.finished_time,
    ]
    assert None not in stamps, metrics
    assert stamps == sorted(stamps), metrics  # type: ignore[type-var]


def test_llm_metrics_follow_the_request_through_the_core() -> None:
    llm = LLM("hash", **OPTIONS)
    outputs = llm.generate(
        [PROMPT, PROMPT], [SamplingParams(max_tokens=3), SamplingParams(n=2)], use_tqdm=False
    )
    for output in outputs:  # the second is a parallel-sampling parent
        assert_lifecycle_in_order(output.metrics)
        assert output.metrics is not None and output.metrics.num_preemptions == 0


def test_preemptions_under_kv_pressure_are_counted_per_request() -> None:
    # 12 blocks of 4 tokens for 6 requests that each grow to 5 + 20 tokens: some are preempted and recompute.
    llm = LLM("hash", max_model_len=32, num_kv_blocks=12, block_size=4, max_num_seqs=6)
    prompts = [{"prompt_token_ids": [i, 1, 4, 1, 5]} for i in range(6)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    preemptions = [output.metrics.num_preemptions for output in outputs if output.metrics]
    assert sum(preemptions) == llm.scheduler_stats()[0].num_preemptions_total > 0
    for output in outputs:
        assert_lifecycle_in_order(output.metrics)


def test_finished_request_stats_split_the_request_into_phases() -> None:
    stat_logger = FinishedStats()

    async def run() -> list[RequestOutput]:
        engine = AsyncLLM(
            "hash",
            stat_loggers=[stat_logger],
            disable_log_stats=True,
            max_model_len=32,
            num_kv_blocks=12,
            block_size=4,
            max_num_seqs=6,
        )
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        try:
            streams = [
                collect(engine.generate({"prompt_token_ids": [i, 2, 7]}, params, str(i)))
                for i in range(6)
            ]
            return [outputs[-1] for outputs in await asyncio.gather(*streams)]
        finally:
            engine.shutdown()

    finals = asyncio.run(run())
    assert len(stat_logger.finished) == 6
    for stats in stat_logger.finished:
        phases = (stats.queue_time, stats.prefill_time, stats.decode_time, stats.inference_time)
        assert all(phase is not None and phase >= 0 for phase in phases), stats
        assert stats.inference_time == pytest.approx(stats.prefill_time + stats.decode_time)
        assert stats.time_to_first_token is not None
        assert stats.queue_time + stats.prefill_time <= stats.time_to_first_token + 1e-6
        assert stats.inference_time <= stats.e2e_latency
    total = sum(stats.num_preemptions for stats in stat_logger.finished)
    assert stat_logger.scheduler_stats is not None
    assert total == stat_logger.scheduler_stats.num_preemptions_total > 0
    assert total == sum(output.metrics.num_preemptions for output in finals if output.metrics)


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in stream]
