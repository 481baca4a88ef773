"""benchmarks/spec_decode.py: the quick run reports every figure of both models and the goals table.

Structural checks only (never timing assertions: CI machines are noisy). Imported as `benchmarks.<name>`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ENGINES = ["async", "sync", "ngram k=3"]


def load_benchmark():  # type: ignore[no-untyped-def]
    return importlib.import_module("benchmarks.spec_decode")


def test_quick_run_reports_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    json_path = tmp_path / "spec_decode.json"
    results = benchmark.main(
        ["--quick", "--checkpoint-dir", str(tmp_path / "ckpt"), "--json", str(json_path)]
    )
    out = capsys.readouterr().out
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(results))

    rows = results["single_stream"]
    cells = {(row["model"], row["workload"], row["engine"]) for row in rows}
    assert cells == {
        (model, workload, engine)
        for model in ("default", "tiny-bf16")
        for workload in ("heldout", "repeat")
        for engine in ENGINES
    }
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["vs_sync"] > 0 and row["vs_async"] > 0
        if row["engine"] == "sync":
            assert row["step_ms"] > 0  # the plain decode step's cost
        if row["k"] is not None:
            assert row["mean_acceptance_length"] >= 1.0 and row["drafted_step_share"] is not None
    # The repetitive workload verifies full drafts on the built-in model: the ideal speedup and the measured
    # fraction of it are there.
    (repeat,) = [
        row
        for row in rows
        if (row["model"], row["workload"], row["engine"]) == ("default", "repeat", "ngram k=3")
    ]
    assert repeat["mean_acceptance_length"] > 1.0
    assert repeat["step_ms"] > 0 and repeat["ideal_speedup"] > 0
    assert repeat["measured_over_ideal"] > 0 and repeat["ideal_at_draft_share"] > 0

    breakdown = results["step_breakdown"]["default"]
    for engine in ("sync", "ngram k=3"):
        cost = breakdown[engine]
        assert cost["count"] > 0 and cost["forward_s"] > 0 and cost["step_s"] >= cost["forward_s"]
    assert breakdown["ngram k=3"]["propose_s"] > 0 and breakdown["sync"]["propose_s"] == 0

    batch = {row["engine"]: row for row in results["batch"]}
    assert list(batch) == ENGINES
    assert all(row["tokens_per_s"] > 0 for row in batch.values())
    assert batch["ngram k=3"]["drafts_per_step"] is not None
    for engine in ("sync", "ngram k=3"):  # the synchronous engines' steps are timed
        assert batch[engine]["tokens_per_step"] > 0 and batch[engine]["forward_ms"] > 0
    linear = results["linear_layers_s"]["default"]
    assert sorted(linear) == [1, 4] and all(seconds > 0 for seconds in linear.values())

    table = out[out.index("goal ") :].splitlines()
    assert table[0].split() == ["goal", "measured", "target", "status"]
    statuses = [goal["status"] for goal in results["goals"]]
    assert [line.split()[-1] for line in table[1:]] == statuses
    names = [goal["name"] for goal in results["goals"]]
    assert sum("repeat tok/s" in name for name in names) == 4  # two models x two baselines
    assert sum("measured/ideal" in name for name in names) == 2
    assert sum(name.startswith("batch cost") for name in names) == 2
    assert set(statuses) <= {"PASS", "MISS", "SKIP"}


def test_goal_status_compares_against_its_target() -> None:
    goal = load_benchmark().Goal
    assert goal("a", 1.5, ">=", 1.5).status == "PASS"
    assert goal("a", 1.49, ">=", 1.5).status == "MISS"
    assert goal("a", 0.05, "<=", 0.05).status == "PASS"
    assert goal("a", 0.06, "<=", 0.05).status == "MISS"
    assert goal("a", None, ">=", 0.8).status == "SKIP"


def test_prompts_quote_the_passage_and_end_on_its_start() -> None:
    benchmark = load_benchmark()

    def encode(text: str) -> list[int]:
        return [ord(char) for char in text]

    (prompt,) = benchmark.repeat_prompts(encode, 1, 40)
    instruction, again = encode(benchmark.REPEAT_INSTRUCTION), encode(benchmark.REPEAT_AGAIN)
    passage = prompt[len(instruction) : len(instruction) + 40]
    assert prompt == instruction + passage + again + passage[: benchmark.REPEAT_CUE_TOKENS]
    heldout = benchmark.heldout_prompts(encode, 3, 50)
    assert len(heldout) == 3 and all(len(p) == 50 for p in heldout)
    assert len({tuple(p) for p in heldout}) == 3
