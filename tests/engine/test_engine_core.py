"""EngineCore: stepping, aborts reaching the worker, forced reset mid-run."""

from __future__ import annotations

import pytest

from kvflow.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvflow.engine.core import EngineCore
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams
from kvflow.testing.hash_model import reference_tokens


def make_core(**scheduler_options: object) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model_config=ModelConfig(model="hash", max_model_len=128),
            cache_config=CacheConfig(block_size=4, num_kv_blocks=64),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, **scheduler_options
            ),
        )
    )  # type: ignore[arg-type]


def request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )


def run(core: EngineCore, tokens: dict[str, list[int]], max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not core.has_work():
            return
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError("engine did not go idle")


def test_idle_step_returns_nothing() -> None:
    assert make_core().step() == []


def test_abort_frees_the_worker_slot_on_the_next_step() -> None:
    core = make_core()
    for index in range(4):
        core.add_request(request(str(index), [index + 1] * 6, 20))
    core.step()
    core.abort_requests(["0", "1"])
    assert core.has_work()
    core.add_request(request("late", [9] * 5, 3))
    tokens: dict[str, list[int]] = {}
    run(core, tokens)
    assert tokens["late"] == reference_tokens([9] * 5, 3)
    assert len(core.executor.worker.model_runner.slots.free_indices) == 4


def test_forced_reset_mid_run_keeps_outputs_exact_in_both_modes() -> None:
    for async_scheduling in (False, True):
        core = make_core(async_scheduling=async_scheduling)
        prompts = {str(index): [index + 3] * (5 + index) for index in range(4)}
        for request_id, prompt in prompts.items():
            core.add_request(request(request_id, prompt, 12))
        tokens: dict[str, list[int]] = {}
        for _ in range(4):
            for output in core.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        assert core.reset_prefix_cache(reset_running_requests=True)
        run(core, tokens)
        for request_id, prompt in prompts.items():
            assert tokens[request_id] == reference_tokens(prompt, 12), (
                async_scheduling,
                request_id,
            )


def test_add_requests_is_all_or_nothing() -> None:
    core = make_core()
    good = request("good", [3] * 6, 4)
    too_long = request("too_long", [4] * 200, 4)  # past max_model_len=128
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_requests([good, too_long])
    assert not core.scheduler.requests  # the first one was taken back
    core.add_requests([request("again", [3] * 6, 4)])
    tokens: dict[str, list[int]] = {}
    run(core, tokens)
    assert tokens == {"again": reference_tokens([3] * 6, 4)}
    assert len(core.executor.worker.model_runner.slots.free_indices) == 4


def session_chunk(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, resumable=True)


def test_close_session_ends_an_idle_session_now_and_a_running_one_with_its_chunk() -> None:
    core = make_core()
    core.add_request(session_chunk("idle", [5] * 6, 2))
    tokens: dict[str, list[int]] = {}
    run(core, tokens)
    assert core.scheduler.requests["idle"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert core.close_session("idle") is True  # ended at once: no output will report it
    assert "idle" not in core.scheduler.requests
    assert core.close_session("idle") is True  # already gone

    core.add_request(session_chunk("busy", [6] * 6, 5))
    core.step()
    assert core.close_session("busy") is False  # the running chunk's output will end it
    finished = []
    for _ in range(50):
        finished += [output for output in core.step() if output.finished]
    assert [output.request_id for output in finished] == ["busy"]
    assert not core.scheduler.requests and not core.has_work()
    assert len(core.executor.worker.model_runner.slots.free_indices) == 4
