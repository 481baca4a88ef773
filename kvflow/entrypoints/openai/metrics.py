"""Prometheus metrics for `kvflow serve`: a `StatLogger` fed by `AsyncLLM` after every engine step.

Names follow vLLM's with the `kvflow:` prefix, each labelled `model_name` (DESIGN.md's serving contract) and, as in
vLLM, `engine` (the data-parallel engine core it counts, "0" with one core: sums over `engine` are the server's
totals, and each core's gauges are its own):
gauges `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (a fraction, 1 = full, as vLLM),
`engine_alive` (1 while the engine core serves, 0 once it died: then the three gauges above are gone rather than
frozen at their last values);
counters `prompt_tokens_total`, `generation_tokens_total`, `request_success_total{finished_reason}`,
`num_preemptions_total`, `prefix_cache_queries_total`, `prefix_cache_hits_total` (prompt tokens looked up and found);
histograms `time_to_first_token_seconds` (from arrival at the front end), `inter_token_latency_seconds`,
`e2e_request_latency_seconds`, `request_queue_time_seconds`, `request_prefill_time_seconds`,
`request_decode_time_seconds`, `request_inference_time_seconds`, `request_time_per_output_token_seconds`,
`request_prompt_tokens`, `request_generation_tokens`. The queue / prefill / decode / inference histograms fill once
the front end reports those times in `FinishedRequestStats`.
Under speculative decoding (`SchedulerStats.spec_decoding_stats`), counters `spec_decode_num_drafts_total`,
`spec_decode_num_draft_tokens_total`, `spec_decode_num_accepted_tokens_total` and
`spec_decode_num_accepted_tokens_per_pos{position}` (drafts whose first position+1 tokens were accepted, position
from 0), created with the first snapshot that carries them.
With LoRA (`--enable-lora`: `max_loras` given), vLLM's info gauge `lora_requests_info{max_lora,
waiting_lora_adapters, running_lora_adapters}`: the names of the adapters that waiting and running requests use
(`SchedulerStats.waiting_lora_adapters` / `running_lora_adapters`), sorted and joined by ",", "" for none; its
value is the unix time of the snapshot (every step, and every scrape of an idle server). One series per core at a
time: when the adapters change, the previous label set is removed (set to 0 with several API server processes,
where nothing can be removed: the current series is the one with the largest value, as in vLLM). Without LoRA the
gauge does not exist.

Several API server processes (`kvflow serve --api-server-count N`): prometheus_client's multiprocess mode
(`PROMETHEUS_MULTIPROC_DIR`, set by the launcher before any API process imports prometheus_client, to a private
folder it removes at exit). Each process writes its own samples there, and `/metrics` from any process renders them
all: counters and histograms summed over processes (each request is recorded by the process that served it, so the
sums are exact); the load gauges (`num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc`) as the most
recently set value of any process (each engine core's snapshot is the same whoever reads it, and the /metrics
handler refreshes the asking process's from the scheduler); `engine_alive` as the minimum (0 once any process saw the
core die). The scheduler's running totals (prefix-cache tokens, preemptions, speculative-decoding counts) are
counted by API server 0 only, which gets every step's snapshot from the core: counted by every process they would
add up N times. A dead engine's load gauges are set to 0 there (multiprocess mode cannot remove a sample).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kvflow.core.sched.output import SchedulerStats
    from kvflow.engine.stats import FinishedRequestStats, IterationStats
    from kvflow.spec_decode.metrics import SpecDecodingStats

__all__ = ["CONTENT_TYPE_LATEST", "PrometheusStatLogger"]

FINISHED_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets (seconds).
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_tokens` (vLLM's 1-2-5 series for per-request token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_tokens:
                return buckets
            buckets.append(value)
        scale *= 10


class PrometheusStatLogger:
    """The server's metrics, in a `CollectorRegistry` of its own (no process-global state).

    `multiprocess`: one of several API server processes (see the module docstring); `counts_scheduler_totals`
    whether this process counts the scheduler's running totals (exactly one of them does).

    Invariants: every sample carries the `engine` label of the core it counts (`SchedulerStats.engine_index`;
    a step's iteration stats belong to the core whose step it was); counters only grow; each of a core's scheduler
    running totals (prefix-cache tokens, preemptions, speculative-decoding counts) is counted exactly once
    whatever the order its snapshots arrive in (a snapshot adds only what its total exceeds the largest seen from
    that core); the gauges never go back to a snapshot older than one already shown. `_lock` serializes the
    engines' output threads (`record`) and the /metrics handler (`refresh`). `_children[engine]` holds that core's
    labelled samples, made once: `record` runs after every engine step and looks none up.
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int = 1 << 20,
        num_engines: int = 1,
        multiprocess: bool = False,
        counts_scheduler_totals: bool = True,
        max_loras: int | None = None,
    ) -> None:
        """`num_engines`: the data-parallel engine cores, whose samples exist (at 0) before their first step;
        `max_loras`: the engine's LoRA slots (`LoRAConfig.max_loras`), None when LoRA is off (then no
        `lora_requests_info`)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.multiprocess = multiprocess
        self._counts_scheduler_totals = counts_scheduler_totals
        self._render_registry = self.registry
        if multiprocess:  # renders what every API process wrote
            self._render_registry = CollectorRegistry()
            MultiProcessCollector(self._render_registry)
        self._lock = threading.Lock()
        self._num_records = 0  # steps recorded so far
        # (running total, its labels) -> its sample and how much of it is counted
        self._counted_totals: dict[tuple[Counter, tuple[str, ...]], _CountedTotal] = {}
        self._children: dict[int, _EngineSamples] = {}
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str, multiprocess_mode: str = "mostrecent") -> Gauge:
            return Gauge(
                name, doc, labels, registry=self.registry, multiprocess_mode=multiprocess_mode
            )

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.running = gauge("kvflow:num_requests_running", "Requests being generated (holding KV)")
        self.waiting = gauge("kvflow:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = gauge(
            "kvflow:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%)"
        )
        self.engine_alive = gauge(
            "kvflow:engine_alive", "1 while the engine core serves, 0 once it has died", "min"
        )
        self._num_engines = num_engines
        self._engine_dead = False
        self._max_loras = max_loras
        self.lora_info: Gauge | None = None
        # engine index -> the label values of its current `lora_info` series
        self._lora_labels: dict[int, tuple[str, ...]] = {}
        if max_loras is not None:
            self.lora_info = Gauge(
                "kvflow:lora_requests_info",
                "LoRA adapters of the running and waiting requests (labels); the value is the snapshot's "
                "unix time",
                [*labels, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
                multiprocess_mode="mostrecent",
            )
        self.prompt_tokens = counter("kvflow:prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = counter("kvflow:generation_tokens", "Tokens generated")
        self.request_success = counter(
            "kvflow:request_success", "Requests finished, by reason", ("finished_reason",)
        )
        self.preemptions = counter("kvflow:num_preemptions", "Requests preempted (recomputed)")
        self.prefix_cache_queries = counter(
            "kvflow:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hits = counter(
            "kvflow:prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        self.spec_decode_num_drafts = counter(
            "kvflow:spec_decode_num_drafts",
            "Speculative drafts verified (one per request and step)",
        )
        self.spec_decode_num_draft_tokens = counter(
            "kvflow:spec_decode_num_draft_tokens", "Speculative tokens drafted"
        )
        self.spec_decode_num_accepted_tokens = counter(
            "kvflow:spec_decode_num_accepted_tokens", "Speculative tokens accepted"
        )
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "kvflow:spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose tokens up to this position (from 0) were all accepted",
            ("position",),
        )
        self.time_to_first_token = histogram(
            "kvflow:time_to_first_token_seconds",
            "Time from arrival at the front end to the first token",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "kvflow:inter_token_latency_seconds", "Time between two output tokens", ITL_BUCKETS
        )
        self.e2e_latency = histogram(
            "kvflow:e2e_request_latency_seconds",
            "Time from arrival to the finished output",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "kvflow:request_queue_time_seconds",
            "Time waiting before first scheduled",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "kvflow:request_prefill_time_seconds",
            "Time from first scheduled to the first token",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "kvflow:request_decode_time_seconds",
            "Time from the first token to the last",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "kvflow:request_inference_time_seconds",
            "Time from first scheduled to the last token",
            REQUEST_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "kvflow:request_time_per_output_token_seconds",
            "Decode time per output token after the first",
            ITL_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "kvflow:request_prompt_tokens",
            "Prompt tokens per request",
            token_buckets(max_model_len),
        )
        self.request_generation_tokens = histogram(
            "kvflow:request_generation_tokens",
            "Generated tokens per request",
            token_buckets(max_model_len),
        )
        for engine in range(num_engines):  # present (at 0) before the first request, as in vLLM
            self._samples(engine)
            for metric in (self.preemptions, self.prefix_cache_queries, self.prefix_cache_hits):
                metric.labels(model_name, str(engine))
            self.engine_alive.labels(model_name, str(engine)).set(1)

    def _samples(self, engine_index: int) -> _EngineSamples:
        """Core `engine_index`'s labelled samples, made on first use."""
        samples = self._children.get(engine_index)
        if samples is None:
            name = self.model_name, str(engine_index)
            samples = self._children[engine_index] = _EngineSamples(
                engine_label=name[1],
                running=self.running.labels(*name),
                waiting=self.waiting.labels(*name),
                kv_cache_usage=self.kv_cache_usage.labels(*name),
                prompt_tokens=self.prompt_tokens.labels(*name),
                generation_tokens=self.generation_tokens.labels(*name),
                time_to_first_token=self.time_to_first_token.labels(*name),
                inter_token_latency=self.inter_token_latency.labels(*name),
                e2e_latency=self.e2e_latency.labels(*name),
                phases=(
                    ("queue_time", self.queue_time.labels(*name)),
                    ("prefill_time", self.prefill_time.labels(*name)),
                    ("decode_time", self.decode_time.labels(*name)),
                    ("inference_time", self.inference_time.labels(*name)),
                ),
                time_per_output_token=self.time_per_output_token.labels(*name),
                request_prompt_tokens=self.request_prompt_tokens.labels(*name),
                request_generation_tokens=self.request_generation_tokens.labels(*name),
                request_success={
                    reason: self.request_success.labels(*name, reason)
                    for reason in FINISHED_REASONS
                },
            )
        return samples

    # ------------------------------------------------------------------------------------------------ StatLogger
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """One engine step (called on the engine's output thread)."""
        with self._lock:
            self._num_records += 1
            samples = self._samples(scheduler_stats.engine_index)
            self._apply(scheduler_stats, samples)
        if iteration_stats.num_prompt_tokens:
            samples.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        if iteration_stats.num_generation_tokens:
            samples.generation_tokens.inc(iteration_stats.num_generation_tokens)
        if iteration_stats.time_to_first_tokens:
            ttft = samples.time_to_first_token
            for seconds in iteration_stats.time_to_first_tokens:
                ttft.observe(seconds)
        if iteration_stats.inter_token_latencies:
            itl = samples.inter_token_latency
            for seconds in iteration_stats.inter_token_latencies:
                itl.observe(seconds)
        for finished in iteration_stats.finished_requests:
            self._record_finished(finished, samples)

    def refresh_token(self) -> int:
        """Call before asking the engine for a snapshot to `refresh` with."""
        return self._num_records

    def refresh(self, scheduler_stats: Iterable[SchedulerStats], token: int) -> None:
        """Apply snapshots taken outside `record` (aborts change the scheduler without an output step), one per
        engine core, unless a step was recorded since `token`: then the gauges may already show a snapshot more
        recent than one of these."""
        with self._lock:
            if token == self._num_records:
                for each in scheduler_stats:
                    self._apply(each, self._samples(each.engine_index))

    def mark_engine_dead(self) -> None:
        """The engine died: `engine_alive` is 0 and the load gauges, which nothing updates any more, are removed
        (idempotent; nothing changes them afterwards)."""
        with self._lock:
            if self._engine_dead:
                return
            self._engine_dead = True
            for engine in map(str, range(self._num_engines)):
                self.engine_alive.labels(self.model_name, engine).set(0)
                for gauge in (self.running, self.waiting, self.kv_cache_usage):
                    if self.multiprocess:  # no removal there: the last value would stay
                        gauge.labels(self.model_name, engine).set(0)
                    else:
                        gauge.remove(self.model_name, engine)
            for lora_labels in self._lora_labels.values():
                self._drop_lora_series(lora_labels)
            self._lora_labels.clear()

    def _apply(self, scheduler_stats: SchedulerStats, samples: _EngineSamples) -> None:
        """The gauges, and what the scheduler's running totals grew by (caller holds `_lock`)."""
        if self._engine_dead:
            return
        samples.running.set(scheduler_stats.num_running_reqs)
        samples.waiting.set(scheduler_stats.num_waiting_reqs)
        samples.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
        if self.lora_info is not None:
            self._apply_lora_info(scheduler_stats)
        if not self._counts_scheduler_totals:
            return
        name = self.model_name, str(scheduler_stats.engine_index)
        for counter, total in (
            (self.prefix_cache_queries, scheduler_stats.prefix_cache_query_tokens),
            (self.prefix_cache_hits, scheduler_stats.prefix_cache_hit_tokens),
            (self.preemptions, scheduler_stats.num_preemptions_total),
        ):
            self._count_total(counter, name, total)
        spec_stats = getattr(scheduler_stats, "spec_decoding_stats", None)
        if spec_stats is not None:
            self._apply_spec_decoding(spec_stats, name)

    def _apply_lora_info(self, scheduler_stats: SchedulerStats) -> None:
        """The core's `lora_requests_info` series, at the current time (caller holds `_lock`)."""
        assert self.lora_info is not None
        engine_index = scheduler_stats.engine_index
        lora_labels = (
            self.model_name,
            str(engine_index),
            str(self._max_loras),
            ",".join(sorted(scheduler_stats.waiting_lora_adapters)),
            ",".join(sorted(scheduler_stats.running_lora_adapters)),
        )
        previous = self._lora_labels.get(engine_index)
        if previous is not None and previous != lora_labels:
            self._drop_lora_series(previous)
        self._lora_labels[engine_index] = lora_labels
        self.lora_info.labels(*lora_labels).set_to_current_time()

    def _drop_lora_series(self, lora_labels: tuple[str, ...]) -> None:
        """Remove a `lora_requests_info` series (set it to 0 in multiprocess mode, where removal is impossible)."""
        assert self.lora_info is not None
        if self.multiprocess:
            self.lora_info.labels(*lora_labels).set(0)
        else:
            self.lora_info.remove(*lora_labels)

    def _apply_spec_decoding(self, spec_stats: SpecDecodingStats, name: tuple[str, str]) -> None:
        """What a core's speculative-decoding totals grew by (caller holds `_lock`)."""
        for counter, total in (
            (self.spec_decode_num_drafts, spec_stats.num_drafts),
            (self.spec_decode_num_draft_tokens, spec_stats.num_draft_tokens),
            (self.spec_decode_num_accepted_tokens, spec_stats.num_accepted_tokens),
        ):
            self._count_total(counter, name, total)
        for position, total in enumerate(spec_stats.num_accepted_tokens_per_pos):
            self._count_total(
                self.spec_decode_num_accepted_tokens_per_pos, (*name, str(position)), total
            )

    def _count_total(self, counter: Counter, labels: tuple[str, ...], total: int) -> None:
        """Count a running total's growth past the largest value seen for these labels (caller holds `_lock`);
        the sample exists (at 0 or more) from the first snapshot that carries the total."""
        key = (counter, labels)
        counted = self._counted_totals.get(key)
        if counted is None:
            counted = self._counted_totals[key] = _CountedTotal(counter.labels(*labels))
        if total > counted.total:
            counted.sample.inc(total - counted.total)
            counted.total = total

    def _record_finished(self, finished: FinishedRequestStats, samples: _EngineSamples) -> None:
        reason = finished.finish_reason
        if reason is not None:
            success = samples.request_success.get(reason)
            if success is None:  # a reason beyond FINISHED_REASONS
                name = self.model_name, samples.engine_label
                success = samples.request_success[reason] = self.request_success.labels(
                    *name, reason
                )
            success.inc()
        samples.e2e_latency.observe(finished.e2e_latency)
        samples.request_prompt_tokens.observe(finished.num_prompt_tokens)
        samples.request_generation_tokens.observe(finished.num_generation_tokens)
        # Lifecycle times: reported by newer front ends only.
        for field_name, histogram in samples.phases:
            seconds = getattr(finished, field_name, None)
            if seconds is not None:
                histogram.observe(seconds)
        decode_time = getattr(finished, "decode_time", None)
        if decode_time is not None and finished.num_generation_tokens > 1:
            samples.time_per_output_token.observe(
                decode_time / (finished.num_generation_tokens - 1)
            )

    # ------------------------------------------------------------------------------------------------ export
    def render(self) -> bytes:
        """The metrics in Prometheus' text format (`CONTENT_TYPE_LATEST`): this registry's, or in multiprocess
        mode every API process's."""
        return generate_latest(self._render_registry)


@dataclass
class _CountedTotal:
    """A scheduler running total's sample and how much of the total it has counted."""

    sample: Counter
    total: int = 0


@dataclass
class _EngineSamples:
    """One engine core's labelled samples (prometheus_client children), looked up once."""

    engine_label: str
    running: Gauge
    waiting: Gauge
    kv_cache_usage: Gauge
    prompt_tokens: Counter
    generation_tokens: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_latency: Histogram
    phases: tuple[tuple[str, Histogram], ...]  # (FinishedRequestStats field, its histogram)
    time_per_output_token: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    request_success: dict[str, Counter]
