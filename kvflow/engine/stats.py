"""What the front end measures per step and per finished request, for the stats log and metrics backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvflow.core.sched.output import SchedulerStats


@dataclass
class FinishedRequestStats:
    """One core request that finished (stopped, capped or aborted); times in seconds.

    `e2e_latency` runs from arrival at the front end to the finished output; `time_to_first_token` from arrival to
    the first token. The phases (vLLM's): `queue_time` from being queued in the engine core to its first
    scheduling, `prefill_time` from then to the first token, `decode_time` from the first token to the last,
    `inference_time` from the first scheduling to the last token (prefill plus decode). Each is None when one of
    its ends never happened (no token came out, or the request was never scheduled). `num_preemptions` counts
    preemptions by recompute.
    """

    finish_reason: str | None
    e2e_latency: float
    time_to_first_token: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    queue_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    num_preemptions: int = 0


@dataclass
class IterationStats:
    """What one engine step's outputs added, as the front end saw them.

    `num_prompt_tokens` counts the prompts of requests whose first token arrived in this step (they were
    prefilled); `time_to_first_tokens` has one entry per such request (from its arrival at the front end);
    `inter_token_latencies` one entry per later token (time since the request's previous token).
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def add(self, other: IterationStats) -> None:
        """Fold in `other` (the same step's outputs processed separately)."""
        self.num_prompt_tokens += other.num_prompt_tokens
        self.num_generation_tokens += other.num_generation_tokens
        self.time_to_first_tokens += other.time_to_first_tokens
        self.inter_token_latencies += other.inter_token_latencies
        self.finished_requests += other.finished_requests


class StatLogger(Protocol):
    """A metrics backend: gets the scheduler's snapshot and the front end's figures after every step."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
