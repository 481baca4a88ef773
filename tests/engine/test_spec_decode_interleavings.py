"""Speculative decoding under the randomized engine simulation (`engine_simulation.py`): the whole EngineCore with
adds, aborts in every state, forced resets with batches in flight, pauses in every mode, resumes, stop tokens and
streaming-input sessions, for both runner protocols and both scheduling modes, with drafts from
`HashOracleProposer` (every accepted length from 0 to k occurs). Every finished request must equal the hash-model
oracle, aborted ones a prefix of it, and nothing may leak: a step in flight that verified drafts is discarded
whole after a preemption, whatever it accepted."""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.engine_simulation import EngineSimConfig, EngineSimulation, random_config

PROTOCOLS = {"slot": True, "persistent": False}
SCHEDULING = {"sync": False, "async": True}


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("seed", range(2))
def test_random_interleavings_with_drafts_keep_every_invariant(
    protocol: str, scheduling: str, seed: int
) -> None:
    config = EngineSimConfig(
        use_v2_model_runner=PROTOCOLS[protocol],
        async_scheduling=SCHEDULING[scheduling],
        num_speculative_tokens=3,
    )
    simulation = EngineSimulation(config, 500 + seed)
    stats = simulation.run()
    assert stats.num_steps > 0
    spec = simulation.core.scheduler.spec_decoding_stats
    assert spec is not None and spec.num_drafts > 0
    # The oracle proposer spoils a different position each step: partial, full and zero acceptance all occur.
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert spec.num_accepted_tokens_per_pos[-1] > 0


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_drafts_under_heavy_kv_pressure_preempt_with_steps_in_flight(scheduling: str) -> None:
    config = EngineSimConfig(
        async_scheduling=SCHEDULING[scheduling],
        policy="priority",
        num_blocks=20,
        max_num_seqs=7,
        reset_probability=0.08,
        num_speculative_tokens=2,
    )
    assert EngineSimulation(config, 900).run().num_preemptions > 0


@pytest.mark.parametrize("seed", range(4))
def test_random_configs_with_drafts(seed: int) -> None:
    """Configs drawn from the whole space the harness supports (`random_config`), with 1 to 5 drafts."""
    config = dataclasses.replace(random_config(seed), num_speculative_tokens=1 + seed % 5)
    EngineSimulation(config, 700 + seed).run()


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_draft_model_keeps_its_kv_cache_exact_under_every_event(
    protocol: str, scheduling: str
) -> None:
    """The hash-logits model drafting for itself through the draft-model proposer (its own paged KV cache, read
    back through the block tables): preemptions, forced resets, aborts, pauses, streaming chunks and prefix-cache
    hits must leave its cache holding exactly the request's tokens, so every draft it proposes is accepted."""
    config = EngineSimConfig(
        use_v2_model_runner=PROTOCOLS[protocol],
        async_scheduling=SCHEDULING[scheduling],
        num_speculative_tokens=3,
        draft_model=True,
    )
    simulation = EngineSimulation(config, 1100)
    stats = simulation.run()
    assert stats.num_steps > 0 and stats.num_preemptions > 0
    spec = simulation.core.scheduler.spec_decoding_stats
    assert spec is not None and spec.num_drafts > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
