"""An exception or Ctrl-C that leaves `LLM.generate` aborts that call's requests and leaves the LLM usable.

Before the fix, an interrupt inside an engine step left the scheduler and the worker disagreeing (async: "scheduled
past the worker's known tokens"), or left the requests running and holding their KV blocks and slots.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import pytest

from kvflow import LLM, AsyncLLM, SamplingParams
from kvflow.engine.core import EngineCore
from kvflow.testing.hash_model import reference_tokens

PROTOCOLS = {"slot": True, "persistent": False}
SCHEDULING = {"sync": False, "async": True}
PROMPTS = [[(seed * 31 + j * 7) % 900 + 1 for j in range(12)] for seed in range(8)]


def make_llm(protocol: str, scheduling: str, **overrides: Any) -> LLM:
    options: dict[str, Any] = dict(
        max_num_seqs=8,
        num_kv_blocks=4096,
        block_size=4,
        max_model_len=2048,
        max_num_batched_tokens=64,
        use_v2_model_runner=PROTOCOLS[protocol],
        async_scheduling=SCHEDULING[scheduling],
    )
    options.update(overrides)
    return LLM("hash", **options)


def prompts(count: int = 8) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": prompt} for prompt in PROMPTS[:count]]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def assert_nothing_held(llm: LLM) -> None:
    """No request, KV block, worker slot, parked state or batch is left behind."""
    llm.run_in_engine(assert_core_holds_nothing)
    assert not llm.output_processor.request_states and not llm.output_processor.parent_requests


def assert_core_holds_nothing(core: EngineCore) -> None:
    scheduler = core.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert not core.batch_queue and not scheduler.has_pending_reports()
    pool = scheduler.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks), "KV blocks still held"
    runner = core.executor.worker.model_runner
    assert runner.slots.num_free == runner.slots.max_num_reqs, "worker slots still held"
    assert not getattr(runner, "parked", {}), "parked requests left on the worker"


def assert_still_exact(llm: LLM) -> None:
    """The next call gives what a fresh engine gives (the hash model's reference)."""
    outputs = llm.generate(prompts(3), greedy(20), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == [
        reference_tokens(prompt, 20) for prompt in PROMPTS[:3]
    ]
    # (the worker hears of finished ones next step)
    assert not llm.run_in_engine(lambda core: core.scheduler.requests)


def interrupt_at_step(llm: LLM, step_number: int) -> None:
    """Deliver SIGINT to this (the main) thread in the middle of the engine's `step_number`-th step."""
    llm.run_in_engine(lambda core: interrupt_core_at_step(core, step_number))


def interrupt_core_at_step(core: EngineCore, step_number: int) -> None:
    run_step = core.step
    count = 0

    def step_then_interrupt() -> Any:
        nonlocal count
        count += 1
        if count == step_number:
            signal.raise_signal(signal.SIGINT)  # arrives while the step is half done
        return run_step()

    core.step = step_then_interrupt  # type: ignore[method-assign]


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("step_number", [1, 2, 7])
def test_ctrl_c_mid_step_aborts_the_call_and_frees_everything(
    protocol: str, scheduling: str, step_number: int
) -> None:
    llm = make_llm(protocol, scheduling)
    interrupt_at_step(llm, step_number)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(), greedy(1500), use_tqdm=False)
    assert_nothing_held(llm)
    assert_still_exact(llm)


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_sigint_from_a_timer_during_a_long_generate(protocol: str, scheduling: str) -> None:
    """The issue's reproduction: 8 prompts, max_tokens=1500, SIGINT after a while from outside the engine."""
    llm = make_llm(protocol, scheduling)
    llm.generate(
        prompts(1), greedy(2), use_tqdm=False
    )  # warm up, so the timer lands mid-generation
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts(), greedy(1500), use_tqdm=False)
    finally:
        timer.cancel()
    assert_nothing_held(llm)
    assert_still_exact(llm)


class ExplodingBar:
    """A tqdm-like progress bar whose update fails, as a user's callback might."""

    def __init__(self, **kwargs: Any) -> None:
        self.num_updates = 0

    def update(self, count: int) -> None:
        self.num_updates += count
        if self.num_updates == 2:
            raise RuntimeError("progress callback failed")

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_exception_inside_generate_aborts_the_rest(protocol: str, scheduling: str) -> None:
    llm = make_llm(protocol, scheduling)
    params = [
        greedy(4 + 40 * index) for index in range(8)
    ]  # the first ones finish long before the others
    with pytest.raises(RuntimeError, match="progress callback failed"):
        llm.generate(prompts(), params, use_tqdm=ExplodingBar)
    assert_nothing_held(llm)
    assert_still_exact(llm)


def test_n_samples_are_aborted_with_their_parent() -> None:
    llm = make_llm("slot", "async")
    interrupt_at_step(llm, 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(2), SamplingParams(n=3, max_tokens=800, ignore_eos=True, seed=1))
    assert_nothing_held(llm)
    assert_still_exact(llm)


def test_the_previous_sigint_handler_is_back_after_generate() -> None:
    llm = make_llm("slot", "async")
    llm.generate(prompts(1), greedy(3), use_tqdm=False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def custom_handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, custom_handler)
    try:
        llm.generate(prompts(1), greedy(3), use_tqdm=False)  # a custom handler is left alone
        assert signal.getsignal(signal.SIGINT) is custom_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_async_consumer_that_raises_aborts_its_request_and_frees_its_slot() -> None:
    async def main() -> dict[str, int]:
        async with AsyncLLM(
            "hash", max_num_seqs=2, num_kv_blocks=1024, block_size=4, max_model_len=2048
        ) as llm:
            with pytest.raises(RuntimeError, match="consumer failed"):
                async for _ in llm.generate(prompts(1)[0], greedy(1500), request_id="doomed"):
                    raise RuntimeError("consumer failed")
            for _ in range(400):  # the abandoned generator is closed by the event loop soon after
                snapshot = await llm.run_in_engine(
                    lambda core: {
                        "requests": len(core.scheduler.requests),
                        "free_slots": core.executor.worker.model_runner.slots.num_free,
                    }
                )
                if snapshot == {"requests": 0, "free_slots": 2}:
                    break
                await asyncio.sleep(0.01)
            outputs = [out async for out in llm.generate(prompts(2)[1], greedy(5))]
            assert outputs[-1].outputs[0].token_ids == reference_tokens(PROMPTS[1], 5)
            return snapshot

    assert asyncio.run(asyncio.wait_for(main(), 60)) == {"requests": 0, "free_slots": 2}
