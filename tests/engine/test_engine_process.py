"""The engine core in its own process (`AsyncLLM(engine_process=True)`): the same outputs as the in-process engine,
collective_rpc and weight updates across the boundary, startup errors, a dying or killed engine process, signals,
shutdown without orphans, and a child that ends with its parent.

Real processes and sockets throughout; waits are hang guards (`wait_until`), never timing assertions.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvflow import RequestOutput, SamplingParams, StreamingInput
from kvflow.core.sched.output import EngineCoreOutput, SchedulerStats
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError
from kvflow.engine.core_proc import ENGINE_CORE_PROCESS_NAME
from kvflow.engine.mp_client import MPEngineCoreClient
from kvflow.entrypoints.llm import LLM
from kvflow.model_info import ModelInfo, resolve_model_info
from kvflow.request import Request
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.streams import check_stream_shape, fold_outputs
from kvflow.testing.waiting import wait_until

T = TypeVar("T")
TIMEOUT_S = 60.0  # hang guard
LONG = 400
HASH_OPTIONS: dict[str, Any] = dict(
    max_num_seqs=8, num_kv_blocks=256, block_size=4, max_model_len=512, max_num_batched_tokens=64
)
TEXT_OPTIONS: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=128, max_num_seqs=8)
TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time"


# ------------------------------------------------------------------------------------------------ helpers
def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def prompt(seed: int, length: int = 6) -> dict[str, list[int]]:
    return {"prompt_token_ids": [(seed * 37 + j * 11) % 991 + 1 for j in range(length)]}


async def collect(
    llm: AsyncLLM, prompt_: Any, params: SamplingParams | None = None, request_id: str | None = None
) -> list[RequestOutput]:
    return [output async for output in llm.generate(prompt_, params, request_id)]


def engine_children() -> set[int]:
    return {
        child.pid
        for child in multiprocessing.active_children()
        if child.name == ENGINE_CORE_PROCESS_NAME and child.pid is not None
    }


def process_state(pid: int) -> str | None:
    """The process's state letter (`Z`: exited, not yet reaped), or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def catches_signal(pid: int, signum: int) -> bool:
    """Whether the process has a handler installed for `signum` (its SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    [mask] = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(mask, 16) >> (signum - 1) & 1)


def core_pid(llm: AsyncLLM) -> int:
    client = llm.engine_core_client
    assert isinstance(client, MPEngineCoreClient)
    return client.pid


def summary(output: RequestOutput) -> list[tuple[Any, ...]]:
    return [
        (
            completion.index,
            completion.text,
            list(completion.token_ids),
            completion.finish_reason,
            completion.stop_reason,
        )
        for completion in output.outputs
    ]


@pytest.fixture(scope="module")
def hash_engines() -> Iterator[tuple[AsyncLLM, AsyncLLM]]:
    """The hash model behind the in-process client and behind the engine-core process, same options."""
    inproc = AsyncLLM("hash", **HASH_OPTIONS)
    proc = AsyncLLM("hash", engine_process=True, **HASH_OPTIONS)
    yield inproc, proc
    inproc.shutdown()
    proc.shutdown()


@pytest.fixture(scope="module")
def text_engines() -> Iterator[tuple[AsyncLLM, AsyncLLM]]:
    """The default model, both ways."""
    inproc = AsyncLLM(**TEXT_OPTIONS)
    proc = AsyncLLM(engine_process=True, **TEXT_OPTIONS)
    yield inproc, proc
    inproc.shutdown()
    proc.shutdown()


# ------------------------------------------------------------------------------------------------ same outputs
def test_hash_model_streams_are_identical_through_both_clients(
    hash_engines: tuple[AsyncLLM, AsyncLLM],
) -> None:
    cases = [
        (prompt(seed, 3 + seed % 7), 5 + 3 * seed, kind)
        for seed in range(12)
        for kind in ("cumulative", "delta", "final_only")
    ]

    async def streams(llm: AsyncLLM) -> list[list[tuple[Any, ...]]]:
        results = await asyncio.gather(
            *(
                collect(llm, p, SamplingParams(max_tokens=n, output_kind=kind))  # type: ignore[arg-type]
                for p, n, kind in cases
            )
        )
        # Outputs coalesce when a consumer falls behind, so streams compare by what they add up to.
        for (_, _, kind), outputs in zip(cases, results, strict=True):
            check_stream_shape(outputs, kind)
        return [
            summary(fold_outputs(outputs, kind))
            for (_, _, kind), outputs in zip(cases, results, strict=True)
        ]

    inproc, proc = hash_engines
    from_proc = run(streams(proc))
    assert from_proc == run(streams(inproc))
    for (p, n, _), [folded] in zip(cases, from_proc, strict=True):
        assert folded[2] == reference_tokens(p["prompt_token_ids"], n)


def test_hash_model_parallel_samples_and_aborts_through_the_engine_process(
    hash_engines: tuple[AsyncLLM, AsyncLLM],
) -> None:
    _, proc = hash_engines

    async def main() -> None:
        [final] = await collect(
            proc, prompt(3), SamplingParams(n=3, max_tokens=7, output_kind="final_only")
        )
        assert [completion.index for completion in final.outputs] == [0, 1, 2]
        expected = reference_tokens(prompt(3)["prompt_token_ids"], 7)
        assert all(list(completion.token_ids) == expected for completion in final.outputs)
        stream = proc.generate(prompt(4), SamplingParams(max_tokens=LONG), "long")
        await stream.__anext__()
        await proc.abort("long")
        last = [output async for output in stream][-1]
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert 1 <= len(last.outputs[0].token_ids) < LONG
        assert not await proc.run_in_engine(lambda core: dict(core.scheduler.requests))

    run(main())


def test_default_model_outputs_are_identical_through_both_clients(
    text_engines: tuple[AsyncLLM, AsyncLLM],
) -> None:
    greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=24)
    requests: list[tuple[Any, SamplingParams]] = [
        (TEXT, SamplingParams(**greedy)),
        ("Hello, my name is", SamplingParams(**greedy, logprobs=3)),
        (TEXT, SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12)),
        ({"prompt_token_ids": [5, 17, 99, 3]}, SamplingParams(**greedy)),
    ]

    async def finals(llm: AsyncLLM) -> list[RequestOutput]:
        results = await asyncio.gather(*(collect(llm, p, params) for p, params in requests))
        return [outputs[-1] for outputs in results]

    inproc, proc = text_engines
    expected = run(finals(inproc))
    actual = run(finals(proc))
    for want, got in zip(expected, actual, strict=True):
        assert summary(got) == summary(want)
        assert got.prompt_token_ids == want.prompt_token_ids and got.finished
    assert actual[0].outputs[0].text  # real text came through
    want_logprobs, got_logprobs = expected[1].outputs[0].logprobs, actual[1].outputs[0].logprobs
    assert got_logprobs is not None and want_logprobs is not None
    assert [sorted(step) for step in got_logprobs] == [sorted(step) for step in want_logprobs]
    for want_step, got_step in zip(want_logprobs, got_logprobs, strict=True):
        for (
            token_id,
            want_logprob,
        ) in want_step.items():  # one thread there, two here: float noise only
            assert got_step[token_id].logprob == pytest.approx(want_logprob.logprob, abs=1e-4)

    # a stop string: the same cut, and the stopped request is aborted in the engine process
    stop = actual[0].outputs[0].text[8:11]

    async def stopped(llm: AsyncLLM) -> RequestOutput:
        params = SamplingParams(**greedy, stop=[stop])
        return (await collect(llm, TEXT, params))[-1]

    stopped_proc = run(stopped(proc))
    assert summary(stopped_proc) == summary(run(stopped(inproc)))
    assert stopped_proc.outputs[0].finish_reason == "stop"
    assert not run(proc.run_in_engine(lambda core: dict(core.scheduler.requests)))


def test_streaming_input_session_through_the_engine_process(
    hash_engines: tuple[AsyncLLM, AsyncLLM],
) -> None:
    _, proc = hash_engines
    chunks = [[5, 6, 7, 8, 9], [21, 22, 23]]

    async def inputs() -> Any:
        for chunk in chunks:
            yield StreamingInput({"prompt_token_ids": chunk}, SamplingParams(max_tokens=3))

    outputs = run(collect(proc, inputs(), request_id="session"))
    ends = [output for output in outputs if output.outputs[0].finish_reason is not None]
    first = reference_tokens(chunks[0], 3)
    second = reference_tokens(chunks[0] + first[:-1] + chunks[1], 3)
    assert [list(end.outputs[0].token_ids) for end in ends] == [first, second]
    assert [end.finished for end in ends] == [False, True]


# ------------------------------------------------------------------------------------------------ admin calls
def test_collective_rpc_runs_on_the_worker_through_every_front_end(
    hash_engines: tuple[AsyncLLM, AsyncLLM],
) -> None:
    inproc, proc = hash_engines
    factor = 3  # a closure: the callable travels by value

    def blocks(worker: Any, scale: int = 1) -> int:
        return worker.num_kv_blocks * scale * factor

    for llm in (inproc, proc):
        assert run(llm.collective_rpc(blocks, kwargs={"scale": 2})) == [256 * 2 * factor]
        assert run(llm.collective_rpc("execute_method", args=(blocks,))) == [256 * factor]
        with pytest.raises(AttributeError, match="no public method 'warp_drive'"):
            run(llm.collective_rpc("warp_drive"))
    llm_offline = LLM("hash", **HASH_OPTIONS)
    assert llm_offline.collective_rpc(blocks, (5,)) == [256 * 5 * factor]
    assert llm_offline.collective_rpc(lambda worker: type(worker).__name__) == ["Worker"]


def test_reset_prefix_cache_and_pause_modes_through_the_engine_process(
    hash_engines: tuple[AsyncLLM, AsyncLLM],
) -> None:
    _, proc = hash_engines

    async def main() -> None:
        await collect(proc, prompt(20, 40), SamplingParams(max_tokens=2))
        assert await proc.reset_prefix_cache()
        frozen = proc.generate(
            prompt(21), SamplingParams(max_tokens=60, output_kind="delta"), "frozen"
        )
        tokens = list((await frozen.__anext__()).outputs[0].token_ids)
        await proc.pause_generation(mode="keep", clear_cache=False)
        assert await proc.is_paused()
        assert not await proc.reset_prefix_cache()  # its blocks are in use
        assert await proc.reset_prefix_cache(reset_running_requests=True)
        await proc.resume_generation()
        tokens += [token async for output in frozen for token in output.outputs[0].token_ids]
        assert tokens == reference_tokens(
            prompt(21)["prompt_token_ids"], 60
        )  # exact after recompute
        running = proc.generate(prompt(22), SamplingParams(max_tokens=LONG), "running")
        await running.__anext__()
        await proc.pause_generation(mode="abort")
        assert [output async for output in running][-1].outputs[0].finish_reason == "abort"
        await proc.resume_generation()

    run(main())


def test_update_weights_from_a_folder_while_paused(text_engines: tuple[AsyncLLM, AsyncLLM]) -> None:
    _, proc = text_engines
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)

    async def main() -> None:
        before = (await collect(proc, "Hello", params))[-1].outputs[0]
        with pytest.raises(RuntimeError, match="paused"):
            await proc.update_weights(str(proc.model_info.path))
        await proc.pause_generation(mode="keep")
        version = await proc.update_weights(proc.model_info.path)  # a Path is a folder, too
        with pytest.raises(ValueError, match="in-process engines only"):
            await proc.update_weights({})  # a state dict of tensors does not cross processes
        await proc.resume_generation()
        after = (await collect(proc, "Hello", params))[-1].outputs[0]
        assert after.weight_versions == [version] and version > before.weight_versions[-1]
        assert after.token_ids == before.token_ids  # the same weights, reloaded

    run(main())


# ------------------------------------------------------------------------------------------------ startup
@pytest.mark.parametrize(
    "options",
    [dict(max_model_len=1024, num_kv_blocks=8), dict(kv_cache_memory_bytes=1)],
    ids=["max_model_len_too_long", "kv_cache_holds_no_block"],
)
def test_startup_value_errors_reach_the_caller_unchanged(options: dict[str, Any]) -> None:
    options = {**HASH_OPTIONS, "num_kv_blocks": None, **options}
    with pytest.raises(ValueError) as in_process:
        AsyncLLM("hash", **options)
    children = engine_children()
    with pytest.raises(ValueError) as in_engine_process:
        AsyncLLM("hash", engine_process=True, **options)
    assert str(in_engine_process.value) == str(in_process.value)
    assert engine_children() == children  # the failed engine process is gone


def test_llm_over_an_engine_process_matches_the_in_process_llm_and_leaves_no_process() -> None:
    """`LLM(engine_process=True)` is the same front end over the multiprocess client: the same exact outputs (with
    `n`, and with a stop token), inspection and pause across the boundary, and nothing left once shut down."""
    children = engine_children()
    prompts = [prompt(seed, 5 + seed) for seed in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True),
    ] * 3
    in_process = LLM("hash", **HASH_OPTIONS).generate(prompts, params, use_tqdm=False)
    llm = LLM("hash", engine_process=True, **HASH_OPTIONS)
    try:
        assert llm.run_in_engine(lambda core: os.getpid()) != os.getpid()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outputs] == [
            [c.token_ids for c in o.outputs] for o in in_process
        ]
        assert outputs[0].outputs[0].token_ids == reference_tokens(
            prompts[0]["prompt_token_ids"], 24
        )
        llm.pause_generation(mode="keep")
        assert llm.is_paused()
        llm.resume_generation()
        assert llm.scheduler_stats()[0].num_running_reqs == 0
    finally:
        llm.shutdown()
    assert engine_children() == children
    with pytest.raises(EngineDeadError):
        llm.generate(prompts[:1], params[0], use_tqdm=False)


class ExitsWhenUnpickled:
    """Stands in for the model info: unpickling it ends the engine process at once (exit code 3), before it can
    say anything: a crash during startup."""

    def __reduce__(self) -> Any:
        return (os._exit, (3,))


class SlowModelInfo(ModelInfo):
    """A model whose loading takes ten minutes (its EOS id is looked up while the worker is built)."""

    @property
    def eos_token_id(self) -> int | None:
        time.sleep(600)
        return super().eos_token_id


def hash_engine_config() -> Any:
    return EngineArgs("hash", **HASH_OPTIONS).create_engine_config(resolve_model_info("hash"))


def ignore_outputs(outputs: list[EngineCoreOutput], stats: SchedulerStats) -> None:
    pass


def test_a_crash_during_startup_is_a_runtime_error_naming_the_engine_process() -> None:
    children = engine_children()
    with pytest.raises(
        RuntimeError, match=r"engine core process \(pid \d+\) exited during startup"
    ) as info:
        MPEngineCoreClient(hash_engine_config(), ExitsWhenUnpickled(), ignore_outputs, print)  # type: ignore[arg-type]
    assert "exit code 3" in str(info.value)
    assert engine_children() == children


def test_a_signal_during_startup_stops_the_engine_process_at_once() -> None:
    info = resolve_model_info("hash")
    slow = SlowModelInfo(*(getattr(info, name) for name in ModelInfo.__dataclass_fields__))
    children = engine_children()
    outcome: Future[Any] = Future()

    def start() -> None:
        try:
            outcome.set_result(
                MPEngineCoreClient(hash_engine_config(), slow, ignore_outputs, print)
            )
        except BaseException as error:
            outcome.set_exception(error)

    threading.Thread(target=start, daemon=True).start()
    wait_until(lambda: bool(engine_children() - children), "the engine process started")
    [pid] = engine_children() - children
    wait_until(lambda: catches_signal(pid, signal.SIGTERM), "the engine process handles SIGTERM")
    os.kill(pid, signal.SIGTERM)
    with pytest.raises(RuntimeError, match=rf"engine core process \(pid {pid}\)"):
        outcome.result(TIMEOUT_S)  # not the ten minutes of loading
    assert engine_children() == children


# ------------------------------------------------------------------------------------------------ the client itself
class Recorder:
    """The front end's side of a bare client: outputs per request, the threads that delivered them, and the dead
    error. `on_first_token` runs inside the output handler the first time a request produces a token."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: list[str] = []
        self.threads: set[str] = set()
        self.dead: list[EngineDeadError] = []
        self.started = threading.Event()
        self.on_first_token: Callable[[str], None] = lambda request_id: None

    def on_outputs(self, outputs: list[EngineCoreOutput], stats: SchedulerStats) -> None:
        self.threads.add(threading.current_thread().name)
        for output in outputs:
            if output.request_id not in self.tokens:
                self.on_first_token(output.request_id)
            self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            self.started.set()
            if output.finished:
                self.finished.append(output.request_id)

    def on_dead(self, error: EngineDeadError) -> None:
        self.dead.append(error)


def core_request(request_id: str, prompt_: list[int], max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt_, params)


def test_the_client_orders_outputs_before_answers_and_sends_handler_calls_as_one_batch() -> None:
    recorder = Recorder()
    client = MPEngineCoreClient(hash_engine_config(), None, recorder.on_outputs, recorder.on_dead)

    def add_then_abort(
        request_id: str,
    ) -> None:  # from the output handler: applied with no step between
        if request_id == "x":
            client.add_requests([core_request("y", [4] * 5, 50)])
            client.abort_requests(["y"])

    recorder.on_first_token = add_then_abort
    try:
        rejected = client.add_requests(
            [core_request("ok", [1] * 5, 3), core_request("big", [2] * 600, 3)]
        )
        with pytest.raises(ValueError, match="max_model_len"):
            rejected.result(TIMEOUT_S)
        client.add_requests([core_request("x", [3] * 5, 40)]).result(TIMEOUT_S)
        assert recorder.started.wait(TIMEOUT_S)
        # "wait" is in effect once "x" has finished, and every output before that was handled first
        client.pause_generation("wait", clear_cache=False).result(TIMEOUT_S)
        assert recorder.finished == ["x"]
        assert recorder.tokens == {"x": reference_tokens([3] * 5, 40)}  # "y" never ran a step
        assert client.is_paused().result(TIMEOUT_S) is True
        client.resume_generation().result(TIMEOUT_S)
        assert client.run(lambda core: dict(core.scheduler.requests)).result(TIMEOUT_S) == {}
        assert recorder.threads == {"kvflow-engine-core-client"}
    finally:
        client.shutdown()
    client.shutdown()
    assert [str(error) for error in recorder.dead] == ["the engine core is shut down"]
    with pytest.raises(EngineDeadError, match="shut down"):
        client.is_paused()


def test_a_request_that_fails_validation_where_it_is_decoded_fails_alone() -> None:
    """A SamplingParams changed after it was built encodes fine but fails validation in the engine process: its
    call gets the ValueError, and the engine goes on serving."""
    recorder = Recorder()
    client = MPEngineCoreClient(hash_engine_config(), None, recorder.on_outputs, recorder.on_dead)
    try:
        bad = core_request("bad", [1, 2], 4)
        bad.sampling_params.top_k = 2**40
        with pytest.raises(ValueError, match="top_k"):
            client.add_requests([bad]).result(TIMEOUT_S)
        client.add_requests([core_request("ok", [1] * 5, 3)]).result(TIMEOUT_S)
        wait_until(lambda: recorder.finished == ["ok"], "the next request finished")
        assert recorder.tokens == {"ok": reference_tokens([1] * 5, 3)}
        assert not recorder.dead
    finally:
        client.shutdown()


# ------------------------------------------------------------------------------------------------ death, shutdown
def test_killing_the_engine_process_fails_every_consumer_and_later_calls() -> None:
    llm = AsyncLLM("hash", engine_process=True, **HASH_OPTIONS)
    pid = core_pid(llm)

    async def main() -> None:
        streams = [llm.generate(prompt(seed), SamplingParams(max_tokens=LONG)) for seed in range(3)]
        for stream in streams:
            await stream.__anext__()

        async def session_inputs() -> Any:
            yield StreamingInput(prompt(9), SamplingParams(max_tokens=LONG))
            await asyncio.Event().wait()  # the input never ends

        session = llm.generate(session_inputs())
        await session.__anext__()
        pending = asyncio.ensure_future(llm.run_in_engine(lambda core: time.sleep(600)))
        os.kill(pid, signal.SIGKILL)
        for stream in [*streams, session]:
            with pytest.raises(EngineDeadError, match=rf"pid {pid}\) exited unexpectedly.*SIGKILL"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await pending
        assert llm.errored
        with pytest.raises(EngineDeadError):
            await collect(llm, prompt(1), SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await llm.pause_generation()
        with pytest.raises(EngineDeadError):
            await llm.collective_rpc("execute_method")

    run(main())
    llm.shutdown()
    llm.shutdown()
    assert pid not in engine_children() and process_state(pid) is None


def test_shutdown_leaves_no_process_and_is_idempotent() -> None:
    llm = AsyncLLM("hash", engine_process=True, **HASH_OPTIONS)
    pid = core_pid(llm)
    assert pid in engine_children() and process_state(pid) not in (None, "Z")

    async def main() -> None:
        stream = llm.generate(prompt(2), SamplingParams(max_tokens=LONG), "live")
        await stream.__anext__()
        llm.shutdown()
        final = [output async for output in stream][-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError, match="shut down"):
            await llm.is_paused()

    run(main())
    assert pid not in engine_children() and process_state(pid) is None  # stopped and reaped
    assert not llm.engine_core_client.is_alive() and not llm.errored
    llm.shutdown()


def sleep_after_touching(marker: Path) -> Callable[[Any], None]:
    def busy(core: Any) -> None:
        marker.touch()
        time.sleep(600)

    return busy


def test_sigterm_stops_the_engine_process_and_a_second_one_is_not_swallowed(
    tmp_path: Path,
) -> None:
    llm = AsyncLLM("hash", engine_process=True, **HASH_OPTIONS)
    pid = core_pid(llm)
    marker = tmp_path / "busy"
    busy: Future[Any] = llm.engine_core_client.run(sleep_after_touching(marker))
    wait_until(marker.exists, "the engine loop runs the sleeping call")
    assert catches_signal(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGTERM)  # asks the loop to stop after the running call, which sleeps on
    wait_until(lambda: not catches_signal(pid, signal.SIGTERM), "the first SIGTERM was handled")
    os.kill(pid, signal.SIGTERM)  # the default action now: the process ends mid-call
    with pytest.raises(EngineDeadError, match="killed by SIGTERM"):
        busy.result(TIMEOUT_S)
    llm.shutdown()
    assert process_state(pid) is None

    idle = AsyncLLM("hash", engine_process=True, **HASH_OPTIONS)
    idle_pid = core_pid(idle)
    wait_until(
        lambda: catches_signal(idle_pid, signal.SIGTERM), "the engine process handles SIGTERM"
    )
    os.kill(idle_pid, signal.SIGTERM)  # one signal: a clean stop
    with pytest.raises(EngineDeadError, match=r"exited unexpectedly \(exit code 0\)"):
        run(collect(idle, prompt(1), SamplingParams(max_tokens=LONG)))
    idle.shutdown()


PARENT_SCRIPT = """
import asyncio, gc, sys, time
import torch
from kvflow import SamplingParams
from kvflow.engine.async_llm import AsyncLLM

async def generate(llm):
    outputs = [output async for output in llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5))]
    return outputs[-1].outputs[0].token_ids

if __name__ == "__main__":
    llm = AsyncLLM("hash", engine_process=True, num_kv_blocks=64, block_size=4, max_model_len=128, max_num_seqs=2)
    tokens = asyncio.run(generate(llm))
    gc.collect()
    objects = gc.get_objects()
    tensors = sum(isinstance(item, torch.Tensor) for item in objects)
    modules = sum(isinstance(item, torch.nn.Module) for item in objects)
    client = llm.engine_core_client
    print(client.pid, client._resources.ipc_dir, tokens, tensors, modules, flush=True)
    time.sleep(600)
"""


def read_line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        assert selector.select(TIMEOUT_S), "the parent process printed nothing"
    return process.stdout.readline()


def test_the_engine_process_ends_with_its_parent_and_the_parent_holds_no_model(
    tmp_path: Path,
) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    with (tmp_path / "parent.log").open("w") as log:
        parent = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=log, text=True
        )
    try:
        line = read_line(parent)
        assert line, f"the parent failed: {(tmp_path / 'parent.log').read_text()}"
        pid_text, ipc_dir, rest = line.split(" ", 2)
        child_pid = int(pid_text)
        assert Path(ipc_dir).is_dir()
        tokens_text, tensors, modules = rest.rsplit(" ", 2)
        assert tokens_text == str(reference_tokens([1, 2, 3], 5))
        assert (int(tensors), int(modules)) == (
            0,
            0,
        )  # the model and its KV cache live in the child only
        assert process_state(child_pid) not in (None, "Z")
        parent.kill()
        parent.wait(TIMEOUT_S)
        wait_until(
            lambda: process_state(child_pid) in (None, "Z"), "the orphaned engine process exited"
        )
        assert not Path(
            ipc_dir
        ).exists()  # it removed the sockets' folder its dead parent could not
    finally:
        parent.kill()
        parent.wait(TIMEOUT_S)
