"""AsyncLLM end to end: pause (keep, wait, abort, with and without clearing the cache) and resume, concurrent pauses
and resumes, weight updates' guard, and prefix-cache resets beside running requests. The hash model is the oracle."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvflow import RequestOutput, SamplingParams
from kvflow.engine.async_llm import AsyncLLM
from tests.engine.async_llm_helpers import (
    LONG,
    collect,
    next_output,
    params,
    prompt,
    reference,
    run,
    tokens_of,
    uses_engine_process,
    wait_until_clean,
)


# ------------------------------------------------------------------------------------------------ pause / resume
@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_keep_freezes_output_and_resume_finishes_exactly(
    make_llm: Callable[..., AsyncLLM], clear_cache: bool
) -> None:
    llm = make_llm()
    max_tokens = 200

    async def main() -> None:
        outputs: list[RequestOutput] = []
        started = asyncio.Event()

        async def consume() -> None:
            async for output in llm.generate(
                prompt(9), params(max_tokens, "delta"), request_id="frozen"
            ):
                outputs.append(output)
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        await llm.pause_generation(mode="keep", clear_cache=clear_cache)
        assert await llm.is_paused()
        await asyncio.sleep(0.05)  # let already-delivered outputs reach the consumer
        num_seen = len(outputs)
        await asyncio.sleep(0.3)
        assert len(outputs) == num_seen, "tokens were emitted while paused"
        assert not outputs[-1].finished and len(tokens_of(outputs, "delta")) < max_tokens
        request = await llm.run_in_engine(lambda core: core.scheduler.requests["frozen"])
        assert (
            request.num_preemptions > 0
        ) == clear_cache  # clear_cache preempted it (recompute after resume)
        await llm.resume_generation()
        assert not await llm.is_paused()
        await task
        assert tokens_of(outputs, "delta") == reference(prompt(9), max_tokens)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_wait_lets_running_finish_and_holds_new_until_resume(
    make_llm: Callable[..., AsyncLLM], clear_cache: bool
) -> None:
    llm = make_llm()

    async def main() -> None:
        running = llm.generate(prompt(11), params(60), request_id="running")
        await next_output(running)
        rest = asyncio.create_task(collect_rest(running))
        await llm.pause_generation(mode="wait", clear_cache=clear_cache)
        # it returned only once in effect: the running request is done, nothing is left in the core
        assert await llm.run_in_engine(
            lambda core: (core.pause_effective(), sorted(core.scheduler.requests))
        ) == (True, [])
        finished = await rest
        assert finished[-1].finished and tokens_of(finished) == reference(prompt(11), 60)
        assert finished[-1].outputs[0].finish_reason == "length"
        held_outputs: list[RequestOutput] = []
        held = asyncio.create_task(collect_into(llm, prompt(12), params(5), "held", held_outputs))
        await asyncio.sleep(0.2)
        assert held_outputs == []
        assert (
            await llm.run_in_engine(lambda core: core.scheduler.get_num_unfinished_requests()) == 1
        )
        await llm.resume_generation()
        await held
        assert tokens_of(held_outputs) == reference(prompt(12), 5)
        await wait_until_clean(llm)

    run(main())


async def collect_rest(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in stream]


async def collect_into(
    llm: AsyncLLM,
    prompt_: Any,
    sampling_params: SamplingParams,
    request_id: str,
    into: list[RequestOutput],
) -> None:
    async for output in llm.generate(prompt_, sampling_params, request_id):
        into.append(output)


@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_abort_ends_running_requests_and_queues_new_ones(
    make_llm: Callable[..., AsyncLLM], clear_cache: bool
) -> None:
    llm = make_llm()
    expected = reference(prompt(13), LONG)

    async def main() -> None:
        running = llm.generate(prompt(13), params(LONG), request_id="running")
        await next_output(running)
        await llm.pause_generation(mode="abort", clear_cache=clear_cache)
        final = [output async for output in running][-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        tokens = final.outputs[0].token_ids
        assert 1 <= len(tokens) < LONG and tokens == expected[: len(tokens)]
        await wait_until_clean(llm)
        # requests that arrive while paused wait, are visible, and are abortable
        queued_outputs: list[RequestOutput] = []
        dropped_outputs: list[RequestOutput] = []
        queued = asyncio.create_task(
            collect_into(llm, prompt(14), params(4), "queued", queued_outputs)
        )
        dropped = asyncio.create_task(
            collect_into(llm, prompt(15), params(4), "dropped", dropped_outputs)
        )
        await asyncio.sleep(0.1)
        assert await llm.run_in_engine(lambda core: sorted(core.scheduler.requests)) == [
            "dropped",
            "queued",
        ]
        await llm.abort("dropped")
        await dropped
        assert [
            (o.finished, o.outputs[0].finish_reason, o.outputs[0].token_ids)
            for o in dropped_outputs
        ] == [(True, "abort", [])]
        assert queued_outputs == []
        await llm.resume_generation()
        await queued
        assert tokens_of(queued_outputs) == reference(prompt(14), 4)

    run(main())


def test_invalid_pause_mode_and_weight_update_without_pause(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm()

    # A state dict crosses no process boundary: the engine process takes a checkpoint folder.
    weights: Any = "no-such-checkpoint" if uses_engine_process(llm) else {}

    async def main() -> None:
        with pytest.raises(ValueError, match="pause mode"):
            await llm.pause_generation(mode="freeze")
        assert not await llm.is_paused()
        with pytest.raises(RuntimeError, match="paused"):
            await llm.update_weights(weights)
        await llm.pause_generation(mode="keep")
        with pytest.raises(ValueError, match="hash test model"):
            await llm.update_weights(
                weights
            )  # the command's error reaches its caller; the engine lives on
        await llm.resume_generation()
        assert tokens_of(await collect(llm, prompt(1), params(3))) == reference(prompt(1), 3)

    run(main())


def test_concurrent_pause_and_resume_never_strand_a_caller(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm(max_num_seqs=4)
    cases = [(prompt(seed, 4 + seed), 20 + 5 * seed) for seed in range(8)]

    async def toggler(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(12):
            if rng.random() < 0.6:
                await llm.pause_generation(
                    mode=rng.choice(["keep", "wait"]), clear_cache=rng.random() < 0.5
                )
            else:
                await llm.resume_generation()
            await asyncio.sleep(rng.random() * 0.01)

    async def main() -> None:
        generations = asyncio.gather(*(collect(llm, p, params(n)) for p, n in cases))
        await asyncio.gather(*(toggler(seed) for seed in range(3)))
        # several pauses at once all return, and one resume releases everything
        await asyncio.gather(
            *(llm.pause_generation(mode="keep", clear_cache=False) for _ in range(3))
        )
        await asyncio.gather(llm.resume_generation(), llm.pause_generation(mode="wait"))
        await llm.resume_generation()
        results = await generations
        for (p, n), outputs in zip(cases, results, strict=True):
            assert tokens_of(outputs) == reference(p, n)
        assert not await llm.is_paused()
        await wait_until_clean(llm)

    run(main())


def test_resume_releases_a_pause_that_has_not_taken_effect(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm()

    async def main() -> None:
        stream = llm.generate(prompt(4), params(LONG), request_id="long")
        await next_output(stream)
        pausing = asyncio.create_task(llm.pause_generation(mode="wait"))
        await asyncio.sleep(0.05)
        assert not pausing.done()  # "wait" holds the caller while the long request runs
        await llm.resume_generation()
        await asyncio.wait_for(pausing, 5.0)
        assert not await llm.is_paused()
        assert tokens_of([output async for output in stream]) == reference(prompt(4), LONG)

    run(main())


def test_reset_prefix_cache_respects_running_requests(make_llm: Callable[..., AsyncLLM]) -> None:
    llm = make_llm()

    async def main() -> None:
        await collect(llm, prompt(20, 40), params(2))
        assert await llm.reset_prefix_cache()
        stream = llm.generate(prompt(21, 40), params(80), request_id="busy")
        await next_output(stream)
        await llm.pause_generation(mode="keep", clear_cache=False)
        assert not await llm.reset_prefix_cache()  # blocks in use
        assert await llm.reset_prefix_cache(reset_running_requests=True)
        await llm.resume_generation()
        assert tokens_of([output async for output in stream]) == reference(prompt(21, 40), 80)

    run(main())
