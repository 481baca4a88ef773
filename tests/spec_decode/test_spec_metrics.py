"""SpecDecodingStats: per-draft counting, merging, interval differences, vLLM's acceptance figures and log line."""

from __future__ import annotations

import msgspec
import pytest

from kvflow.spec_decode.metrics import SpecDecodingStats


def observed(k: int, *drafts: tuple[int, int]) -> SpecDecodingStats:
    stats = SpecDecodingStats(num_spec_tokens=k)
    for num_draft_tokens, num_accepted_tokens in drafts:
        stats.observe_draft(num_draft_tokens, num_accepted_tokens)
    return stats


def test_starts_at_zero_with_one_count_per_position() -> None:
    stats = SpecDecodingStats(num_spec_tokens=3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (0, 0, 0)
    assert stats.num_accepted_tokens_per_pos == [0, 0, 0]
    assert stats.mean_acceptance_length == 1.0 and stats.draft_acceptance_rate == 0.0
    assert stats.acceptance_rate_per_pos == [0.0, 0.0, 0.0]


def test_observe_draft_counts_positions_up_to_the_accepted_length() -> None:
    stats = observed(3, (3, 3), (3, 1), (2, 0), (3, 2))
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 11, 6)
    # Position i counts drafts with at least i+1 accepted tokens.
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1]
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert stats.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert stats.draft_acceptance_rate == pytest.approx(6 / 11)
    assert stats.acceptance_rate_per_pos == pytest.approx([0.75, 0.5, 0.25])


@pytest.mark.parametrize(("drafted", "accepted"), [(4, 1), (2, 3), (1, -1)])
def test_impossible_drafts_are_errors(drafted: int, accepted: int) -> None:
    with pytest.raises(ValueError, match="a draft needs 0 <= accepted"):
        SpecDecodingStats(num_spec_tokens=3).observe_draft(drafted, accepted)


def test_constructor_invariants() -> None:
    with pytest.raises(ValueError, match="num_spec_tokens must be >= 1"):
        SpecDecodingStats(num_spec_tokens=0)
    with pytest.raises(ValueError, match="one count per position"):
        SpecDecodingStats(num_spec_tokens=2, num_accepted_tokens_per_pos=[1, 0, 0])


def test_merge_add_and_interval_difference() -> None:
    first, second = observed(2, (2, 2), (1, 0)), observed(2, (2, 1))
    total = first + second
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (3, 5, 3)
    assert total.num_accepted_tokens_per_pos == [2, 1]
    assert first.num_drafts == 2 and first.num_accepted_tokens_per_pos == [1, 1]  # + copies
    assert total - first == second
    first.merge(second)
    assert first == total
    with pytest.raises(ValueError, match="cannot combine SpecDecodingStats of 2 and 3"):
        first.merge(SpecDecodingStats(num_spec_tokens=3))


def test_copy_is_independent() -> None:
    stats = observed(2, (2, 2))
    snapshot = stats.copy()
    stats.observe_draft(2, 1)
    assert snapshot.num_accepted_tokens_per_pos == [1, 1] and snapshot.num_drafts == 1


def test_log_line_is_vllms() -> None:
    stats = observed(3, (3, 3), (3, 1), (2, 0), (3, 2))
    assert stats.log_line(elapsed_s=2.0) == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 tokens/s, "
        "Drafted throughput: 5.50 tokens/s, Accepted: 6 tokens, Drafted: 11 tokens, "
        "Per-position acceptance rate: 0.750, 0.500, 0.250, Avg Draft acceptance rate: 54.5%"
    )


def test_crosses_the_process_boundary() -> None:
    """`SchedulerStats` carries it from the engine-core process, msgspec-encoded by type."""
    stats = observed(3, (3, 2))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SpecDecodingStats)
    assert decoded == stats
