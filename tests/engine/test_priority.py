"""Request priorities reach the scheduler from `LLM.generate` and `AsyncLLM.generate` (lower runs first)."""

from __future__ import annotations

import asyncio

import pytest

from kvflow import LLM, AsyncLLM, SamplingParams
from kvflow.testing.hash_model import reference_tokens

PROMPTS = [[(seed * 13 + j * 5) % 500 + 1 for j in range(8)] for seed in range(4)]
OPTIONS = dict(num_kv_blocks=512, block_size=4, max_model_len=512, max_num_batched_tokens=64)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_llm_generate_runs_lower_priorities_first_and_keeps_input_order() -> None:
    # One slot: requests run one after another, so their first-token times show the scheduling order.
    llm = LLM("hash", scheduling_policy="priority", max_num_seqs=1, **OPTIONS)
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    outputs = llm.generate(prompts, greedy(4), use_tqdm=False, priority=[5, 0, 3, -2])
    assert [output.outputs[0].token_ids for output in outputs] == [
        reference_tokens(prompt, 4) for prompt in PROMPTS
    ]
    first_token_times = [output.metrics.first_token_time for output in outputs]
    order = sorted(range(len(outputs)), key=lambda index: first_token_times[index])
    assert order == [3, 1, 2, 0]
    same = llm.generate(prompts[:2], greedy(3), use_tqdm=False, priority=7)  # one int for all
    assert [output.outputs[0].token_ids for output in same] == [
        reference_tokens(prompt, 3) for prompt in PROMPTS[:2]
    ]


def test_priority_mistakes_are_value_errors() -> None:
    fcfs = LLM("hash", max_num_seqs=2, **OPTIONS)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.generate([prompt], greedy(2), use_tqdm=False, priority=1)
    assert fcfs.generate([prompt], greedy(2), use_tqdm=False, priority=0)  # 0 is the default anyway
    priority = LLM("hash", scheduling_policy="priority", max_num_seqs=2, **OPTIONS)
    with pytest.raises(ValueError, match="priority has 2 entries for 1 prompts"):
        priority.generate([prompt], greedy(2), use_tqdm=False, priority=[1, 2])
    with pytest.raises(ValueError, match="priority must be an int"):
        priority.generate([prompt], greedy(2), use_tqdm=False, priority=["high"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['priority'\]"):
        priority.generate([{"prompt_token_ids": PROMPTS[0], "priority": 1}], use_tqdm=False)
    assert not priority.run_in_engine(
        lambda core: core.scheduler.requests
    )  # nothing was queued by the failed calls


def test_async_llm_generate_takes_a_priority() -> None:
    async def collect(llm: AsyncLLM, index: int, priority: int) -> float:
        final = None
        async for output in llm.generate(
            {"prompt_token_ids": PROMPTS[index]}, greedy(4), f"r{index}", priority=priority
        ):
            final = output
        assert final is not None and final.outputs[0].token_ids == reference_tokens(
            PROMPTS[index], 4
        )
        assert final.metrics is not None and final.metrics.first_token_time is not None
        return final.metrics.first_token_time

    async def main() -> list[float]:
        async with AsyncLLM("hash", scheduling_policy="priority", max_num_seqs=1, **OPTIONS) as llm:
            await llm.pause_generation(mode="keep")  # queue all three before any is scheduled
            tasks = [
                asyncio.create_task(collect(llm, index, priority))
                for index, priority in enumerate([4, -1, 2])
            ]
            while await llm.run_in_engine(lambda core: len(core.scheduler.waiting)) < 3:
                await asyncio.sleep(0.01)
            await llm.resume_generation()
            return await asyncio.gather(*tasks)

    first_token_times = asyncio.run(asyncio.wait_for(main(), 60))
    assert sorted(range(3), key=lambda index: first_token_times[index]) == [1, 2, 0]

    async def fcfs_rejects() -> None:
        async with AsyncLLM("hash", max_num_seqs=1, **OPTIONS) as llm:
            with pytest.raises(ValueError, match="scheduling_policy='priority'"):
                async for _ in llm.generate(
                    {"prompt_token_ids": PROMPTS[0]}, greedy(2), priority=3
                ):
                    pass

    asyncio.run(asyncio.wait_for(fcfs_rejects(), 60))
