"""Periodic engine statistics in the log, as vLLM prints them while it is busy."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvflow.core.sched.output import SchedulerStats

if TYPE_CHECKING:
    from kvflow.engine.stats import IterationStats
    from kvflow.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger(__name__)

DEFAULT_LOG_STATS_INTERVAL_S = 10.0
LOG_STATS_INTERVAL_ENV = "KVFLOW_LOG_STATS_INTERVAL"


def log_stats_interval_s() -> float:
    """Seconds between two stats lines: `$KVFLOW_LOG_STATS_INTERVAL`, else 10."""
    value = os.environ.get(LOG_STATS_INTERVAL_ENV)
    if value is None:
        return DEFAULT_LOG_STATS_INTERVAL_S
    try:
        interval = float(value)
    except ValueError:
        interval = -1.0
    if not interval > 0:
        raise ValueError(
            f"{LOG_STATS_INTERVAL_ENV} must be a positive number of seconds, got {value!r}"
        )
    return interval


class LoggingStatLogger:
    """A `StatLogger` that logs throughput and scheduler state at INFO every `interval_s` while tokens flow, and
    a warning when requests were preempted in an interval (the KV cache is too small for the load). Under
    speculative decoding (snapshots carrying `spec_decoding_stats`), a second INFO line gives vLLM's
    "SpecDecoding metrics" for the drafts verified in the interval.

    Invariants: `record` only adds counts (O(1)); a line covers exactly the tokens recorded since the previous
    line; nothing is logged for an interval without recorded tokens, so an idle engine stays quiet. With several
    data-parallel engine cores, a line covers all of them: requests and totals summed over each core's latest
    snapshot, KV cache usage their mean (the cores' caches are the same size).
    """

    def __init__(
        self, interval_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = log_stats_interval_s() if interval_s is None else interval_s
        self._clock = clock
        self._last_log_time = clock()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_stats: SchedulerStats | None = None
        self._latest: dict[int, SchedulerStats] = {}  # engine index -> its latest snapshot
        # A copy of the last line's speculative-decoding totals (a snapshot may share the live counters).
        self._last_spec_stats: SpecDecodingStats | None = None

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """Count one step's tokens; write the line when the interval is over (`StatLogger`)."""
        self._num_prompt_tokens += iteration_stats.num_prompt_tokens
        self._num_generation_tokens += iteration_stats.num_generation_tokens
        self._latest[scheduler_stats.engine_index] = scheduler_stats
        if self.due():
            self.log(scheduler_stats)

    def due(self) -> bool:
        return self._clock() - self._last_log_time >= self.interval_s

    def log(self, stats: SchedulerStats) -> None:
        """Write the line for the interval that ends now (call when `due()`), with `stats` the latest snapshot of
        its engine core."""
        self._latest[stats.engine_index] = stats
        stats = _combined(list(self._latest.values()))
        now = self._clock()
        elapsed = max(now - self._last_log_time, 1e-9)
        previous = self._last_stats
        if self._num_prompt_tokens or self._num_generation_tokens:
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                self._num_prompt_tokens / elapsed,
                self._num_generation_tokens / elapsed,
                stats.num_running_reqs,
                stats.num_waiting_reqs,
                100 * stats.kv_cache_usage,
                100 * _hit_rate(previous, stats),
            )
        num_preemptions = stats.num_preemptions_total - (
            previous.num_preemptions_total if previous else 0
        )
        if num_preemptions:
            logger.warning(
                "%d requests were preempted in the last %.0f s (%d since startup): the KV cache is too small "
                "for this load, and preempted requests recompute their tokens. Raise kv_cache_memory_bytes "
                "(or num_kv_blocks), or lower max_num_seqs",
                num_preemptions,
                elapsed,
                stats.num_preemptions_total,
            )
        self._log_spec_decoding(elapsed)
        self._last_log_time = now
        self._last_stats = stats
        self._num_prompt_tokens = self._num_generation_tokens = 0

    def _log_spec_decoding(self, elapsed: float) -> None:
        """The SpecDecoding line for the drafts verified since the previous line (none: no line)."""
        spec_stats = _combined_spec_stats(list(self._latest.values()))
        if spec_stats is None:
            return
        previous = self._last_spec_stats
        interval = spec_stats - previous if previous is not None else spec_stats
        if interval.num_drafts:
            logger.info("%s", interval.log_line(elapsed))
        self._last_spec_stats = spec_stats.copy()


def _combined_spec_stats(snapshots: list[SchedulerStats]) -> SpecDecodingStats | None:
    """The engine cores' speculative-decoding counts summed (None: no core speculates). Read with getattr, so a
    `SchedulerStats` without the field (older cores) is no speculation."""
    total: SpecDecodingStats | None = None
    for snapshot in snapshots:
        spec_stats = getattr(snapshot, "spec_decoding_stats", None)
        if spec_stats is not None:
            total = spec_stats.copy() if total is None else total + spec_stats
    return total


def _hit_rate(previous: SchedulerStats | None, stats: SchedulerStats) -> float:
    """The prefix-cache hit rate of the prompt tokens looked up in this interval."""
    queried = stats.prefix_cache_query_tokens - (
        previous.prefix_cache_query_tokens if previous else 0
    )
    hits = stats.prefix_cache_hit_tokens - (previous.prefix_cache_hit_tokens if previous else 0)
    return hits / queried if queried else 0.0


def _combined(snapshots: list[SchedulerStats]) -> SchedulerStats:
    """One snapshot of several engine cores: counts summed, KV cache usage averaged."""
    if len(snapshots) == 1:
        return snapshots[0]
    return SchedulerStats(
        num_running_reqs=sum(each.num_running_reqs for each in snapshots),
        num_waiting_reqs=sum(each.num_waiting_reqs for each in snapshots),
        kv_cache_usage=sum(each.kv_cache_usage for each in snapshots) / len(snapshots),
        prefix_cache_query_tokens=sum(each.prefix_cache_query_tokens for each in snapshots),
        prefix_cache_hit_tokens=sum(each.prefix_cache_hit_tokens for each in snapshots),
        num_preemptions_total=sum(each.num_preemptions_total for each in snapshots),
    )
