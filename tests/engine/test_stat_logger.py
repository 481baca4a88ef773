"""Periodic stats in the log: throughput, running / waiting, KV usage, prefix-cache hits, preemption warnings."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from kvflow import LLM, AsyncLLM, SamplingParams
from kvflow.core.sched.output import SchedulerStats
from kvflow.engine.stat_logger import LoggingStatLogger, log_stats_interval_s
from kvflow.engine.stats import IterationStats


class Records(logging.Handler):
    """Collects the stat logger's records (attached to its logger directly, whatever kvflow's log setup)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [record.getMessage() for record in self.records if record.levelno == level]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    stat_logger = logging.getLogger("kvflow.engine.stat_logger")
    previous_level = stat_logger.level
    stat_logger.addHandler(handler)
    stat_logger.setLevel(logging.INFO)
    yield handler
    stat_logger.removeHandler(handler)
    stat_logger.setLevel(previous_level)


def stats(
    running: int, waiting: int, usage: float, queried: int, hits: int, preemptions: int
) -> SchedulerStats:
    return SchedulerStats(running, waiting, usage, queried, hits, preemptions)


def test_a_line_per_interval_with_the_interval_rates(records: Records) -> None:
    now = [100.0]
    stat_logger = LoggingStatLogger(interval_s=10.0, clock=lambda: now[0])
    busy = stats(running=3, waiting=2, usage=0.25, queried=1000, hits=400, preemptions=0)
    stat_logger.record(busy, IterationStats(num_prompt_tokens=400, num_generation_tokens=50))
    now[0] += 4.0
    stat_logger.record(busy, IterationStats(num_prompt_tokens=100, num_generation_tokens=100))
    assert not records.records  # not due yet
    now[0] += 6.0
    stat_logger.record(busy, IterationStats(num_generation_tokens=50))  # due: logs this interval
    [line] = records.messages(logging.INFO)
    assert line == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%"
    )
    # The next interval's hit rate covers only its own lookups: 100 queried, 90 found.
    now[0] += 10.0
    stat_logger.record(
        stats(running=1, waiting=0, usage=0.5, queried=1100, hits=490, preemptions=0),
        IterationStats(num_generation_tokens=10),
    )
    assert records.messages(logging.INFO)[-1].endswith("Prefix cache hit rate: 90.0%")
    assert not records.messages(logging.WARNING)


def test_an_idle_interval_is_quiet_and_preemptions_warn(records: Records) -> None:
    now = [0.0]
    stat_logger = LoggingStatLogger(interval_s=5.0, clock=lambda: now[0])
    now[0] += 5.0
    stat_logger.log(stats(0, 0, 0.0, 0, 0, preemptions=0))
    assert not records.records
    now[0] += 5.0
    stat_logger.record(stats(4, 6, 1.0, 0, 0, preemptions=7), IterationStats(10, 10))
    [warning] = records.messages(logging.WARNING)
    assert warning.startswith("7 requests were preempted in the last 5 s (7 since startup)")
    now[0] += 5.0
    stat_logger.log(stats(0, 0, 0.0, 0, 0, preemptions=7))  # no new preemptions: no new warning
    assert len(records.messages(logging.WARNING)) == 1


def test_a_line_covers_every_data_parallel_engine(records: Records) -> None:
    now = [0.0]
    stat_logger = LoggingStatLogger(interval_s=5.0, clock=lambda: now[0])
    first = stats(running=3, waiting=1, usage=0.2, queried=100, hits=50, preemptions=0)
    second = stats(running=2, waiting=0, usage=0.4, queried=100, hits=0, preemptions=2)
    second.engine_index = 1
    stat_logger.record(first, IterationStats(num_generation_tokens=10))
    now[0] += 5.0
    stat_logger.record(second, IterationStats(num_generation_tokens=15))
    [line] = records.messages(logging.INFO)
    assert line.endswith(
        "Running: 5 reqs, Waiting: 1 reqs, KV cache usage: 30.0%, Prefix cache hit rate: 25.0%"
    )
    [warning] = records.messages(logging.WARNING)
    assert warning.startswith("2 requests were preempted")


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert log_stats_interval_s() == 10.0
    monkeypatch.setenv("KVFLOW_LOG_STATS_INTERVAL", "2.5")
    assert log_stats_interval_s() == 2.5
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv("KVFLOW_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="KVFLOW_LOG_STATS_INTERVAL"):
            log_stats_interval_s()


def prompts(count: int) -> list[dict[str, list[int]]]:
    return [
        {"prompt_token_ids": [(index * 7 + j) % 300 + 1 for j in range(24)]}
        for index in range(count)
    ]


def test_llm_logs_stats_while_busy_and_warns_when_the_cache_forces_preemption(
    records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLOW_LOG_STATS_INTERVAL", "0.000001")
    # 8 slots but KV for about 3 full requests: running requests preempt each other.
    llm = LLM("hash", max_num_seqs=8, num_kv_blocks=48, block_size=4, max_model_len=64)
    llm.generate(prompts(8), SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    lines = records.messages(logging.INFO)
    assert lines and all(line.startswith("Avg prompt throughput: ") for line in lines)
    assert any("Running: " in line and "KV cache usage: " in line for line in lines)
    assert llm.scheduler_stats()[0].num_preemptions_total > 0
    assert any("requests were preempted" in line for line in records.messages(logging.WARNING))
    quiet = LLM(
        "hash",
        max_num_seqs=8,
        num_kv_blocks=48,
        block_size=4,
        max_model_len=64,
        disable_log_stats=True,
    )
    records.records.clear()
    quiet.generate(prompts(8), SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert not records.records


def test_async_llm_logs_stats_while_busy(records: Records, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_LOG_STATS_INTERVAL", "0.000001")

    async def main() -> None:
        async with AsyncLLM(
            "hash", max_num_seqs=4, num_kv_blocks=256, block_size=4, max_model_len=256
        ) as llm:
            async for _ in llm.generate(
                prompts(1)[0], SamplingParams(max_tokens=16, ignore_eos=True)
            ):
                pass

    asyncio.run(asyncio.wait_for(main(), 60))
    lines = records.messages(logging.INFO)
    assert lines and lines[0].startswith("Avg prompt throughput: ")


class Collector:
    """A metrics backend that keeps what it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[SchedulerStats, IterationStats]] = []

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.calls.append((scheduler_stats, iteration_stats))


def test_async_llm_feeds_every_stat_logger_per_step_figures() -> None:
    collector = Collector()
    prompt = prompts(1)[0]

    async def main() -> None:
        async with AsyncLLM(
            "hash",
            stat_loggers=[collector],
            max_num_seqs=4,
            num_kv_blocks=256,
            block_size=4,
            max_model_len=256,
        ) as llm:
            async for _ in llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True)):
                pass

    asyncio.run(asyncio.wait_for(main(), 60))
    iterations = [iteration for _, iteration in collector.calls]
    assert sum(iteration.num_generation_tokens for iteration in iterations) == 6
    assert sum(iteration.num_prompt_tokens for iteration in iterations) == len(
        prompt["prompt_token_ids"]
    )
    [time_to_first_token] = [
        ttft for iteration in iterations for ttft in iteration.time_to_first_tokens
    ]
    inter_token_latencies = [
        itl for iteration in iterations for itl in iteration.inter_token_latencies
    ]
    assert (
        time_to_first_token > 0
        and len(inter_token_latencies) == 5
        and min(inter_token_latencies) >= 0
    )
    [finished] = [done for iteration in iterations for done in iteration.finished_requests]
    assert (finished.finish_reason, finished.num_generation_tokens, finished.num_prompt_tokens) == (
        "length",
        6,
        24,
    )
    assert finished.time_to_first_token == pytest.approx(time_to_first_token, abs=1e-6)
    assert finished.e2e_latency >= finished.time_to_first_token
    assert (
        collector.calls[0][0].num_running_reqs == 1 and collector.calls[-1][0].num_running_reqs == 0
    )
