"""`AsyncLLM(data_parallel_size=2)`: two engine-core processes behind one front end, on the hash model (exact
oracle). Requests go to the core with the fewest live requests (aborts count at once), a request's abort reaches
its core, pause / reset_prefix_cache / collective_rpc reach both, and `LLM` runs over the same client."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvflow import LLM, AsyncLLM, SamplingParams
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.core_client import EngineDeadError
from kvflow.engine.dp_client import DPEngineCoreClient
from kvflow.engine.placement import core_devices, split_devices, visible_cuda_devices
from kvflow.model_info import resolve_model_info
from kvflow.outputs import RequestOutput
from kvflow.testing.hash_model import reference_tokens
from tests.engine.async_llm_helpers import ChunkFeed, session_reference

TIMEOUT_S = 60.0
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def llm() -> Iterator[AsyncLLM]:
    engine = AsyncLLM(
        "hash",
        data_parallel_size=2,
        max_model_len=1024,
        num_kv_blocks=256,
        max_num_seqs=16,
        disable_log_stats=True,
    )
    try:
        yield engine
    finally:
        engine.shutdown()


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def prompt(index: int) -> list[int]:
    return [index + 1] * 20  # one full block each, so finished requests leave cached blocks


async def final_output(llm: AsyncLLM, request_id: str, index: int) -> RequestOutput:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = [
        each async for each in llm.generate({"prompt_token_ids": prompt(index)}, params, request_id)
    ]
    assert outputs[-1].finished
    return outputs[-1]


async def wait_for_loads(client: DPEngineCoreClient, expected: list[int]) -> None:
    while client.engine_loads() != expected:
        await asyncio.sleep(0.005)


async def requests_per_core(llm: AsyncLLM) -> list[set[str]]:
    return [
        set(ids) for ids in await llm.run_in_each_engine(lambda core: list(core.scheduler.requests))
    ]


def test_least_loaded_routing_counts_aborts_at_once_and_aborts_reach_core_1(llm: AsyncLLM) -> None:
    client = llm.engine_core_client
    assert isinstance(client, DPEngineCoreClient)

    async def scenario() -> None:
        await llm.pause_generation(
            "keep", clear_cache=False
        )  # requests stay where routing put them
        tasks = {f"r{i}": asyncio.ensure_future(final_output(llm, f"r{i}", i)) for i in range(4)}
        await wait_for_loads(client, [2, 2])
        assert await requests_per_core(llm) == [{"r0", "r2"}, {"r1", "r3"}]
        await llm.abort(["r1", "r3"])  # core 1's requests
        for request_id in ("r1", "r3"):
            aborted = await tasks.pop(request_id)
            assert aborted.outputs[0].finish_reason == "abort"
        assert client.engine_loads() == [2, 0]
        assert await requests_per_core(llm) == [{"r0", "r2"}, set()]
        tasks |= {f"r{i}": asyncio.ensure_future(final_output(llm, f"r{i}", i)) for i in (4, 5)}
        await wait_for_loads(client, [2, 2])  # both new ones went to the emptied core
        assert await requests_per_core(llm) == [{"r0", "r2"}, {"r4", "r5"}]
        await llm.resume_generation()
        for request_id, task in tasks.items():
            output = await task
            index = int(request_id[1:])
            assert list(output.outputs[0].token_ids) == reference_tokens(prompt(index), MAX_TOKENS)
        assert client.engine_loads() == [0, 0]

    run(scenario())


def test_reset_prefix_cache_reaches_both_cores(llm: AsyncLLM) -> None:
    def cached_blocks(core: Any) -> int:
        return len(core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)

    async def scenario() -> None:
        await asyncio.gather(*(final_output(llm, f"c{i}", 10 + i) for i in range(4)))
        assert all(count > 0 for count in await llm.run_in_each_engine(cached_blocks))
        assert await llm.reset_prefix_cache() is True
        assert await llm.run_in_each_engine(cached_blocks) == [0, 0]

    run(scenario())


def test_streaming_sessions_keep_every_chunk_on_their_core(llm: AsyncLLM) -> None:
    """Two sessions (one per core): each later chunk goes to the core holding the session's KV blocks, so every
    chunk's tokens equal the oracle over the session's history, and both cores end empty."""
    client = llm.engine_core_client
    assert isinstance(client, DPEngineCoreClient)
    chunks = [([5, 6, 7, 8, 9, 10, 11, 12, 13], 3), ([21, 22, 23, 24, 25], 4), ([31, 32], 2)]

    async def session(offset: int) -> list[list[int]]:
        feed = ChunkFeed()
        for chunk, max_tokens in chunks:
            feed.send([token + offset for token in chunk], SamplingParams(max_tokens=max_tokens))
        feed.end()
        outputs = [each async for each in llm.generate(feed.items(), None, f"s{offset}")]
        return [
            list(each.outputs[0].token_ids)
            for each in outputs
            if each.outputs[0].finish_reason is not None
        ]

    async def scenario() -> None:
        await llm.pause_generation("keep", clear_cache=False)
        sessions = [asyncio.ensure_future(session(offset)) for offset in (0, 100)]
        await wait_for_loads(client, [1, 1])  # one session on each core
        await llm.resume_generation()
        for offset, task in zip((0, 100), sessions, strict=True):
            shifted = [([token + offset for token in chunk], n) for chunk, n in chunks]
            assert await task == session_reference(shifted)
        await wait_for_loads(client, [0, 0])
        assert await requests_per_core(llm) == [set(), set()]

    run(scenario())


def test_collective_rpc_and_run_reach_every_core_in_order(llm: AsyncLLM) -> None:
    client = llm.engine_core_client
    assert isinstance(client, DPEngineCoreClient)
    assert run(llm.collective_rpc(lambda worker: os.getpid())) == client.pids
    assert run(llm.run_in_each_engine(lambda core: os.getpid())) == client.pids
    stats = run(llm.scheduler_stats())
    assert [each.engine_index for each in stats] == [0, 1]
    with pytest.raises(ValueError, match="run_in_each_engine"):
        run(llm.run_in_engine(lambda core: None))
    if "OMP_NUM_THREADS" not in os.environ:  # each core takes its share of the cores
        num_cores = len(os.sched_getaffinity(0))
        threads = run(llm.run_in_each_engine(lambda core: __import__("torch").get_num_threads()))
        assert threads == [max(1, num_cores // 2)] * 2


def test_llm_with_data_parallelism_spreads_requests_and_stays_exact() -> None:
    """`LLM(data_parallel_size=2)`: the same front end over the data-parallel client; every prompt's output is the
    hash model's reference, and both cores ran requests."""
    llm = LLM("hash", data_parallel_size=2, max_model_len=256, num_kv_blocks=128, max_num_seqs=8)
    try:
        prompts = [{"prompt_token_ids": prompt(index)} for index in range(8)]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == [
            reference_tokens(prompt(index), MAX_TOKENS) for index in range(8)
        ]
        prefix_queries = [stats.prefix_cache_query_tokens for stats in llm.scheduler_stats()]
        assert len(prefix_queries) == 2 and all(prefix_queries), prefix_queries
    finally:
        llm.shutdown()


def test_each_core_gets_its_own_slice_of_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert split_devices(["0", "1", "2", "3"], 2, 2) == ["0,1", "2,3"]
    assert split_devices(["GPU-a", "GPU-b", "GPU-c"], 2, 1) == ["GPU-a", "GPU-b"]
    with pytest.raises(ValueError, match="need 4 GPUs, 3 are visible"):
        split_devices(["0", "1", "2"], 2, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert visible_cuda_devices() == ["2", "5"]
    engine_args = EngineArgs(model="hash", device="cpu", max_model_len=1024)
    config = engine_args.create_engine_config(resolve_model_info("hash"))
    assert core_devices(config, 2) == [None, None]  # CPU: nothing to hide


def test_shutdown_ends_streams_and_leaves_no_engine_process(llm: AsyncLLM) -> None:
    """Runs last: it shuts the module's engine down with a request in flight on each core."""
    client = llm.engine_core_client
    assert isinstance(client, DPEngineCoreClient)

    async def scenario() -> list[RequestOutput]:
        tasks = [asyncio.ensure_future(final_output(llm, f"z{i}", 30 + i)) for i in range(2)]
        await wait_for_loads(client, [1, 1])
        await asyncio.to_thread(llm.shutdown)
        return list(await asyncio.gather(*tasks))

    for output in run(scenario()):
        assert output.outputs[0].finish_reason == "abort"
    assert not [pid for pid in client.pids if os.path.exists(f"/proc/{pid}")]
    with pytest.raises(EngineDeadError):
        run(final_output(llm, "after", 0))
