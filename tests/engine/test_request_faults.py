"""A bad request fails alone: refused when it is added, or ended with finish_reason "error" when its fault shows
inside a step, while the engine and every other request go on with exactly the outputs they would have had."""

from __future__ import annotations

import pytest

from kvflow.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvflow.core.sched.output import EngineCoreOutput
from kvflow.engine.core import EngineCore
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.testing.hash_model import reference_tokens

MAX_STEPS = 2000


def make_core(model: str | None, async_scheduling: bool) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model_config=ModelConfig(model=model, max_model_len=128, device="cpu"),
            cache_config=CacheConfig(block_size=16, num_kv_blocks=64),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=64,
                max_model_len=128,
                async_scheduling=async_scheduling,
            ),
        )
    )  # type: ignore[arg-type]


def run(core: EngineCore) -> dict[str, EngineCoreOutput]:
    """Step until idle; each request's last output, with every token it produced gathered into it."""
    finals: dict[str, EngineCoreOutput] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        if not core.has_work():
            for request_id, output in finals.items():
                output.new_token_ids = tokens[request_id]
            return finals
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finals[output.request_id] = output
    raise AssertionError(f"the engine did not go idle within {MAX_STEPS} steps")


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=50, seed=seed, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_sampling_fault_ends_its_request_with_error_and_the_others_keep_their_tokens(
    async_scheduling: bool,
) -> None:
    """A top_k that overflows int64 in the sampler (set after admission, as a changed dataclass would be) fails
    only its own row: the other seeded requests sample exactly what they sample without it."""
    prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13, 14, 15, 16]}
    baseline = make_core(None, async_scheduling)
    for seed, (request_id, prompt) in enumerate(prompts.items()):
        baseline.add_request(Request(request_id, prompt, seeded(seed)))
    expected = {request_id: out.new_token_ids for request_id, out in run(baseline).items()}
    baseline.shutdown()

    core = make_core(None, async_scheduling)
    for seed, (request_id, prompt) in enumerate(prompts.items()):
        core.add_request(Request(request_id, prompt, seeded(seed)))
    bad_params = seeded(99)
    core.add_request(Request("bad", [20, 21, 22], bad_params))
    bad_params.top_k = 2**70  # past the core's check: the worker's slot holds this very object
    finals = run(core)
    assert finals["bad"].finish_reason == "error"
    assert "OverflowError" in str(finals["bad"].stop_reason)
    assert {request_id: finals[request_id].new_token_ids for request_id in prompts} == expected
    # The engine lives on: a new request runs to its full length afterwards.
    core.add_request(Request("after", [3, 4], seeded(7)))
    assert len(run(core)["after"].new_token_ids) == 12
    assert len(core.executor.worker.model_runner.slots.free_indices) == 4
    core.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_fault_applying_an_output_ends_its_request_with_error(async_scheduling: bool) -> None:
    core = make_core("hash", async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    core.add_request(Request("good", [1, 2, 3], params))
    broken = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    core.add_request(Request("bad", [4, 5, 6], broken))
    core.step()
    broken.stop_token_ids = 5  # type: ignore[assignment]  # the stop check cannot look a token up in it
    finals = run(core)
    assert finals["bad"].finish_reason == "error"
    assert "TypeError" in str(finals["bad"].stop_reason)
    assert finals["good"].new_token_ids[-9:] == reference_tokens([1, 2, 3], 10)[-9:]
    assert not core.scheduler.requests
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.shutdown()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"top_k": 2**40}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"logprobs": 3}, "logprobs"),  # the hash model has no logits
    ],
)
def test_the_core_refuses_a_request_changed_after_it_was_checked(
    change: dict[str, object], field: str
) -> None:
    core = make_core("hash", False)
    core.add_request(Request("good", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    params = SamplingParams(max_tokens=4)
    for name, value in change.items():
        setattr(params, name, value)
    with pytest.raises(ValueError, match=field):
        core.add_requests(
            [Request("ok-sibling", [7, 8], SamplingParams()), Request("bad", [7], params)]
        )
    assert set(core.scheduler.requests) == {"good"}  # all or nothing: the sibling was taken back
    with pytest.raises(ValueError, match="prompt_token_ids"):
        core.add_request(Request("outside", [1, 10**9], SamplingParams()))
    with pytest.raises(ValueError, match="priority"):
        core.add_request(Request("priority", [1], SamplingParams(), priority=2**64))
    assert run(core)["good"].new_token_ids == reference_tokens([1, 2, 3], 4)
    core.shutdown()
