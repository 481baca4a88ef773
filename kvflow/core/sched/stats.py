"""The scheduler's own counters (beside `SchedulerStats`, the snapshot it reports)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups at admission: prompt tokens queried and tokens found in the cache.

    Only a request's first admission counts: its recompute after a preemption would hit the blocks it wrote
    itself (vLLM #25780). Requests that skip the cache (prompt logprobs) look nothing up and count nothing.
    Invariant: `num_hit_tokens <= num_query_tokens`; all three counts only grow.
    """

    num_queries: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a first admission's lookup: `num_query_tokens` looked up, `num_hit_tokens` of them cached."""
        self.num_queries += 1
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens
