"""The exhaustive interleaving checker (`kvflow.testing.interleavings`) on its tiny configuration: every sequence of
add / chunk / step (sync) or launch / complete (async) / abort / forced reset / pause (each mode) / resume up to
depth 8, for sync and async scheduling and both runner protocols, with the counts it covered printed (`-s`) and
bounded below, so a search that silently shrinks fails. Deeper runs are marked slow.

Mutation checks: bugs planted by monkeypatching (the source is untouched) must be found by the check meant for
them, within a small number of states. To add one (e.g. "count a draft step as one token", once the checker
enumerates drafts): add a patch function, its configurations and the violations it must cause to `MUTATIONS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from kvflow.core.sched.async_scheduler import AsyncScheduler
from kvflow.core.sched.scheduler import Scheduler
from kvflow.request import Request
from kvflow.testing.interleavings import (
    ALL_PAUSE_VARIANTS,
    CheckerConfig,
    SearchResult,
    explore,
    find_violation,
)

CONFIGS = {
    "sync-slot": CheckerConfig(async_scheduling=False, use_v2_model_runner=True),
    "sync-persistent_batch": CheckerConfig(async_scheduling=False, use_v2_model_runner=False),
    "async-slot": CheckerConfig(async_scheduling=True, use_v2_model_runner=True),
    "async-persistent_batch": CheckerConfig(async_scheduling=True, use_v2_model_runner=False),
}
# (distinct states, interleavings) at depth 8, about 85% of what the search covers today: the counts only move when
# the scheduler's behaviour or the action model changes; a drop below these means the search lost ground.
MIN_COVERAGE = {"sync": (3_400, 117_000), "async": (4_800, 175_000)}


def _run(config: CheckerConfig) -> SearchResult:
    result = explore(config)
    print(f"\n{result.summary()}\n  events: {dict(result.events)}")
    assert result.complete
    return result


@pytest.mark.parametrize("name", CONFIGS)
def test_every_interleaving_keeps_every_invariant(name: str) -> None:
    config = CONFIGS[name]
    assert config.depth >= 8
    result = _run(config)
    min_states, min_interleavings = MIN_COVERAGE["async" if config.async_scheduling else "sync"]
    assert result.num_states >= min_states
    assert result.num_interleavings >= min_interleavings
    # The search reaches what it is for: prefix hits, preemption for KV blocks inside a step, every pause mode.
    assert result.events["prefix_hit"] > 0
    assert result.events["preempted_in_step"] > 0
    assert result.coverage[("pause", 0)] > 0
    if config.async_scheduling:
        # Aborts, forced resets and pauses with one and with two batches in flight; stale tokens dropped.
        for kind in ("abort", "reset", "pause"):
            assert result.coverage[(kind, 1)] > 0 and result.coverage[(kind, 2)] > 0, kind
        assert result.events["dropped_in_flight"] > 0
    else:
        assert result.events["session_chunk"] > 0  # a session went on with its next chunk


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_every_interleaving_deeper(name: str) -> None:
    config = CONFIGS[name]
    depth = 9 if config.async_scheduling else 10
    result = _run(replace(config, depth=depth, pause_variants=ALL_PAUSE_VARIANTS))
    assert result.num_states > 2 * MIN_COVERAGE["async" if config.async_scheduling else "sync"][0]


# ------------------------------------------------------------------------------------------------ mutations
def _discard_overwrites(monkeypatch: pytest.MonkeyPatch) -> None:
    """Preempting a request with steps in flight overwrites `async_tokens_to_discard` instead of adding to it: a
    request preempted again before its stale outputs arrived then keeps one of them."""
    original = AsyncScheduler._discard_in_flight

    def overwriting_discard(self: AsyncScheduler, request: Request) -> None:
        num_to_discard_before = request.async_tokens_to_discard
        original(self, request)
        request.async_tokens_to_discard -= num_to_discard_before  # only this call's steps are left

    monkeypatch.setattr(AsyncScheduler, "_discard_in_flight", overwriting_discard)


def _reset_forgets_preempted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced reset preempts running requests (and releases sessions' slots) without reporting them in the next
    output's `preempted_req_ids`: the worker keeps their slots."""
    original = Scheduler.reset_prefix_cache

    def forgetful_reset(self: Scheduler, reset_running_requests: bool = False) -> bool:
        reported_before = set(self.reset_preempted_req_ids)
        reset_ok = original(self, reset_running_requests)
        self.reset_preempted_req_ids.intersection_update(reported_before)
        return reset_ok

    monkeypatch.setattr(Scheduler, "reset_prefix_cache", forgetful_reset)


# name -> (plant the bug, configurations that must catch it, what the violation says: one of these). Speculative
# decoding adds "a draft step counted as one token" here, on configurations with drafts and `max_worker_outcomes`
# > 1 (every accepted length).
MUTATIONS: dict[
    str, tuple[Callable[[pytest.MonkeyPatch], None], tuple[str, ...], tuple[str, ...]]
] = {
    "discard_overwrites": (
        _discard_overwrites,
        ("async-slot", "async-persistent_batch"),
        ("counted in flight", "do not continue the oracle"),
    ),
    "reset_forgets_preempted": (
        _reset_forgets_preempted,
        tuple(CONFIGS),
        ("held by no one and not reported", "No free indices", "sent as new while it holds"),
    ),
}
# "Quickly": each bug shows within this many distinct states (a fraction of a second).
MAX_STATES_TO_FIND = 1_000


@pytest.mark.parametrize(
    ("mutation", "name"),
    [(mutation, name) for mutation, (_, names, _) in MUTATIONS.items() for name in names],
)
def test_planted_bug_is_found(monkeypatch: pytest.MonkeyPatch, mutation: str, name: str) -> None:
    plant, _, messages = MUTATIONS[mutation]
    plant(monkeypatch)
    start = time.perf_counter()
    violation = find_violation(replace(CONFIGS[name], max_states=MAX_STATES_TO_FIND))
    elapsed = time.perf_counter() - start
    assert violation is not None, f"{mutation} went unnoticed on {name}"
    print(f"\n{mutation} on {name}: found in {elapsed:.2f}s: {violation}")
    assert any(message in violation.message for message in messages), violation
