"""benchmarks/embeddings.py: the quick run (tiny shapes) measures sentence-transformers, kvflow in-process and
`kvflow serve` on the same inputs, checks that their embeddings agree, and prints the figures and the goals table;
the inputs have the lengths they were cut to.

Structural checks only (never timing assertions: CI machines are noisy). Imported as `benchmarks.<name>`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from kvflow.models.loader import cpu_has_native_bf16

pytest.importorskip("sentence_transformers")


def load_benchmark() -> ModuleType:
    return importlib.import_module("benchmarks.embeddings")


def _goal_rows(out: str) -> dict[str, list[str]]:
    return {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:5]]
        for line in out.splitlines()
        if line.startswith("| ") and ": " in line.split("|")[1]
    }


def test_quick_run_measures_every_contender_and_prints_the_goals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    json_path = tmp_path / "embeddings.json"
    summary = benchmark.main(
        [
            "--quick",
            "--model",
            "minilm",
            "--num-inputs",
            "8",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json",
            str(json_path),
        ]
    )
    out = capsys.readouterr().out
    (result,) = summary["results"]
    assert result["num_inputs"] == 8 and 16 <= result["min_len"] <= result["max_len"] <= 64
    assert set(result["embeddings_per_s"]) == set(benchmark.CONTENDERS)
    assert all(rate > 0 for rate in result["embeddings_per_s"].values())
    # The default --dtype auto: sentence-transformers' float32 against kvflow's pooling "auto".
    kvflow_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert result["dtypes"] == {
        "sentence-transformers": "float32",
        "kvflow in-process": kvflow_dtype,
        "kvflow serve": kvflow_dtype,
    }
    assert result["min_cosine"] > (0.999 if kvflow_dtype == "bfloat16" else 0.9999)
    assert f"| float32 / {kvflow_dtype} |" in out
    assert json.loads(json_path.read_text())["results"][0]["input_tokens"] == result["input_tokens"]
    assert "| minilm | 8 | " in out
    goals = _goal_rows(out)
    assert list(goals) == [
        "minilm: kvflow / sentence-transformers",
        "minilm: serve / in-process",
    ]
    for measured, _target, verdict in goals.values():
        assert float(measured) > 0 and verdict in ("PASS", "MISS")
    assert [row[1] for row in goals.values()] == [">= 2.0", ">= 0.8"]


def test_quick_decoder_run_without_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    summary = benchmark.main(
        [
            *(
                "--quick",
                "--model",
                "qwen3",
                "--num-inputs",
                "4",
                "--no-server",
                "--dtype",
                "float32",
            ),
            *("--cache-dir", str(tmp_path / "cache")),
        ]
    )
    (result,) = summary["results"]
    assert set(result["embeddings_per_s"]) == set(benchmark.CONTENDERS[:2])
    assert result["dtypes"] == {"sentence-transformers": "float32", "kvflow in-process": "float32"}
    assert result["min_cosine"] > 0.9999
    goals = _goal_rows(capsys.readouterr().out)
    assert goals["qwen3: serve / in-process"] == ["-", ">= 0.8", "SKIP"]


def test_inputs_have_the_lengths_drawn(tmp_path: Path) -> None:
    benchmark = load_benchmark()
    spec = benchmark.MODELS["minilm"]
    path = benchmark.ensure_checkpoint(
        tmp_path / "minilm", spec, benchmark.QUICK_OVERRIDES["minilm"]
    )
    marker = (path / benchmark.CHECKPOINT_MARKER).stat().st_mtime_ns
    assert benchmark.ensure_checkpoint(path, spec, benchmark.QUICK_OVERRIDES["minilm"]) == path
    assert (
        path / benchmark.CHECKPOINT_MARKER
    ).stat().st_mtime_ns == marker  # reused, not rewritten
    texts, lengths = benchmark.make_inputs(path, 20, 16, 48, seed=5)
    assert (texts, lengths) == benchmark.make_inputs(path, 20, 16, 48, seed=5)
    assert all(16 <= length <= 48 for length in lengths) and len(set(lengths)) > 1
    with pytest.raises(ValueError, match="min-len"):
        benchmark.make_inputs(path, 2, 2, 48)


def test_interleaved_ab_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/embeddings_ab.py: the three contenders on the same batches, the previous attention path giving the
    same embeddings as the kernel up to rounding, and the dtypes each side ran."""
    ab = importlib.import_module("benchmarks.embeddings_ab")
    summary = ab.main(
        ["--quick", "--num-inputs", "6", "--passes", "1", "--cache-dir", str(tmp_path / "cache")]
    )
    assert set(summary["embeddings_per_s"]) == set(ab.CONTENDERS)
    assert all(rate > 0 for rate in summary["embeddings_per_s"].values())
    kvflow_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert summary["dtypes"] == {"sentence-transformers": "float32", "kvflow": kvflow_dtype}
    assert all(value > 0.999 for value in summary["min_cosine"].values())
    assert "kernel / previous" in capsys.readouterr().out
