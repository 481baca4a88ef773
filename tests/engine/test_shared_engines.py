"""Engine cores shared by several front ends (`kvflow.engine.shared_engines`, the engine side of
`kvflow serve --api-server-count N`), on the hash model (exact oracle): two `AsyncLLM`s attached to the same engine
core each get exactly their own requests' outputs and their own calls' results, an abort of every request reaches
both front ends' streams, a pause from one holds the other's requests, and a front end that detaches leaves the
engine serving the other."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kvflow import AsyncLLM, SamplingParams
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.builder import resolve_engine_config
from kvflow.engine.core_proc import ABORT_EVERYWHERE, matching_request_ids
from kvflow.engine.shared_engines import SharedEngines, attached_engines
from kvflow.testing.hash_model import reference_tokens

TIMEOUT_S = 60.0
OPTIONS: dict[str, Any] = dict(
    model="hash", max_model_len=1024, num_kv_blocks=256, max_num_seqs=16, disable_log_stats=True
)


@pytest.fixture(scope="module")
def front_ends() -> Iterator[tuple[SharedEngines, AsyncLLM, AsyncLLM]]:
    model_info, engine_config = resolve_engine_config(EngineArgs(**OPTIONS))
    engines = SharedEngines(engine_config, model_info, data_parallel_size=1, num_clients=2)
    engines.start()
    llms: list[AsyncLLM] = []
    try:
        for client in range(2):
            with attached_engines(engines.attachments(client)):
                llms.append(AsyncLLM(**OPTIONS))
        yield engines, llms[0], llms[1]
    finally:
        for llm in llms:
            llm.shutdown()
        engines.stop()
    assert not any(process.is_alive() for process in engines.processes)


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def prompt(index: int) -> list[int]:
    return [index + 1] * (5 + index % 7)


async def tokens_of(llm: AsyncLLM, index: int, max_tokens: int, request_id: str) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    final = None
    async for output in llm.generate({"prompt_token_ids": prompt(index)}, params, request_id):
        final = output
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


def test_each_front_end_gets_exactly_its_own_outputs(
    front_ends: tuple[SharedEngines, AsyncLLM, AsyncLLM],
) -> None:
    _, first, second = front_ends

    async def both() -> list[list[int]]:
        return await asyncio.gather(
            *(
                tokens_of(first if index % 2 else second, index, 8 + index, f"r{index}")
                for index in range(24)
            )
        )

    results = run(both())
    for index, tokens in enumerate(results):
        assert tokens == reference_tokens(prompt(index), 8 + index)
    # Calls answer their sender, whichever sends them.
    assert run(first.is_paused()) is False
    assert run(second.reset_prefix_cache()) is True


def test_abort_everywhere_ends_both_front_ends_streams(
    front_ends: tuple[SharedEngines, AsyncLLM, AsyncLLM],
) -> None:
    _, first, second = front_ends

    async def scenario() -> tuple[list[str | None], list[str]]:
        params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
        started = [asyncio.Event(), asyncio.Event()]

        async def finish_reason(llm: AsyncLLM, index: int) -> str | None:
            final = None
            async for output in llm.generate(
                {"prompt_token_ids": prompt(index)}, params, f"a{index}"
            ):
                started[index].set()
                final = output
            return final.outputs[0].finish_reason if final is not None else None

        tasks = [
            asyncio.ensure_future(finish_reason(llm, i)) for i, llm in enumerate((first, second))
        ]
        await asyncio.gather(*(event.wait() for event in started))
        aborted = await asyncio.wrap_future(
            first.engine_core_client.call_utility(ABORT_EVERYWHERE, None)
        )
        return await asyncio.gather(*tasks), aborted

    reasons, aborted = run(scenario())
    assert reasons == ["abort", "abort"]
    assert sorted(aborted) == ["a0", "a1"]


def test_pause_from_one_front_end_holds_the_others_requests(
    front_ends: tuple[SharedEngines, AsyncLLM, AsyncLLM],
) -> None:
    _, first, second = front_ends

    async def scenario() -> list[int]:
        await first.pause_generation(mode="abort")
        assert await second.is_paused()
        held = asyncio.ensure_future(tokens_of(second, 3, 10, "held"))
        stats = await second.scheduler_stats()
        while stats[0].num_waiting_reqs < 1:
            stats = await second.scheduler_stats()
        assert not held.done()
        await first.resume_generation()
        return await held

    assert run(scenario()) == reference_tokens(prompt(3), 10)


def test_a_front_end_that_detaches_leaves_the_engine_to_the_other(
    front_ends: tuple[SharedEngines, AsyncLLM, AsyncLLM],
) -> None:
    engines, first, second = front_ends
    first.shutdown()
    assert all(process.is_alive() for process in engines.processes)
    assert run(tokens_of(second, 5, 12, "after")) == reference_tokens(prompt(5), 12)


def test_matching_request_ids_follows_the_servers_id_conventions() -> None:
    live = ["abc", "abc-0", "abc-1", "0_xyz", "1_xyz", "0_q-2", "other", "abcd"]
    targets, matched = matching_request_ids(["cmpl-abc", "xyz", "q", "missing"], live)
    assert sorted(targets) == ["0_q-2", "0_xyz", "1_xyz", "abc", "abc-0", "abc-1"]
    assert matched == ["cmpl-abc", "xyz", "q"]
