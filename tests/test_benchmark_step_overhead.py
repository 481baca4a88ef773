"""benchmarks/step_overhead.py: on the hash model every decode step is cut into the four segments, which add up
to the gap between two forward passes. Structural checks only (no timing assertions: CI machines are noisy)."""

from __future__ import annotations

import importlib

import pytest


def test_hash_model_run_splits_every_decode_step(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = importlib.import_module("benchmarks.step_overhead")
    results = benchmark.main(["--model", "hash", "--repeats", "2", "--output-len", "8"])
    assert len(results["ms_per_token"]) == 2
    medians = results["median_us"]
    assert set(medians) == {*benchmark.SEGMENTS, "forward"}
    assert all(value >= 0 for value in medians.values())
    assert "gap: forward end -> next forward" in capsys.readouterr().out


def test_split_steps_adds_the_segments_up_to_the_gap() -> None:
    benchmark = importlib.import_module("benchmarks.step_overhead")
    # Two decode steps (times in seconds): forward, runner, step, loop, as the engine thread records them.
    events = [
        ("S<", 0.0), ("R<", 0.1), ("F<", 0.2), ("F>", 1.0), ("R>", 1.3), ("S>", 1.4),
        ("S<", 1.6), ("R<", 1.7), ("F<", 1.9), ("F>", 2.9), ("R>", 3.1), ("S>", 3.2),
        ("S<", 3.5), ("R<", 3.6), ("F<", 3.8),
    ]  # fmt: skip
    segments = benchmark.split_steps(events, max_gap_s=10.0)
    first = [round(values[0], 6) for values in segments.values()]
    assert first == [0.3, 0.1, 0.2, 0.3, 0.9, 0.8]
    assert [round(values[1], 6) for values in segments.values()] == [0.2, 0.1, 0.3, 0.3, 0.9, 1.0]
    assert (
        benchmark.split_steps(events, max_gap_s=0.5)["forward"] == []
    )  # gaps between requests left out
