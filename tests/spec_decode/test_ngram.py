"""NgramProposer: prompt lookup over the request's own tokens, checked on hand-made sequences and against a
brute-force reading of the rule on random ones."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvflow.config import SpeculativeConfig
from kvflow.spec_decode import SPEC_PROPOSERS
from kvflow.spec_decode.ngram import NgramProposer


def proposer(k: int = 3, lookup_max: int = 3, lookup_min: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, lookup_max, lookup_min))


def propose(tokens: list[int], max_drafts: int = 100, **options: int) -> list[int]:
    return proposer(**options).propose(np.array(tokens, dtype=np.int64), max_drafts)


def reference(tokens: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """The rule, read literally: longest n first, then the most recent earlier occurrence."""
    for n in range(lookup_max, lookup_min - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_registry_names_the_proposer() -> None:
    assert SPEC_PROPOSERS.get("ngram") is NgramProposer


def test_copies_what_followed_the_earlier_occurrence() -> None:
    #         0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert propose(tokens, k=3) == [8, 9, 1]  # "6 7" occurred at 1..2


def test_no_match_no_draft() -> None:
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1, 2, 3, 4, 3], lookup_min=2) == []  # only a 1-gram matches, below the minimum
    assert propose([1, 2, 3, 4, 3], lookup_min=1) == [4, 3]


def test_too_short_sequences() -> None:
    assert propose([]) == []
    assert propose([7]) == []
    assert propose([7, 7]) == [7]
    assert propose([7, 7], lookup_min=2) == []  # the 2-gram has nothing before it


def test_the_longer_match_wins_over_a_more_recent_shorter_one() -> None:
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    # "1 2 3" at 0..2 (followed by 40) beats the more recent "2 3" at 5..6 (followed by 50).
    assert propose(tokens, k=1, lookup_max=3) == [40]
    assert propose(tokens, k=1, lookup_max=2) == [50]  # capped at 2: the most recent 2-gram


def test_the_most_recent_occurrence_among_equal_lengths() -> None:
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert propose(tokens, k=1, lookup_max=2) == [20]


def test_overlapping_occurrence() -> None:
    # "a b a" ends at index 4; the occurrence at 2..4 of the final "a b a" overlaps it: followed by "b a".
    tokens = [9, 0, 1, 0, 1, 0]
    assert propose(tokens, k=5, lookup_max=3) == [1, 0]
    # A run of one token: the most recent earlier 3-gram ends just before the last token.
    assert propose([4, 4, 4, 4, 4], k=3, lookup_max=3) == [4]


def test_match_at_the_very_start() -> None:
    tokens = [3, 4, 5, 6, 7, 3, 4]
    assert propose(tokens, k=2, lookup_max=2) == [5, 6]
    assert propose([3, 4, 3, 4], k=9, lookup_max=2) == [3, 4]  # the draft may run up to the end


def test_max_drafts_caps_the_draft() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(tokens, max_drafts=100, k=3) == [3, 4, 5]
    assert propose(tokens, max_drafts=2, k=3) == [3, 4]
    assert propose(tokens, max_drafts=0, k=3) == []


def test_candidates_near_the_start_do_not_wrap_around() -> None:
    # The earlier "5" at index 0 agrees over one token only; reading before it must not wrap to the end.
    tokens = [5, 8, 9, 8, 5]
    assert propose(tokens, k=2, lookup_max=3, lookup_min=1) == [8, 9]
    assert propose(tokens, k=2, lookup_max=3, lookup_min=2) == []


@pytest.mark.parametrize("vocab", [2, 3, 8, 50])
def test_matches_the_rule_on_random_sequences(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    for trial in range(300):
        tokens = rng.integers(0, vocab, int(rng.integers(0, 60))).tolist()
        lookup_min = int(rng.integers(1, 4))
        lookup_max = lookup_min + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        config = SpeculativeConfig("ngram", k, lookup_max, lookup_min)
        got = NgramProposer(config).propose(np.array(tokens, dtype=np.int32), 10)
        assert got == reference(tokens, k, lookup_max, lookup_min), (trial, tokens, config)


@pytest.mark.xdist_group("whole_machine")  # a timed bound: never beside its own suite
def test_a_thousand_tokens_take_microseconds() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 100, 1000)
    tokens[-200:] = tokens[100:300]  # a quoted passage: matches at every length
    ngram = NgramProposer(SpeculativeConfig("ngram", 5))
    assert ngram.propose(tokens, 5) == tokens[300:305].tolist()
    repeats = 2000
    start = time.perf_counter()
    for _ in range(repeats):
        ngram.propose(tokens, 5)
    per_call = (time.perf_counter() - start) / repeats
    assert per_call < 200e-6, (
        f"{per_call * 1e6:.1f} us per proposal"
    )  # ~10 us here; loose for shared CI


def test_needs_the_ngram_method() -> None:
    with pytest.raises(ValueError, match="NgramProposer needs method 'ngram'"):
        NgramProposer(SpeculativeConfig("draft_model", 2, model="/draft"))


def test_the_draft_model_proposer_is_registered_and_drafts_with_a_kv_cache() -> None:
    draft_model_proposer = SPEC_PROPOSERS.get("draft_model")
    proposer = draft_model_proposer(SpeculativeConfig("draft_model", 2, model="/draft"))
    assert proposer.needs_kv_cache and proposer.num_speculative_tokens == 2
