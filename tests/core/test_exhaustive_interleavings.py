"""The exhaustive interleaving checker (`kvflow.testing.interleavings`) on its tiny configuration: every sequence of
add / chunk / step (sync) or launch / complete (async) / abort / forced reset / pause (each mode) / resume up to
depth 8, for sync and async scheduling and both runner protocols, with the counts it covered printed (`-s`) and
bounded below, so a search that silently shrinks fails. The same with speculative decoding (k = 2, every accepted
length of every step: depth 8 sync, 7 async, to fit the suite's time), and with a wider budget where two requests
verify drafts in one batch. Deeper runs are marked slow.

Mutation checks: bugs planted by monkeypatching (the source is untouched) must be found by the check meant for
them, within a small number of states. To add one: add a patch function, its configurations and the violations
it must cause to `MUTATIONS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from kvflow.core.sched.async_scheduler import AsyncScheduler
from kvflow.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvflow.core.sched.scheduler import Scheduler
from kvflow.request import Request
from kvflow.testing.interleavings import (
    ALL_PAUSE_VARIANTS,
    SPEC_REQUESTS,
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

# Speculative decoding, k = 2: a step verifies 0 to 2 drafts and its batch has a branch per accepted length.
K = 2
SPEC = CheckerConfig(
    num_speculative_tokens=K, requests=SPEC_REQUESTS, max_worker_outcomes=(K + 1) ** 2
)
SPEC_DEPTH = {"sync": 8, "async": 7}
SPEC_CONFIGS = {
    f"{mode}-{protocol}-spec": replace(
        SPEC,
        async_scheduling=mode == "async",
        use_v2_model_runner=protocol == "slot",
        depth=SPEC_DEPTH[mode],
    )
    for mode in ("sync", "async")
    for protocol in ("slot", "persistent_batch")
}
# As MIN_COVERAGE, at SPEC_DEPTH.
MIN_SPEC_COVERAGE = {"sync": (4_300, 156_000), "async": (2_400, 35_000)}
ALL_CONFIGS = {**CONFIGS, **SPEC_CONFIGS}
# A budget of 4 tokens and 5 blocks: "a" and "b" verify a draft each in one batch (2 x 2 outcomes).
WIDE_DEPTH = {"sync": 6, "async": 7}


def _wide(mode: str, depth: int) -> CheckerConfig:
    return replace(
        SPEC_CONFIGS[f"{mode}-slot-spec"],
        depth=depth,
        max_num_batched_tokens=4,
        num_blocks=5,
        requests=SPEC_REQUESTS[:2],
    )


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


@pytest.mark.parametrize("name", SPEC_CONFIGS)
def test_every_interleaving_with_drafts_keeps_every_invariant(name: str) -> None:
    config = SPEC_CONFIGS[name]
    # The least depth, with drafts (async: one less, for the suite's time; 9 in the slow run).
    assert SPEC_DEPTH["sync"] >= 8
    result = _run(config)
    mode = "async" if config.async_scheduling else "sync"
    min_states, min_interleavings = MIN_SPEC_COVERAGE[mode]
    assert result.num_states >= min_states
    assert result.num_interleavings >= min_interleavings
    # Every accepted length of a 2-draft step (3 outcomes), rejections included, and prefix hits.
    assert result.max_outcomes == K + 1
    assert result.events["verified_drafts"] > result.events["rejected_drafts"] > 0
    assert result.events["prefix_hit"] > 0
    assert result.coverage[("pause", 0)] > 0
    if config.async_scheduling:
        # Draft slots filled by the worker; stale steps that verified drafts dropped whole after a preemption or
        # stop; aborts, resets and pauses with one and two batches in flight.
        assert result.events["placeholder_drafts"] > 0
        assert result.events["dropped_draft_step"] > 0
        for kind in ("abort", "reset", "pause"):
            assert result.coverage[(kind, 1)] > 0 and result.coverage[(kind, 2)] > 0, kind
    else:
        assert result.events["preempted_in_step"] > 0
        assert result.events["session_chunk"] > 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_requests_verify_drafts_in_one_batch(mode: str) -> None:
    result = _run(_wide(mode, WIDE_DEPTH[mode]))
    # 2 x 2: every combination of the two requests' accepted lengths.
    assert result.max_outcomes == 4
    assert result.events["rejected_drafts"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", SPEC_CONFIGS)
def test_every_interleaving_with_drafts_deeper(name: str) -> None:
    config = SPEC_CONFIGS[name]
    result = _run(replace(config, depth=config.depth + 2, pause_variants=ALL_PAUSE_VARIANTS))
    mode = "async" if config.async_scheduling else "sync"
    assert result.num_states > 2 * MIN_SPEC_COVERAGE[mode][0]
    assert result.events["preempted_in_step"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_requests_verify_drafts_in_one_batch_deeper(mode: str) -> None:
    assert _run(_wide(mode, WIDE_DEPTH[mode] + 2)).max_outcomes == 4


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


def _draft_step_counts_one_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step verifying d drafts adds one placeholder instead of 1 + d, and its output takes one back: the
    scheduler under-counts what its steps in flight may yield (so it may plan past max_tokens / max_model_len)."""
    original_update = AsyncScheduler._update_after_schedule
    original_apply = AsyncScheduler._apply_output

    def one_token_update(self: AsyncScheduler, output: SchedulerOutput) -> None:
        drafted = output.scheduled_spec_decode_tokens
        steps_before = {req_id: self.requests[req_id].num_in_flight_steps for req_id in drafted}
        original_update(self, output)
        for req_id, drafts in drafted.items():
            request = self.requests[req_id]
            if request.num_in_flight_steps > steps_before[req_id]:  # it counted 1 + d placeholders
                request.num_output_placeholders -= len(drafts)

    def one_token_apply(
        self: AsyncScheduler,
        request: Request,
        generated: list[int],
        num_drafts: int,
        index: int,
        outcome: ModelRunnerOutput,
    ) -> tuple[list[int], bool]:
        if request.async_tokens_to_discard == 0:
            request.num_output_placeholders += num_drafts  # the original takes 1 + d back
        return original_apply(self, request, generated, num_drafts, index, outcome)

    monkeypatch.setattr(AsyncScheduler, "_update_after_schedule", one_token_update)
    monkeypatch.setattr(AsyncScheduler, "_apply_output", one_token_apply)


# name -> (plant the bug, configurations that must catch it, what the violation says: one of these).
MUTATIONS: dict[
    str, tuple[Callable[[pytest.MonkeyPatch], None], tuple[str, ...], tuple[str, ...]]
] = {
    "discard_overwrites": (
        _discard_overwrites,
        tuple(name for name in ALL_CONFIGS if name.startswith("async")),
        ("counted in flight", "do not continue the oracle"),
    ),
    "reset_forgets_preempted": (
        _reset_forgets_preempted,
        tuple(ALL_CONFIGS),
        ("held by no one and not reported", "No free indices", "sent as new while it holds"),
    ),
    "draft_step_counts_one_token": (
        _draft_step_counts_one_token,
        tuple(name for name in SPEC_CONFIGS if name.startswith("async")),
        ("placeholders, its steps in flight",),
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
    violation = find_violation(replace(ALL_CONFIGS[name], max_states=MAX_STATES_TO_FIND))
    elapsed = time.perf_counter() - start
    assert violation is not None, f"{mutation} went unnoticed on {name}"
    print(f"\n{mutation} on {name}: found in {elapsed:.2f}s: {violation}")
    assert any(message in violation.message for message in messages), violation
