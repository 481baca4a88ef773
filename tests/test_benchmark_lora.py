"""benchmarks/lora.py: the quick run measures every case on the default model with real PEFT adapters and prints
the figures and the goals table; its adapters are PEFT's own, made once and reused; the batch cases give each
request the adapter they say.

Structural checks only (never timing assertions: CI machines are noisy). Imported as `benchmarks.<name>`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

GOALS = ("batch: adapters / base (LoRA off)", "single stream: adapter / base (LoRA off)")


def load_benchmark() -> ModuleType:
    return importlib.import_module("benchmarks.lora")


def test_quick_run_measures_every_case_and_prints_the_goals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    json_path = tmp_path / "lora.json"
    results = benchmark.main(
        [
            "--quick",
            "--num-adapters",
            "3",
            "--rank",
            "4",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json",
            str(json_path),
        ]
    )
    out = capsys.readouterr().out
    assert results["num_adapters"] == 3 and results["rank"] == 4
    assert set(results["batch_tokens_per_s"]) == set(benchmark.BATCH_CASES)
    assert set(results["single_stream_tokens_per_s"]) == set(benchmark.STREAM_CASES)
    assert all(rate > 0 for rate in results["batch_tokens_per_s"].values())
    assert all(rate > 0 for rate in results["single_stream_tokens_per_s"].values())
    assert len(results["load_ms"]) == len(results["activation_ms"]) == 2  # quick: 2 repeats
    assert results["load"]["load_ms"] > 0
    for case in (*benchmark.BATCH_CASES, *benchmark.STREAM_CASES):
        assert f"| {case} | " in out
    goal_rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:5]]
        for line in out.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip() in GOALS
    }
    assert tuple(goal_rows) == GOALS
    for measured, _target, verdict in goal_rows.values():
        assert float(measured) > 0 and verdict in ("PASS", "MISS")
    assert [row[1] for row in goal_rows.values()] == [">= 0.8", ">= 0.9"]
    assert json.loads(json_path.read_text())["table"] == results["table"]


def test_adapters_are_peft_adapters_made_once(tmp_path: Path) -> None:
    from safetensors import safe_open

    from kvflow.default_model import ensure_default_model

    benchmark = load_benchmark()
    base = ensure_default_model()
    paths = benchmark.ensure_adapters(base, tmp_path, num_adapters=2, rank=4)
    assert [path.name for path in paths] == ["adapter-0", "adapter-1"]
    tensors = []
    for path in paths:
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
        assert set(config["target_modules"]) == set(benchmark.TARGET_MODULES)
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as file:
            names = sorted(file.keys())
            tensors.append(file.get_tensor(names[0]))
        num_layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
        assert len(names) == 2 * len(benchmark.TARGET_MODULES) * num_layers  # A and B, every module
        assert all(tensor.abs().sum() > 0 for tensor in tensors)  # B is random, not PEFT's zeros
    assert not tensors[0].equal(tensors[1])  # seeded per adapter
    marker = tmp_path / benchmark.ADAPTERS_MARKER
    before = marker.stat().st_mtime_ns
    assert benchmark.ensure_adapters(base, tmp_path, num_adapters=2, rank=4) == paths
    assert marker.stat().st_mtime_ns == before  # reused


def test_batch_cases_assign_adapters_round_robin() -> None:
    benchmark = load_benchmark()
    loras = ["a", "b", "c"]
    base_off, base_on, spread, mixed = benchmark.BATCH_CASES
    assert benchmark.batch_adapters(base_off, 6, loras) is None
    assert benchmark.batch_adapters(base_on, 6, loras) is None
    assert benchmark.batch_adapters(spread, 6, loras) == ["a", "b", "c", "a", "b", "c"]
    assert benchmark.batch_adapters(mixed, 6, loras) == [None, "a", None, "b", None, "c"]


def test_workload_is_fixed_by_its_seed() -> None:
    benchmark = load_benchmark()
    first = benchmark.make_workload(benchmark.FULL, vocab_size=4092)
    assert first == benchmark.make_workload(benchmark.FULL, vocab_size=4092)
    assert len(first.prompts) == 64
    assert all(64 <= len(prompt) <= 128 for prompt in first.prompts)
    assert all(64 <= n <= 128 for n in first.output_lens)
    assert max(max(prompt) for prompt in first.prompts) < 4092
