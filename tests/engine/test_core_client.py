"""InprocEngineCoreClient: the engine-core client interface, driven directly (AsyncLLM's tests drive it end to end)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvflow.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvflow.core.sched.output import EngineCoreOutput, SchedulerStats
from kvflow.engine.core import EngineCore
from kvflow.engine.core_client import EngineDeadError, InprocEngineCoreClient
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.waiting import wait_until

TIMEOUT_S = 20.0


class Recorder:
    """The front end's side: collects outputs per request (from the engine thread) and the dead error."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: list[str] = []
        self.dead: list[EngineDeadError] = []
        self.finished_event = threading.Event()
        self.threads: set[str] = set()
        self.stats: list[SchedulerStats] = []

    def on_outputs(self, outputs: list[EngineCoreOutput], stats: SchedulerStats) -> None:
        self.threads.add(threading.current_thread().name)
        self.stats.append(stats)
        for output in outputs:
            self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                self.finished.append(output.request_id)
                self.finished_event.set()

    def on_dead(self, error: EngineDeadError) -> None:
        self.dead.append(error)


def make_core(async_scheduling: bool = True) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model_config=ModelConfig(model="hash", max_model_len=128),
            cache_config=CacheConfig(block_size=4, num_kv_blocks=64),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=32,
                max_model_len=128,
                async_scheduling=async_scheduling,
            ),
        )
    )


@pytest.fixture
def client_and_recorder() -> Iterator[tuple[InprocEngineCoreClient, Recorder]]:
    recorder = Recorder()
    client = InprocEngineCoreClient(make_core(), recorder.on_outputs, recorder.on_dead)
    yield client, recorder
    client.shutdown()


def request(
    request_id: str, prompt: list[int], max_tokens: int, resumable: bool = False
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, resumable=resumable)


def test_outputs_reach_the_handler_on_the_engine_thread_and_rejections_fail_their_caller(
    client_and_recorder: tuple[InprocEngineCoreClient, Recorder],
) -> None:
    client, recorder = client_and_recorder
    rejected = client.add_requests([request("ok", [1] * 5, 3), request("long", [2] * 500, 3)])
    with pytest.raises(ValueError, match="max_model_len"):
        rejected.result(TIMEOUT_S)
    client.add_requests([request("a", [3] * 5, 6), request("b", [4] * 9, 4)]).result(TIMEOUT_S)
    while len(recorder.finished) < 2:
        assert recorder.finished_event.wait(TIMEOUT_S)
        recorder.finished_event.clear()
    assert recorder.tokens == {"a": reference_tokens([3] * 5, 6), "b": reference_tokens([4] * 9, 4)}
    assert recorder.threads == {"kvflow-engine-core"}
    # The stats that came with the last outputs: both requests had finished, their blocks were free.
    assert recorder.stats[0].num_running_reqs == 2
    assert (recorder.stats[-1].num_running_reqs, recorder.stats[-1].kv_cache_usage) == (0, 0.0)
    assert client.run(lambda core: sorted(core.scheduler.requests)).result(TIMEOUT_S) == []


def test_close_session_reports_whether_the_session_ended_at_once(
    client_and_recorder: tuple[InprocEngineCoreClient, Recorder],
) -> None:
    client, recorder = client_and_recorder
    client.add_requests([request("s", [5] * 6, 2, resumable=True)]).result(TIMEOUT_S)
    idle = client.run(lambda core: core.scheduler.num_waiting_for_streaming_input)
    while idle.result(TIMEOUT_S) == 0:  # the chunk runs, then the session parks between chunks
        idle = client.run(lambda core: core.scheduler.num_waiting_for_streaming_input)
    assert recorder.tokens["s"] == reference_tokens([5] * 6, 2) and not recorder.finished
    assert client.close_session("s").result(TIMEOUT_S) is True
    assert client.run(lambda core: dict(core.scheduler.requests)).result(TIMEOUT_S) == {}


def test_an_engine_error_fails_pending_calls_tells_the_front_end_once_and_refuses_later_calls() -> (
    None
):
    recorder = Recorder()
    core = make_core(async_scheduling=False)
    run_step = core.executor.execute_model
    pause_sent = threading.Event()
    num_steps = 0

    def crash_after_the_first_step(*args: object, **kwargs: object) -> object:
        nonlocal num_steps
        num_steps += 1
        if num_steps == 1:
            return run_step(*args, **kwargs)  # type: ignore[arg-type]
        assert pause_sent.wait(TIMEOUT_S)
        raise RuntimeError("device lost")

    core.executor.execute_model = crash_after_the_first_step  # type: ignore[method-assign]
    client = InprocEngineCoreClient(core, recorder.on_outputs, recorder.on_dead)
    client.add_requests([request("x", [1] * 5, 50)])
    deadline = time.monotonic() + TIMEOUT_S
    while "x" not in recorder.tokens:  # the first step ran: "x" has started
        assert time.monotonic() < deadline, "the first step never reported"
        time.sleep(0.01)
    # "wait" stays pending while a started request runs: the crash must fail it.
    pause = client.pause_generation("wait", clear_cache=False)
    pause_sent.set()
    with pytest.raises(EngineDeadError) as info:
        pause.result(TIMEOUT_S)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert len(recorder.dead) == 1 and recorder.dead[0].__cause__ is info.value.__cause__
    with pytest.raises(EngineDeadError):
        client.is_paused()
    client.shutdown()
    client.shutdown()
    assert not client.is_alive()


def test_shutdown_is_idempotent_and_later_calls_raise(
    client_and_recorder: tuple[InprocEngineCoreClient, Recorder],
) -> None:
    client, recorder = client_and_recorder
    assert client.is_paused().result(TIMEOUT_S) is False
    client.shutdown()
    client.shutdown()
    assert not client.is_alive()
    assert client.dead_error is not None and client.dead_error.__cause__ is None
    assert len(recorder.dead) == 1
    with pytest.raises(EngineDeadError, match="shut down"):
        client.add_requests([request("late", [1] * 4, 2)])


def test_a_core_built_on_the_loop_thread_is_built_and_stepped_there() -> None:
    """`built_on_loop_thread`: `build()` runs on the loop's thread, the one every later step and call runs on
    (one OpenMP pool for model loading and forward passes), and the client then serves as any other."""
    recorder = Recorder()
    built_on: list[str] = []

    def build() -> EngineCore:
        built_on.append(threading.current_thread().name)
        return make_core()

    client, core = InprocEngineCoreClient.built_on_loop_thread(
        build, recorder.on_outputs, recorder.on_dead
    )
    try:
        assert built_on == ["kvflow-engine-core"]
        assert threading.current_thread().name != "kvflow-engine-core"
        assert client.run(lambda engine: (engine, threading.current_thread().name)).result(
            TIMEOUT_S
        ) == (core, "kvflow-engine-core")
        client.add_requests([request("a", [3, 4, 5], 6)])
        assert recorder.finished_event.wait(TIMEOUT_S), "request a never finished"
        assert recorder.tokens["a"] == reference_tokens([3, 4, 5], 6)
        assert recorder.threads == {"kvflow-engine-core"}
    finally:
        client.shutdown()
    assert not client.is_alive()


def test_a_failing_build_on_the_loop_thread_raises_in_the_caller_and_leaves_no_thread() -> None:
    recorder = Recorder()
    before = {thread.ident for thread in threading.enumerate()}

    def build() -> EngineCore:
        raise ValueError("max_model_len=131072 does not fit in the KV cache")

    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        InprocEngineCoreClient.built_on_loop_thread(build, recorder.on_outputs, recorder.on_dead)
    wait_until(
        lambda: not {thread.ident for thread in threading.enumerate()} - before,
        "the loop thread of a failed build ended",
        TIMEOUT_S,
    )
    assert recorder.dead == []  # no engine ever ran: nothing died
