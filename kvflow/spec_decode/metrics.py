"""Speculative-decoding counters: how many drafts were verified and how much of them the target model kept.

Torch-free and numpy-free (the scheduler in `kvflow.core` counts with it, and `SchedulerStats` carries it across
the engine-core process boundary, so its fields are plain msgspec-encodable ints and lists).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counts over verified drafts (vLLM's `SpecDecodingStats`), for one engine core.

    A draft is one request's proposed tokens verified in one step. `num_draft_tokens` counts the proposed tokens,
    `num_accepted_tokens` those the target kept (not the correction or bonus token every step adds), and
    `num_accepted_tokens_per_pos[i]` the drafts whose first i+1 tokens were all accepted.

    Invariants: `len(num_accepted_tokens_per_pos) == num_spec_tokens` (k); counts are >= 0 and only grow through
    `observe_draft` / `merge`; per_pos is non-increasing in i, its sum is `num_accepted_tokens`, its first entry
    is at most `num_drafts`; `num_accepted_tokens <= num_draft_tokens <= k * num_drafts`. A snapshot is
    cumulative (since startup, like the other `SchedulerStats` counters): an interval is `later - earlier`.
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {self.num_spec_tokens}")
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        if len(self.num_accepted_tokens_per_pos) != self.num_spec_tokens:
            raise ValueError(
                f"num_accepted_tokens_per_pos needs one count per position ({self.num_spec_tokens}), got "
                f"{self.num_accepted_tokens_per_pos}"
            )

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verified draft of a request: `num_draft_tokens` proposed, the first `num_accepted_tokens` of
        them accepted (0 <= accepted <= drafted <= k)."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(
                f"a draft needs 0 <= accepted ({num_accepted_tokens}) <= drafted ({num_draft_tokens}) <= "
                f"num_spec_tokens ({self.num_spec_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        """Add `other`'s counts to these (same k)."""
        self._check_same_k(other)
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[position] += count

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        total = self.copy()
        total.merge(other)
        return total

    def __sub__(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts added since the cumulative snapshot `earlier` (same k)."""
        self._check_same_k(earlier)
        return SpecDecodingStats(
            num_spec_tokens=self.num_spec_tokens,
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            num_accepted_tokens_per_pos=[
                now - before
                for now, before in zip(
                    self.num_accepted_tokens_per_pos,
                    earlier.num_accepted_tokens_per_pos,
                    strict=True,
                )
            ],
        )

    def copy(self) -> SpecDecodingStats:
        """An independent snapshot (the per-position list is copied too)."""
        return SpecDecodingStats(
            num_spec_tokens=self.num_spec_tokens,
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified draft yields on average, counting the one token every step emits anyway:
        1 + accepted / drafts (vLLM's definition; 1.0 before any draft)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """For each position i, the share of drafts whose first i+1 tokens were all accepted."""
        num_drafts = max(self.num_drafts, 1)
        return [count / num_drafts for count in self.num_accepted_tokens_per_pos]

    def log_line(self, elapsed_s: float) -> str:
        """vLLM's periodic "SpecDecoding metrics" line for these counts, gathered over `elapsed_s` seconds."""
        elapsed_s = max(elapsed_s, 1e-9)
        per_position = ", ".join(f"{rate:.3f}" for rate in self.acceptance_rate_per_pos)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {self.num_accepted_tokens / elapsed_s:.2f} tokens/s, "
            f"Drafted throughput: {self.num_draft_tokens / elapsed_s:.2f} tokens/s, "
            f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_position}, "
            f"Avg Draft acceptance rate: {100 * self.draft_acceptance_rate:.1f}%"
        )

    def _check_same_k(self, other: SpecDecodingStats) -> None:
        if other.num_spec_tokens != self.num_spec_tokens:
            raise ValueError(
                f"cannot combine SpecDecodingStats of {self.num_spec_tokens} and {other.num_spec_tokens} "
                "speculative tokens"
            )
