"""Randomized interleavings of steps, preemptions, forced resets, aborts and streaming input (see simulation.py)."""

from __future__ import annotations

import itertools

import pytest

from tests.engine.simulation import SimConfig, Simulation

PROTOCOLS = {"slot": True, "persistent_batch": False}
MODES = {"sync": False, "async": True}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_keep_every_invariant(protocol: str, mode: str, seed: int) -> None:
    config = SimConfig(use_v2_model_runner=PROTOCOLS[protocol], async_scheduling=MODES[mode])
    simulation = Simulation(config, seed)
    simulation.run()
    assert simulation.num_steps > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_random_interleavings_under_heavy_kv_pressure_with_priority(mode: str, seed: int) -> None:
    config = SimConfig(
        async_scheduling=MODES[mode],
        policy="priority",
        num_blocks=20,
        max_num_seqs=8,
        reset_probability=0.08,
    )
    Simulation(config, seed).run()


@pytest.mark.parametrize("seed", range(4))
def test_random_interleavings_without_chunked_prefill(seed: int) -> None:
    Simulation(SimConfig(enable_chunked_prefill=False, num_blocks=24), seed).run()


def test_async_runs_reset_with_two_batches_in_flight() -> None:
    """The async runs really exercise resets with several batches in flight (else the test proves little)."""
    seen = 0
    for seed in range(8):
        simulation = Simulation(SimConfig(async_scheduling=True, reset_probability=0.15), seed)
        simulation.run()
        seen = max(seen, simulation.max_in_flight_at_reset)
    assert seen >= 2


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(60))
def test_random_interleavings_long(seed: int) -> None:
    protocol, mode = list(itertools.product(PROTOCOLS.values(), MODES.values()))[seed % 4]
    config = SimConfig(
        use_v2_model_runner=protocol,
        async_scheduling=mode,
        num_requests=100,
        session_fraction=0.1 + (seed % 3) * 0.2,
        max_num_seqs=4 + seed % 5,
        num_blocks=18 + seed % 23,
    )
    Simulation(config, 1000 + seed).run()
