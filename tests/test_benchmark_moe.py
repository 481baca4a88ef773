"""benchmarks/moe.py: the quick run measures both models and prints the goals table; its random checkpoints are
real Qwen3-MoE / Qwen3 checkpoints (transformers loads them with no missing or unexpected tensor) whose parameter
counts the benchmark states correctly.

Structural checks only (never timing assertions: CI machines are noisy). llama.cpp's side needs a llama.cpp build
and is skipped here (`--skip-llama-cpp`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

GOALS = (
    "single stream: kvflow / llama.cpp",
    "batch-16: kvflow / llama.cpp",
    "kvflow moe / kvflow dense (same active params)",
)


def load_benchmark() -> ModuleType:
    return importlib.import_module("benchmarks.moe")


def test_quick_run_measures_both_models_and_prints_the_goals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    json_path = tmp_path / "moe.json"
    results = benchmark.main(
        [
            "--quick",
            "--skip-llama-cpp",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json",
            str(json_path),
        ]
    )
    assert results["errors"] == []
    out = capsys.readouterr().out
    assert "moe    single stream: kvflow" in out and "dense  single stream: kvflow" in out
    for name in ("moe", "dense"):
        run = results["runs"][name]
        assert run["kvflow_tokens_per_s"] > 0 and run["weight_bytes"] > 0
        assert run["llama_decode_tokens_per_s"] is None  # --skip-llama-cpp
    assert results["batched"]["kvflow"]["tokens_per_s"] > 0
    goal_rows = {
        line.split("|")[1].strip(): line.split("|")[2:5]
        for line in out.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip() in GOALS
    }
    assert tuple(goal_rows) == GOALS
    assert [cell.strip() for cell in goal_rows[GOALS[0]]] == ["-", ">= 1.0", "SKIP"]
    measured, _, verdict = (cell.strip() for cell in goal_rows[GOALS[2]])
    assert float(measured) > 0 and verdict in ("PASS", "MISS")
    assert json.loads(json_path.read_text())["table"] == results["table"]
    # Both files are Q4_K_M by the project's converter, cached for the next run.
    cache = tmp_path / "cache" / "quick"
    assert sorted(path.name for path in cache.glob("*.gguf")) == [
        "dense-Q4_K_M.gguf",
        "moe-Q4_K_M.gguf",
    ]


@pytest.mark.parametrize("model", ["moe", "dense"])
def test_random_checkpoints_are_real_checkpoints_of_the_stated_size(
    tmp_path: Path, model: str
) -> None:
    import transformers

    benchmark = load_benchmark()
    shape = benchmark.QUICK_SHAPE
    config = shape.moe_config() if model == "moe" else shape.dense_config()
    folder = benchmark.write_random_checkpoint(tmp_path / model, config)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True, dtype=torch.bfloat16
    )
    assert type(loaded).__name__ == config["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    num_parameters = sum(parameter.numel() for parameter in loaded.parameters())
    norms = sum(
        parameter.numel() for name, parameter in loaded.named_parameters() if "norm" in name
    )
    total, active = shape.parameter_counts()
    if model == "moe":
        assert num_parameters - norms == total
    else:  # every dense parameter is active: the MoE's active count less its routers
        routers = shape.num_hidden_layers * shape.num_experts * shape.hidden_size
        assert num_parameters - norms == active - routers
    # A second call with the same config reuses the folder (the marker matches).
    marker = folder / benchmark.CHECKPOINT_MARKER
    before = marker.stat().st_mtime_ns
    benchmark.write_random_checkpoint(folder, config)
    assert marker.stat().st_mtime_ns == before
