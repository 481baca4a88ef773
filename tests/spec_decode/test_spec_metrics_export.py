"""Speculative-decoding counts leave the engine as Prometheus counters (`kvflow:spec_decode_*`, differences of the
cumulative snapshots, per engine core) and as vLLM's "SpecDecoding metrics" line in the periodic stats log."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvflow.core.sched.output import SchedulerStats
from kvflow.engine.stat_logger import LoggingStatLogger
from kvflow.engine.stats import IterationStats
from kvflow.entrypoints.openai.metrics import PrometheusStatLogger
from kvflow.spec_decode.metrics import SpecDecodingStats


@dataclasses.dataclass
class StandInSchedulerStats(SchedulerStats):
    """SchedulerStats with the speculative-decoding field, for a tree where the scheduler has not added it yet."""

    spec_decoding_stats: SpecDecodingStats | None = None


def snapshot(spec: SpecDecodingStats | None, engine_index: int = 0) -> SchedulerStats:
    """A scheduler snapshot carrying `spec` (the real SchedulerStats once it has the field)."""
    has_field = "spec_decoding_stats" in {f.name for f in dataclasses.fields(SchedulerStats)}
    stats_type = SchedulerStats if has_field else StandInSchedulerStats
    return stats_type(  # type: ignore[call-arg]
        num_running_reqs=1,
        num_waiting_reqs=0,
        kv_cache_usage=0.1,
        prefix_cache_query_tokens=0,
        prefix_cache_hit_tokens=0,
        num_preemptions_total=0,
        engine_index=engine_index,
        spec_decoding_stats=spec,
    )


def spec(k: int, *drafts: tuple[int, int]) -> SpecDecodingStats:
    stats = SpecDecodingStats(num_spec_tokens=k)
    for drafted, accepted in drafts:
        stats.observe_draft(drafted, accepted)
    return stats


# ------------------------------------------------------------------------------------------------ Prometheus
def sample(
    metrics: PrometheusStatLogger, name: str, engine: str = "0", **labels: str
) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})


def test_counters_follow_the_cumulative_snapshots() -> None:
    metrics = PrometheusStatLogger("m")
    assert (
        sample(metrics, "kvflow:spec_decode_num_drafts_total") is None
    )  # no speculation: no samples
    metrics.record(snapshot(spec(3)), IterationStats())
    assert (
        sample(metrics, "kvflow:spec_decode_num_drafts_total") == 0
    )  # present at 0 from the start
    assert (
        sample(metrics, "kvflow:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 0
    )
    metrics.record(snapshot(spec(3, (3, 2), (3, 0))), IterationStats())
    metrics.record(snapshot(spec(3, (3, 2), (3, 0), (2, 2))), IterationStats())
    assert sample(metrics, "kvflow:spec_decode_num_drafts_total") == 3
    assert sample(metrics, "kvflow:spec_decode_num_draft_tokens_total") == 8
    assert sample(metrics, "kvflow:spec_decode_num_accepted_tokens_total") == 4
    per_pos = [
        sample(metrics, "kvflow:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(3)
    ]
    assert per_pos == [2, 2, 0]
    text = metrics.render().decode()
    assert (
        'kvflow:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0'
        in text
    )
    assert "# TYPE kvflow:spec_decode_num_drafts_total counter" in text


def test_an_older_snapshot_counts_nothing_twice() -> None:
    metrics = PrometheusStatLogger("m")
    newer, older = spec(2, (2, 2), (2, 1)), spec(2, (2, 2))
    metrics.record(snapshot(newer), IterationStats())
    metrics.refresh([snapshot(older)], metrics.refresh_token())
    assert sample(metrics, "kvflow:spec_decode_num_drafts_total") == 2
    assert sample(metrics, "kvflow:spec_decode_num_accepted_tokens_total") == 3


def test_each_engine_core_has_its_own_samples() -> None:
    metrics = PrometheusStatLogger("m", num_engines=2)
    metrics.record(snapshot(spec(2, (2, 1)), engine_index=0), IterationStats())
    metrics.record(snapshot(spec(2, (2, 2), (2, 2)), engine_index=1), IterationStats())
    assert sample(metrics, "kvflow:spec_decode_num_drafts_total", engine="0") == 1
    assert sample(metrics, "kvflow:spec_decode_num_drafts_total", engine="1") == 2
    assert sample(metrics, "kvflow:spec_decode_num_accepted_tokens_total", engine="1") == 4


def test_snapshots_without_the_field_still_work() -> None:
    metrics = PrometheusStatLogger("m")
    metrics.record(SchedulerStats(2, 1, 0.5, 10, 4, 0), IterationStats(num_generation_tokens=3))
    assert sample(metrics, "kvflow:prefix_cache_hits_total") == 4
    assert sample(metrics, "kvflow:spec_decode_num_drafts_total") is None


# ------------------------------------------------------------------------------------------------ the log line
def test_the_periodic_log_adds_the_spec_decoding_line_for_the_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    stat_logger = LoggingStatLogger(interval_s=10.0, clock=lambda: now[0])
    live = spec(3, (3, 3))  # the first interval's drafts: one, all accepted
    with caplog.at_level(logging.INFO, logger="kvflow.engine.stat_logger"):
        now[0] = 10.0
        stat_logger.record(snapshot(live), IterationStats(num_generation_tokens=4))
        # The scheduler keeps counting in the same object: the logger must have kept its own copy.
        live.observe_draft(3, 1)
        live.observe_draft(2, 0)
        now[0] = 20.0
        stat_logger.record(snapshot(live), IterationStats(num_generation_tokens=3))
        now[0] = 30.0
        stat_logger.record(snapshot(live), IterationStats(num_generation_tokens=1))  # no new draft
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    spec_lines = [line for line in lines if line.startswith("SpecDecoding metrics")]
    assert spec_lines == [
        "SpecDecoding metrics: Mean acceptance length: 4.00, Accepted throughput: 0.30 tokens/s, "
        "Drafted throughput: 0.30 tokens/s, Accepted: 3 tokens, Drafted: 3 tokens, "
        "Per-position acceptance rate: 1.000, 1.000, 1.000, Avg Draft acceptance rate: 100.0%",
        "SpecDecoding metrics: Mean acceptance length: 1.50, Accepted throughput: 0.10 tokens/s, "
        "Drafted throughput: 0.50 tokens/s, Accepted: 1 tokens, Drafted: 5 tokens, "
        "Per-position acceptance rate: 0.500, 0.000, 0.000, Avg Draft acceptance rate: 20.0%",
    ]
    assert sum(line.startswith("Avg prompt throughput") for line in lines) == 3


def test_no_spec_line_without_speculation(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    stat_logger = LoggingStatLogger(interval_s=1.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvflow.engine.stat_logger"):
        now[0] = 1.0
        stat_logger.record(snapshot(None), IterationStats(num_generation_tokens=4))
        now[0] = 2.0
        stat_logger.record(
            SchedulerStats(1, 0, 0.1, 0, 0, 0), IterationStats(num_generation_tokens=4)
        )
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 2 and not any("SpecDecoding" in line for line in lines)


def test_data_parallel_cores_are_summed_in_the_line(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    stat_logger = LoggingStatLogger(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvflow.engine.stat_logger"):
        stat_logger.record(
            snapshot(spec(2, (2, 2)), engine_index=0), IterationStats(num_generation_tokens=3)
        )
        now[0] = 10.0
        stat_logger.record(
            snapshot(spec(2, (2, 0)), engine_index=1), IterationStats(num_generation_tokens=1)
        )
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SpecDecoding")]
    assert (
        "Accepted: 2 tokens, Drafted: 4 tokens" in line and "Mean acceptance length: 2.00" in line
    )
