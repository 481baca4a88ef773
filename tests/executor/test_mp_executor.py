"""The `mp` executor on the hash model (replicated on every rank: no weights, no collectives), so these tests
measure the executor itself: one broadcast per step, answers and `collective_rpc` results in rank order through
every front end (`LLM`, `AsyncLLM` with its engine process, the server's admin endpoint), a killed rank failing the
engine with its rank named, and no worker process left behind in any of these cases.

Real processes and sockets throughout; waits are hang guards, never timing assertions (except that a dead rank
must be reported within a few seconds, not after a collective's timeout).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.death import EngineDeadError
from kvflow.executor.broadcast import WorkerDiedError
from kvflow.executor.multiproc import MultiprocExecutor, ephemeral_port_start, free_tcp_port
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.waiting import wait_until
from tests.entrypoints.server import HASH_SERVER, running_server

TIMEOUT_S = 60.0  # hang guard
HASH_OPTIONS: dict[str, Any] = dict(
    max_num_seqs=8, num_kv_blocks=256, block_size=4, max_model_len=512, max_num_batched_tokens=64
)


def prompt(seed: int, length: int = 6) -> list[int]:
    return [(seed * 37 + j * 11) % 991 + 1 for j in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie (a reparented child some sandboxes' init never reaps)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def hash_tp2() -> Iterator[LLM]:
    llm = LLM("hash", tensor_parallel_size=2, **HASH_OPTIONS)
    executor = llm.run_in_engine(lambda core: core.executor)
    assert isinstance(executor, MultiprocExecutor)
    yield llm
    llm.shutdown()  # also after the last test killed a rank
    assert not [pid for pid in executor.pids if is_running(pid)], "shutdown left worker processes"


def test_the_store_port_lies_below_the_ephemeral_range_and_is_free() -> None:
    """Rank 0's store port comes from below the kernel's ephemeral range: a port bind(0) released could go to any
    process's next outgoing connection before rank 0 binds it (EADDRINUSE seen in the suite under load)."""
    start = ephemeral_port_start()
    ports = {free_tcp_port() for _ in range(20)}
    assert all(port < start for port in ports), (ports, start)
    assert len(ports) > 1  # drawn at random, not one fixed port every executor would fight over
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as store:
        store.bind(("127.0.0.1", ports.pop()))


def test_tp2_defaults_to_mp_and_runs_the_hash_model_replicated(hash_tp2: LLM) -> None:
    assert isinstance(hash_tp2.run_in_engine(lambda core: core.executor), MultiprocExecutor)
    prompts = [prompt(seed, 5 + seed * 7) for seed in range(6)]
    outputs = hash_tp2.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(20), use_tqdm=False
    )
    assert [list(output.outputs[0].token_ids) for output in outputs] == [
        reference_tokens(p, 20) for p in prompts
    ]


def test_collective_rpc_from_llm_returns_rank_order(hash_tp2: LLM) -> None:
    infos = hash_tp2.collective_rpc("rank_info")
    assert [info["rank"] for info in infos] == [0, 1]
    assert [info["tensor_parallel_size"] for info in infos] == [2, 2]
    assert len({info["pid"] for info in infos}) == 2 and os.getpid() not in {
        info["pid"] for info in infos
    }
    offset = 10  # a closure: travels by value with cloudpickle
    assert hash_tp2.collective_rpc(lambda worker, scale: worker.rank * scale + offset, (7,)) == [
        10,
        17,
    ]
    assert hash_tp2.collective_rpc("execute_method", kwargs={"method": "rank_info"})[1]["rank"] == 1
    with pytest.raises(
        AttributeError, match="rank 0: the worker has no public method 'warp_drive'"
    ):
        hash_tp2.collective_rpc("warp_drive")
    # A failed call is the caller's error, not the executor's: it keeps serving.
    assert hash_tp2.collective_rpc(lambda worker: worker.rank) == [0, 1]


def test_each_step_is_one_broadcast_whose_size_does_not_grow_with_history(hash_tp2: LLM) -> None:
    """One frame per step for both ranks; a decode step's frame stays the same size as the sequence grows."""
    executor = hash_tp2.run_in_engine(lambda core: core.executor)
    assert isinstance(executor, MultiprocExecutor)
    sizes: list[int] = []
    call = executor._call

    def recording_call(message: Any, ranks: frozenset[int]) -> Any:
        future = call(message, ranks)
        sizes.append(executor.last_broadcast_bytes)
        return future

    executor._call = recording_call  # type: ignore[method-assign]
    try:
        before = executor.num_broadcasts
        hash_tp2.generate([{"prompt_token_ids": prompt(3, 40)}], greedy(300), use_tqdm=False)
    finally:
        del executor._call
    assert (
        executor.num_broadcasts - before == len(sizes) >= 300
    )  # one frame per step, not one per rank
    decode_sizes = sizes[5:-2]  # steady decoding: one request, one new token a step
    # Only pickle's integer widths vary (a few bytes); 300 tokens of history would add >= 300 bytes.
    assert max(decode_sizes) - min(decode_sizes) <= 32, (min(decode_sizes), max(decode_sizes))
    assert max(decode_sizes) < 1024


def worker_children() -> list[int]:
    """Live `mp` worker processes started by this process."""
    pids = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
            command = (stat_file.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"mp_worker" in command:
            pids.append(int(stat_file.parent.name))
    return pids


def test_a_rank_that_fails_to_start_raises_its_error_and_leaves_no_worker() -> None:
    before = set(worker_children())
    with pytest.raises(ValueError, match=r"tensor-parallel rank [01]: num_kv_blocks=\d+ asks for"):
        LLM("hash", tensor_parallel_size=2, **{**HASH_OPTIONS, "num_kv_blocks": 10**13})
    assert set(worker_children()) <= before


def test_async_llm_tp2_outputs_and_collective_rpc_in_rank_order() -> None:
    async def scenario() -> tuple[list[int], list[dict[str, Any]]]:
        llm = AsyncLLM("hash", tensor_parallel_size=2, **HASH_OPTIONS)
        try:
            final = None
            async for output in llm.generate({"prompt_token_ids": prompt(1)}, greedy(16), "r"):
                final = output
            assert final is not None
            return list(final.outputs[0].token_ids), await llm.collective_rpc("rank_info")
        finally:
            llm.shutdown()

    tokens, infos = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT_S))
    assert tokens == reference_tokens(prompt(1), 16)
    assert [info["rank"] for info in infos] == [0, 1]
    wait_until(lambda: not any(is_running(info["pid"]) for info in infos), "workers stopped", 10)


def test_server_at_tp2_rpc_endpoint_and_workers_end_with_their_engine_process() -> None:
    """`kvflow serve --tensor-parallel-size 2`: the admin endpoint answers per rank in rank order; when the
    engine-core process is killed its workers (whose parent it is) exit by themselves, /health turns 503, and
    stopping the server leaves no process."""
    with running_server(
        *HASH_SERVER, "--tensor-parallel-size", "2", "--enable-admin-endpoints"
    ) as server:
        response = server.post("/collective_rpc", json={"method": "rank_info"})
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert [result["rank"] for result in results] == [0, 1]
        completion = server.post(
            "/v1/completions",
            json={"model": "hash", "prompt": prompt(2), "max_tokens": 8, "temperature": 0},
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] is not None
        [engine_pid] = {result["parent_pid"] for result in results}
        os.kill(engine_pid, signal.SIGKILL)
        wait_until(lambda: not any(is_running(r["pid"]) for r in results), "workers exited", 15)
        wait_until(lambda: server.get("/health").status_code == 503, "/health is 503")
        server.stop()
        assert server.leftover_processes() == []


def test_killed_rank_fails_the_engine_naming_it_without_a_hang(hash_tp2: LLM) -> None:
    """Runs last in this module: it kills the shared engine's rank 1 mid-generation."""
    llm = hash_tp2
    executor = llm.run_in_engine(lambda core: core.executor)
    assert isinstance(executor, MultiprocExecutor)
    pids = list(executor.pids)
    started = executor.num_broadcasts

    def kill_rank_1_mid_generation() -> None:
        wait_until(lambda: executor.num_broadcasts > started + 20, "steps ran")
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1_mid_generation)
    killer.start()
    began = time.monotonic()
    # The engine dies of the rank's death: the call raises EngineDeadError naming the rank, caused by it.
    with pytest.raises(
        EngineDeadError, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\)"
    ) as died:
        llm.generate(
            [{"prompt_token_ids": prompt(seed)} for seed in range(8)], greedy(450), use_tqdm=False
        )
    assert isinstance(died.value.__cause__, WorkerDiedError)
    assert time.monotonic() - began < 20  # hang guard: well before any collective timeout
    killer.join()
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.collective_rpc("rank_info")  # later calls fail at once, with the same error
    wait_until(lambda: not any(is_running(pid) for pid in pids), "no worker left", 10)
