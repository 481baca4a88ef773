"""Pause / resume, forced resets and aborts at EngineCore level (real executor, worker and runner on the hash model).

The randomized runs (engine_simulation.py) check the three invariants after every step; the deterministic tests
pin each pause mode's semantics and two bugs vLLM had: a forced reset after pause(keep) dropping the first token
after resume, and a second forced preemption overwriting (instead of adding to) the count of stale placeholders.
"""

from __future__ import annotations

import itertools

import pytest

from kvflow.core.sched.scheduler import PauseState
from kvflow.request import RequestStatus
from tests.engine.engine_simulation import (
    PAUSE_MODES,
    EngineDriver,
    EngineSimConfig,
    EngineSimulation,
    SimStats,
    make_engine_core,
    random_config,
)

PROTOCOLS = {"slot": True, "persistent_batch": False}
SCHEDULING = {"sync": False, "async": True}


def prompt_of(index: int, length: int) -> list[int]:
    return [(index * 37 + position * 11) % 491 + 1 for position in range(length)]


# ---------------------------------------------------------------------------------------------------- randomized
@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("seed", range(5))
def test_random_engine_interleavings_keep_every_invariant(
    protocol: str, scheduling: str, seed: int
) -> None:
    config = EngineSimConfig(
        use_v2_model_runner=PROTOCOLS[protocol], async_scheduling=SCHEDULING[scheduling]
    )
    stats = EngineSimulation(config, seed).run()
    assert stats.num_steps > 0


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("seed", range(2))
def test_random_engine_interleavings_under_heavy_kv_pressure_with_priority(
    scheduling: str, seed: int
) -> None:
    config = EngineSimConfig(
        async_scheduling=SCHEDULING[scheduling],
        policy="priority",
        num_blocks=20,
        max_num_seqs=7,
        reset_probability=0.08,
    )
    assert EngineSimulation(config, 100 + seed).run().num_preemptions > 0


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_random_engine_interleavings_without_chunked_prefill(scheduling: str) -> None:
    config = EngineSimConfig(
        async_scheduling=SCHEDULING[scheduling],
        enable_chunked_prefill=False,
        num_blocks=24,
        use_v2_model_runner=False,
    )
    EngineSimulation(config, 7).run()


def merged_stats(configs: list[EngineSimConfig], seeds: range) -> SimStats:
    total = SimStats()
    for config, seed in itertools.product(configs, seeds):
        stats = EngineSimulation(config, seed).run()
        total.num_steps += stats.num_steps
        for key, count in stats.resets_by_batches_in_flight.items():
            total.resets_by_batches_in_flight[key] = (
                total.resets_by_batches_in_flight.get(key, 0) + count
            )
        for state, count in stats.aborts_by_state.items():
            total.aborts_by_state[state] = total.aborts_by_state.get(state, 0) + count
        for pause, count in stats.pauses.items():
            total.pauses[pause] = total.pauses.get(pause, 0) + count
        for name in (
            "num_double_resets",
            "num_effective",
            "num_repauses",
            "num_resume_while_pending",
            "num_resume_without_pause",
            "num_added_while_paused",
            "num_preemptions",
            "num_stopped",
            "num_reused_ids",
        ):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        total.max_in_flight = max(total.max_in_flight, stats.max_in_flight)
    return total


def test_random_runs_reach_every_state_they_claim_to_test() -> None:
    """The randomized runs above prove little unless they reach the hard cases: check that they do."""
    configs = [
        EngineSimConfig(
            use_v2_model_runner=protocol,
            async_scheduling=scheduling,
            pause_probability=0.06,
            abort_probability=0.08,
            session_fraction=0.3,
            num_requests=30,
        )
        for protocol, scheduling in itertools.product(PROTOCOLS.values(), SCHEDULING.values())
    ]
    stats = merged_stats(configs, range(8))
    assert stats.max_in_flight == 2
    assert {0, 1, 2} <= set(stats.resets_by_batches_in_flight), stats.resets_by_batches_in_flight
    assert stats.num_double_resets > 0
    assert set(stats.pauses) == set(itertools.product(PAUSE_MODES, (False, True))), stats.pauses
    states = {state.split("/")[0] for state in stats.aborts_by_state}
    assert {
        "waiting",
        "running",
        "preempted",
        "in_flight",
        "waiting_for_streaming_req",
    } <= states, states
    assert any(state.endswith("/paused") for state in stats.aborts_by_state)
    for name in (
        "num_effective",
        "num_repauses",
        "num_resume_while_pending",
        "num_resume_without_pause",
        "num_added_while_paused",
        "num_preemptions",
        "num_stopped",
        "num_reused_ids",
    ):
        assert getattr(stats, name) > 0, name


@pytest.mark.parametrize("seed", range(6))
def test_random_engine_interleavings_with_random_configs(seed: int) -> None:
    EngineSimulation(random_config(seed), seed).run()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6, 150))
def test_random_engine_interleavings_with_random_configs_long(seed: int) -> None:
    EngineSimulation(random_config(seed), seed).run()


# ---------------------------------------------------------------------------------------------------- API edges
def test_pause_rejects_an_unknown_mode_and_changes_nothing() -> None:
    driver = EngineDriver(make_engine_core())
    driver.add("a", prompt_of(0, 6), 5)
    driver.step()
    with pytest.raises(ValueError, match="mode"):
        driver.core.pause_generation("freeze")
    assert not driver.core.is_paused() and driver.core.scheduler.pause_state == PauseState.UNPAUSED
    driver.run()
    driver.assert_exact()


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_repeated_pauses_and_resume_without_pause_are_harmless(scheduling: str) -> None:
    driver = EngineDriver(make_engine_core(async_scheduling=SCHEDULING[scheduling]))
    core = driver.core
    core.resume_generation()  # nothing to resume
    assert not core.is_paused() and not core.pause_effective()
    for index in range(3):
        driver.add(str(index), prompt_of(index, 5 + index), 9)
    for _ in range(3):
        driver.step()
    for clear_cache in (False, False, True, True):
        driver.pause("keep", clear_cache)
        driver.step_until(core.pause_effective)
    for _ in range(3):
        driver.pause("keep", False)
        assert core.pause_effective()
        assert not any(output.new_token_ids for output in driver.step())
    core.resume_generation()
    core.resume_generation()
    driver.run()
    driver.assert_exact()


# ---------------------------------------------------------------------------------------------------- keep
@pytest.mark.parametrize("clear_cache", [False, True])
@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_keep_emits_nothing_until_resume_and_matches_an_unpaused_run(
    protocol: str, scheduling: str, clear_cache: bool
) -> None:
    def start() -> EngineDriver:
        driver = EngineDriver(
            make_engine_core(
                async_scheduling=SCHEDULING[scheduling],
                max_num_seqs=3,
                use_v2_model_runner=PROTOCOLS[protocol],
            )
        )
        for index in range(5):
            driver.add(str(index), prompt_of(index, 4 + 3 * index), 12)
        return driver

    unpaused = start()
    unpaused.run()
    driver = start()
    core, scheduler = driver.core, driver.core.scheduler
    driver.step_until(lambda: driver.num_tokens() >= 6)
    driver.pause("keep", clear_cache)
    driver.step_until(core.pause_effective)
    assert not core.batch_queue
    frozen = {request_id: list(tokens) for request_id, tokens in driver.tokens.items()}
    num_preemptions = scheduler.num_preemptions_total
    if clear_cache:
        assert not scheduler.running
        pool = scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks and not pool.cached_block_hash_to_block
    else:
        assert len(scheduler.running) == 3  # kept on the worker, blocks and all
        assert len(driver.probe.runner.slots.req_id_to_index) == 3
    num_unfinished = scheduler.get_num_unfinished_requests()
    driver.add("late", prompt_of(9, 7), 6)
    assert scheduler.get_num_unfinished_requests() == num_unfinished + 1  # queued visibly
    for _ in range(6):
        assert not any(output.new_token_ids for output in driver.step())
    assert driver.tokens == {**frozen, "late": []}
    assert scheduler.num_preemptions_total == num_preemptions  # nothing more happened while frozen
    core.resume_generation()
    driver.run()
    driver.assert_exact()
    assert {
        request_id: driver.tokens[request_id] for request_id in unpaused.tokens
    } == unpaused.tokens


# ---------------------------------------------------------------------------------------------------- wait
@pytest.mark.parametrize("clear_cache", [False, True])
@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_wait_finishes_started_requests_and_holds_new_ones(
    protocol: str, scheduling: str, clear_cache: bool
) -> None:
    # Few KV blocks: some started request is preempted (started, not running) when the pause begins.
    driver = EngineDriver(
        make_engine_core(
            async_scheduling=SCHEDULING[scheduling],
            max_num_seqs=3,
            num_blocks=14,
            max_model_len=56,
            use_v2_model_runner=PROTOCOLS[protocol],
        )
    )
    core, scheduler = driver.core, driver.core.scheduler
    for index in range(6):
        driver.add(str(index), prompt_of(index, 9), 16)
    driver.step_until(
        lambda: any(
            request.status == RequestStatus.PREEMPTED for request in scheduler.requests.values()
        )
    )
    started = {
        request_id
        for request_id, request in scheduler.requests.items()
        if request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
    }
    held = set(scheduler.requests) - started
    assert started and held
    tokens_of_held = {request_id: list(driver.tokens[request_id]) for request_id in held}
    driver.pause("wait", clear_cache)
    driver.add("late", prompt_of(8, 5), 4)
    held.add("late")
    tokens_of_held["late"] = []
    driver.step_until(core.pause_effective, max_steps=400)
    assert set(driver.finish_reasons) == started  # every started request finished, nothing else
    driver.assert_exact(sorted(started))
    assert {request_id: driver.tokens[request_id] for request_id in held} == tokens_of_held
    assert scheduler.get_num_unfinished_requests() == len(held)
    for _ in range(4):
        assert not any(output.new_token_ids for output in driver.step())
    core.resume_generation()
    driver.run()
    driver.assert_exact()


# ---------------------------------------------------------------------------------------------------- abort
@pytest.mark.parametrize("clear_cache", [False, True])
@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_abort_ends_every_request_and_arrivals_wait_for_resume(
    protocol: str, scheduling: str, clear_cache: bool
) -> None:
    driver = EngineDriver(
        make_engine_core(
            async_scheduling=SCHEDULING[scheduling],
            max_num_seqs=3,
            num_blocks=14,
            max_model_len=56,
            use_v2_model_runner=PROTOCOLS[protocol],
        )
    )
    core, scheduler = driver.core, driver.core.scheduler
    for index in range(6):
        driver.add(str(index), prompt_of(index, 9), 16)
    driver.step_until(
        lambda: any(
            request.status == RequestStatus.PREEMPTED for request in scheduler.requests.values()
        )
    )
    statuses = {request.status for request in scheduler.requests.values()}
    assert {RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.WAITING} <= statuses
    original = list(driver.expected)
    outputs = driver.pause("abort", clear_cache)
    assert sorted(output.request_id for output in outputs) == original
    for request_id in original:
        driver.assert_aborted_prefix(request_id)
    assert not scheduler.requests
    # Arrivals while paused are queued visibly: counted, abortable, served after resume.
    driver.add("late0", prompt_of(10, 5), 6)
    driver.add("late1", prompt_of(11, 6), 6)
    assert scheduler.get_num_unfinished_requests() == 2
    driver.step_until(core.pause_effective)
    for _ in range(4):
        assert not any(output.new_token_ids for output in driver.step())
    core.abort_requests(["late1"])
    assert scheduler.get_num_unfinished_requests() == 1
    core.resume_generation()
    driver.run()
    driver.assert_exact(["late0"])
    assert driver.tokens["late1"] == [] and "late1" not in driver.finish_reasons


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_changing_the_mode_of_a_pause(scheduling: str) -> None:
    driver = EngineDriver(make_engine_core(async_scheduling=SCHEDULING[scheduling], max_num_seqs=2))
    core = driver.core
    for index in range(4):
        driver.add(str(index), prompt_of(index, 6), 10)
    driver.step_until(lambda: driver.num_tokens() >= 3)
    driver.pause("keep", clear_cache=True)
    driver.step_until(core.pause_effective)
    driver.pause(
        "wait", clear_cache=False
    )  # keep -> wait: the frozen (started) requests now run to the end
    assert not core.pause_effective()
    driver.step_until(core.pause_effective)
    driver.assert_exact(["0", "1"])
    assert driver.tokens["2"] == driver.tokens["3"] == []
    driver.pause("abort")  # wait -> abort: the held requests end now
    assert driver.finish_reasons["2"] == driver.finish_reasons["3"] == "abort"
    core.resume_generation()
    driver.run()


# ---------------------------------------------------------------------------------------------------- known bugs
def start_decoding(scheduling: str, protocol: str) -> EngineDriver:
    driver = EngineDriver(
        make_engine_core(
            async_scheduling=SCHEDULING[scheduling],
            max_num_seqs=4,
            use_v2_model_runner=PROTOCOLS[protocol],
        )
    )
    for index in range(3):
        driver.add(str(index), prompt_of(index, 5 + 4 * index), 14)
    driver.step_until(lambda: all(len(tokens) >= 3 for tokens in driver.tokens.values()))
    return driver


@pytest.mark.parametrize("when", ["after_effective", "while_pending", "mid_step"])
@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_forced_reset_after_pause_keep_keeps_the_first_token_after_resume(
    protocol: str, scheduling: str, when: str
) -> None:
    """vLLM bug: pause(keep), then reset_prefix_cache(reset_running_requests=True), then resume dropped the first
    token after resume (a stale-placeholder discard swallowed a real token), shifting every later token by one.

    The reset meets 0 batches in flight once the pause took effect, the async engine's 1 while the pause is still
    pending, and mid-step 2 (async: the batch just launched plus the one before it) or 1 (sync: the output not yet
    applied)."""
    driver = start_decoding(scheduling, protocol)
    core, scheduler = driver.core, driver.core.scheduler
    batches_in_flight = {
        "after_effective": 0,
        "while_pending": len(core.batch_queue),
        "mid_step": len(core.batch_queue) + 1,
    }[when]
    expected_batches = (
        {"after_effective": 0, "while_pending": 1, "mid_step": 2}
        if scheduling == "async"
        else {"after_effective": 0, "while_pending": 0, "mid_step": 1}
    )
    assert batches_in_flight == expected_batches[when]

    def reset() -> None:
        assert core.reset_prefix_cache(reset_running_requests=True)
        if scheduling == "async" and batches_in_flight:
            assert all(
                request.async_tokens_to_discard == batches_in_flight
                for request in scheduler.requests.values()
            )

    if when == "mid_step":
        # A pause is only ever requested between steps; the reset here models one arriving with both batches out.
        def hook(_: object) -> None:
            driver.probe.mid_step_hook = None
            reset()

        driver.probe.mid_step_hook = hook
        driver.step()
        assert driver.probe.mid_step_hook is None
        driver.pause("keep", clear_cache=False)
    else:
        driver.pause("keep", clear_cache=False)
        if when == "after_effective":
            driver.step_until(core.pause_effective)
        reset()
    driver.step_until(core.pause_effective)
    tokens_at_pause = {request_id: list(tokens) for request_id, tokens in driver.tokens.items()}
    for _ in range(3):
        assert not any(output.new_token_ids for output in driver.step())
    assert all(0 < len(tokens) < 14 for tokens in tokens_at_pause.values()), tokens_at_pause
    core.resume_generation()
    driver.run()
    driver.assert_exact()


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pause_keep_with_clear_cache_resumes_every_request_exactly(
    protocol: str, scheduling: str
) -> None:
    for num_steps in range(1, 6):  # the pause lands at every point of the first steps
        driver = EngineDriver(
            make_engine_core(
                async_scheduling=SCHEDULING[scheduling],
                max_num_seqs=4,
                use_v2_model_runner=PROTOCOLS[protocol],
            )
        )
        for index in range(3):
            driver.add(str(index), prompt_of(index, 5 + 4 * index), 8)
        for _ in range(num_steps):
            driver.step()
        driver.pause("keep", clear_cache=True)
        driver.step_until(driver.core.pause_effective)
        assert driver.core.scheduler.num_preemptions_total > 0 or all(
            reason is not None for reason in driver.finish_reasons.values()
        )
        driver.core.resume_generation()
        driver.run()
        driver.assert_exact()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_second_forced_preemption_before_stale_placeholders_arrive_adds_to_the_discard_count(
    protocol: str,
) -> None:
    """vLLM bug: preempting a request again while placeholders from its first preemption are still in flight overwrote
    `async_tokens_to_discard` with the new in-flight count; the old stale placeholder then consumed a real token."""
    driver = EngineDriver(
        make_engine_core(async_scheduling=True, use_v2_model_runner=PROTOCOLS[protocol])
    )
    core = driver.core
    driver.add("r", prompt_of(1, 6), 10)
    driver.step()  # launches the prefill step F1
    driver.step()  # launches F2, applies F1: "r" has one token and one placeholder in flight
    request = core.scheduler.requests["r"]
    assert driver.tokens["r"] == driver.expected["r"][:1] and request.num_output_placeholders == 1
    assert core.reset_prefix_cache(reset_running_requests=True)
    assert request.async_tokens_to_discard == 1  # F2 is stale
    discards_seen: list[tuple[int, int]] = []

    def reset_again(_: object) -> None:
        # F3 (the recompute) was just launched; F2 is still in flight: preempt "r" again right now.
        driver.probe.mid_step_hook = None
        assert request.status == RequestStatus.RUNNING and request.num_output_placeholders == 1
        assert core.reset_prefix_cache(reset_running_requests=True)
        discards_seen.append((request.async_tokens_to_discard, request.num_output_placeholders))

    driver.probe.mid_step_hook = reset_again
    driver.step()
    assert discards_seen == [(2, 0)]  # 1 (F2) + 1 (F3), not overwritten with 1
    driver.run()
    driver.assert_exact()
