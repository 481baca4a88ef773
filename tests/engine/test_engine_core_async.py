"""Overlapped stepping (`async_scheduling`: `step_with_batch_queue`, two batches in flight) against synchronous
stepping, on the real executor / worker / runner with the hash model, plus weight versions on outputs."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvflow.testing.hash_model import reference_tokens
from tests.engine.engine_simulation import (
    EngineDriver,
    expected_tokens,
    greedy_request,
    make_engine_core,
)

PROTOCOLS = {"slot": True, "persistent_batch": False}


@dataclass
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    stop_token: int | None
    stop_as_eos: bool


def random_script(seed: int, num_requests: int = 14) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    step = 0
    for index in range(num_requests):
        step += rng.choice([0, 0, 1, 2, 5])
        prompt = [rng.randrange(1, 800) for _ in range(rng.randrange(1, 40))]
        max_tokens = rng.randrange(1, 24)
        stop_token = (
            rng.choice(reference_tokens(prompt, max_tokens)) if rng.random() < 0.3 else None
        )
        arrivals.append(
            Arrival(step, f"q{index}", prompt, max_tokens, stop_token, rng.random() < 0.5)
        )
    return arrivals


def run_script(
    arrivals: list[Arrival], *, async_scheduling: bool, use_v2_model_runner: bool, num_blocks: int
) -> EngineDriver:
    driver = EngineDriver(
        make_engine_core(
            async_scheduling=async_scheduling,
            use_v2_model_runner=use_v2_model_runner,
            max_num_seqs=5,
            num_blocks=num_blocks,
            max_model_len=64,
            max_num_batched_tokens=24,
        )
    )
    pending = list(arrivals)
    while pending or driver.core.has_work():
        while pending and pending[0].step <= driver.num_steps:
            arrival = pending.pop(0)
            options: dict[str, object] = {}
            if arrival.stop_token is not None:
                options = (
                    {"eos_token_id": arrival.stop_token}
                    if arrival.stop_as_eos
                    else {"stop_token_ids": [arrival.stop_token]}
                )
            driver.add(arrival.request_id, arrival.prompt, arrival.max_tokens, **options)
        driver.step()
        assert driver.num_steps < 3000, "no progress"
    driver.probe.check_idle_and_clean()
    return driver


@pytest.mark.parametrize("num_blocks", [200, 20])  # ample, and tight enough to preempt
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_overlapped_stepping_produces_exactly_the_sync_outputs(
    protocol: str, num_blocks: int
) -> None:
    num_preemptions = 0
    for seed in range(8):
        arrivals = random_script(seed)
        runs = {}
        for async_scheduling in (False, True):
            driver = run_script(
                arrivals,
                async_scheduling=async_scheduling,
                num_blocks=num_blocks,
                use_v2_model_runner=PROTOCOLS[protocol],
            )
            assert driver.probe.max_in_flight == (2 if async_scheduling else 1)
            assert (
                driver.probe.max_batch_queue <= 1
            )  # between steps: at most the batch the worker is running
            num_preemptions += driver.core.scheduler.num_preemptions_total
            runs[async_scheduling] = driver
        sync, overlapped = runs[False], runs[True]
        assert overlapped.tokens == sync.tokens, seed
        assert overlapped.finish_reasons == sync.finish_reasons, seed
        for arrival in arrivals:
            expected = expected_tokens(arrival.prompt, arrival.max_tokens, arrival.stop_token)
            assert sync.tokens[arrival.request_id] == expected, (seed, arrival.request_id)
    assert (num_preemptions > 0) == (num_blocks == 20)


def test_overlapped_steps_run_on_the_worker_thread_in_order_while_the_engine_plans_ahead() -> None:
    driver = EngineDriver(make_engine_core(async_scheduling=True))
    core = driver.core
    worker_threads: set[str] = set()
    run_on_worker = core.executor.worker.execute_model

    def spy(scheduler_output):  # type: ignore[no-untyped-def]
        import threading

        worker_threads.add(threading.current_thread().name)
        return run_on_worker(scheduler_output)

    core.executor.worker.execute_model = spy  # type: ignore[method-assign]
    driver.add("a", [3] * 7, 6)
    driver.step()
    assert len(core.batch_queue) == 1 and driver.tokens["a"] == []  # launched, not applied yet
    driver.step()
    assert (
        len(core.batch_queue) == 1 and len(driver.tokens["a"]) == 1
    )  # step 2 planned before step 1 applied
    driver.run()
    driver.assert_exact()
    assert worker_threads == {"kvflow-worker_0"}


# ---------------------------------------------------------------------------------------------------- bug pins
def test_an_unlaunched_empty_step_does_not_make_the_persistent_batch_protocol_resend_history() -> (
    None
):
    """Bug: the overlapped step dropped an empty SchedulerOutput without sending it, but the scheduler had already
    recorded it as the previous step; the next step then sent `all_token_ids` (the whole history) for a request the
    worker had run in the step before. Here: a streaming session whose last token is in flight (nothing to
    schedule), then its next chunk."""
    driver = EngineDriver(make_engine_core(async_scheduling=True, use_v2_model_runner=False))
    core = driver.core
    sent = []
    send = core.executor.execute_model

    def spy(scheduler_output, non_block=False):  # type: ignore[no-untyped-def]
        sent.append(scheduler_output)
        return send(scheduler_output, non_block=non_block)

    core.executor.execute_model = spy  # type: ignore[method-assign]
    prompt, chunk = [5, 6, 7, 8, 9], [11, 12, 13]
    driver.add("s", prompt, 2, resumable=True)
    core.add_request(
        greedy_request("s", chunk, 3, resumable=True)
    )  # the next chunk, queued while it runs
    for _ in range(4):
        driver.step()
    first = reference_tokens(prompt, 2)
    assert driver.tokens["s"][:2] == first
    chunk_step = next(
        output
        for output in sent
        if output.scheduled_cached_reqs.new_token_ids
        and output.scheduled_cached_reqs.new_token_ids[0]
    )
    assert chunk_step.scheduled_cached_reqs.new_token_ids == [chunk]
    assert chunk_step.scheduled_cached_reqs.all_token_ids == {}
    core.add_request(
        greedy_request("s", [], 1, resumable=False)
    )  # close the session after this chunk
    driver.run()
    assert driver.tokens["s"] == first + reference_tokens(prompt + first[:-1] + chunk, 3)


def test_a_paused_engine_sends_reports_without_leaving_a_batch_in_flight() -> None:
    """Bug: after pause(clear_cache=True) took effect, the step that reported the preemptions to the worker left
    that (token-less) batch in flight, so `update_weights` right then failed its no-batch-in-flight assertion
    and a repeated pause was no longer in effect."""
    driver = EngineDriver(make_engine_core(async_scheduling=True))
    core = driver.core
    core.executor.update_weights = lambda weights: None  # type: ignore[method-assign]  # the hash model has none
    for index in range(3):
        driver.add(str(index), [index + 2] * 9, 12)
    for _ in range(4):
        driver.step()
    driver.pause("keep", clear_cache=True)
    driver.step_until(core.pause_effective)
    assert core.scheduler.has_pending_reports()
    driver.step()  # reports the preemptions
    assert not core.scheduler.has_pending_reports()
    assert core.pause_effective() and not core.batch_queue
    assert core.update_weights("same") == 1
    driver.pause("keep", clear_cache=False)
    assert core.pause_effective()
    core.resume_generation()
    driver.run()
    driver.assert_exact()


# ---------------------------------------------------------------------------------------------------- weights
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_carry_the_weight_version_that_computed_their_tokens(
    async_scheduling: bool,
) -> None:
    driver = EngineDriver(make_engine_core(async_scheduling=async_scheduling))
    core = driver.core
    updates: list[object] = []
    core.executor.update_weights = updates.append  # type: ignore[method-assign]  # the hash model has none
    with pytest.raises(RuntimeError, match="paused"):
        core.update_weights("w1")
    driver.add("long", [7] * 9, 20)
    driver.add("short", [8] * 5, 3)
    driver.step_until(lambda: len(driver.tokens["long"]) >= 4)
    driver.pause("keep", clear_cache=False)
    if core.batch_queue:  # pause requested, not yet in effect: a batch is still in flight
        with pytest.raises(RuntimeError, match="paused"):
            core.update_weights("w1")
    driver.step_until(core.pause_effective)
    assert core.update_weights("w1") == 1 and updates == ["w1"]
    assert core.reset_prefix_cache(reset_running_requests=True)
    driver.add("after", [9] * 6, 4)
    core.resume_generation()
    with pytest.raises(RuntimeError, match="paused"):
        core.update_weights("w2")
    driver.run()
    driver.assert_exact()  # the hash model ignores weights: same tokens
    assert driver.weight_versions["long"][0] == 0 and driver.weight_versions["long"][-1] == 1
    assert sorted(set(driver.weight_versions["long"])) == [0, 1]
    assert driver.weight_versions["long"] == sorted(driver.weight_versions["long"])
    assert set(driver.weight_versions["short"]) == {0}
    assert set(driver.weight_versions["after"]) == {1}


def test_on_cpu_auto_runs_overlapped_steps_inline_with_the_same_outputs() -> None:
    """worker_thread="auto" on a CPU device: no worker thread, already-finished futures, identical outputs."""
    prompts = {str(index): [index + 5] * (3 + 2 * index) for index in range(6)}
    results = {}
    for worker_thread in ("auto", "on"):
        core = make_engine_core(async_scheduling=True, worker_thread=worker_thread)
        assert core.executor.uses_worker_thread == (worker_thread == "on")
        for request_id, prompt in prompts.items():
            core.add_request(greedy_request(request_id, prompt, 9))
        tokens: dict[str, list[int]] = {}
        for _ in range(500):
            if not core.has_work():
                break
            for output in core.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        assert (core.executor._thread is None) == (worker_thread == "auto")
        results[worker_thread] = tokens
        core.shutdown()
    assert results["auto"] == results["on"]
    assert all(
        results["auto"][request_id] == expected_tokens(prompt, 9)
        for request_id, prompt in prompts.items()
    )
