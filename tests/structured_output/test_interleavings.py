"""Structured outputs under every interleaving the engine simulation draws: async scheduling with two batches in
flight, preemption, forced resets, aborts, pauses in every mode, stop tokens and id reuse. Constrained requests run
a real grammar (xgrammar or llguidance) on the hash-logits model; each output must equal the grammar-constrained
reference token for token, so a matcher advanced by a discarded in-flight token (or missing a kept one) fails."""

from __future__ import annotations

import dataclasses

import pytest

from kvflow.models.hash_model import hash_grammar_stop_token_id
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from tests.engine.engine_simulation import (
    BOUNDED,
    EngineSimConfig,
    EngineSimulation,
    constrained_reference,
    make_engine_core,
    random_config,
)

PROTOCOLS = {"slot": True, "persistent_batch": False}
MODES = {"sync": False, "async": True}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("seed", range(2))
def test_constrained_requests_exact_under_random_interleavings(
    protocol: str, mode: str, seed: int
) -> None:
    config = EngineSimConfig(
        use_v2_model_runner=PROTOCOLS[protocol],
        async_scheduling=MODES[mode],
        structured_fraction=0.6,
        num_requests=30,
        num_blocks=24,  # tight: preemptions happen
    )
    stats = EngineSimulation(config, 500 + seed).run()
    assert stats.num_steps > 0


@pytest.mark.parametrize("seed", range(3))
def test_constrained_requests_exact_with_random_configs(seed: int) -> None:
    config = dataclasses.replace(random_config(700 + seed), structured_fraction=0.5)
    EngineSimulation(config, 700 + seed).run()


def test_constrained_runs_really_preempt_and_stop_on_the_grammar() -> None:
    """Coverage: these runs preempt constrained requests with tokens in flight, and outputs end with the grammar's
    stop token (the constraint completing), so both paths are exercised."""
    config = EngineSimConfig(
        async_scheduling=True, structured_fraction=1.0, num_requests=30, num_blocks=20
    )
    stats = EngineSimulation(config, 42).run()
    assert stats.num_preemptions > 0
    assert stats.num_grammar_stops > 0
    bounded = constrained_reference([1, 3, 5], 100, "bounded")
    assert bounded[-1] == hash_grammar_stop_token_id() and len(bounded) <= 7


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_grammar_mask_leaves_unconstrained_rows_untouched(async_scheduling: bool) -> None:
    """A batch mixing constrained and unconstrained requests: the unconstrained ones get exactly the plain hash
    model's tokens, the constrained ones the constrained reference."""
    core = make_engine_core(async_scheduling=async_scheduling, model="hash-logits", num_blocks=200)
    try:
        prompts = {f"r{i}": [i + 1, 2 * i + 3, 7] for i in range(8)}
        for request_id, prompt in prompts.items():
            constrained = int(request_id[1:]) % 2 == 0
            params = SamplingParams(
                temperature=0.0,
                max_tokens=12,
                ignore_eos=True,
                structured_outputs=BOUNDED if constrained else None,
            )
            core.add_request(Request(request_id, prompt, params, eos_token_id=50256))
        tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
        for _ in range(500):
            if not core.has_work():
                break
            for output in core.step():
                tokens[output.request_id] += output.new_token_ids
        from kvflow.testing.hash_model import reference_tokens

        for request_id, prompt in prompts.items():
            if int(request_id[1:]) % 2 == 0:
                assert tokens[request_id] == constrained_reference(prompt, 12, "bounded")
            else:
                assert tokens[request_id] == reference_tokens(prompt, 12)
    finally:
        core.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(30))
def test_constrained_requests_exact_with_random_configs_long(seed: int) -> None:
    config = dataclasses.replace(
        random_config(2000 + seed), structured_fraction=0.3 + (seed % 3) * 0.3
    )
    EngineSimulation(config, 2000 + seed).run()
