"""EngineCore: stepping, aborts reaching the worker, forced reset mid-run."""

from __future__ import annotations

from kvflow.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvflow.engine.core import EngineCore
from kvflow.request import Request
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
