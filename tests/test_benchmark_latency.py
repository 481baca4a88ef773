"""benchmarks/latency.py: the quick run prints every figure and the goals table; the floors count every weight.

Structural checks only (never timing assertions: CI machines are noisy), except the KV cache's bytes per token,
which is exact. Imported as `benchmarks.<name>`. The checks that need a llama.cpp build (never in CI) are in
tools/llama_cpp_checks.py.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

GOAL_NAMES = (
    "decode tok/s: kvflow / llama.cpp",
    "decode tok/s: kvflow / torch GEMV floor",
    "decode tok/s: kvflow / memory floor",
    "TTFT 256 tokens: engine / bare forward",
    "KV bytes/token: measured / formula",
    "peak RSS during load / (weights + KV)",
)


def load_benchmark():  # type: ignore[no-untyped-def]
    return importlib.import_module("benchmarks.latency")


def test_quick_run_prints_every_figure_and_the_goals_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    json_path = tmp_path / "latency.json"
    results = benchmark.main(
        ["--quick", "--checkpoint-dir", str(tmp_path / "ckpt"), "--json", str(json_path)]
    )
    out = capsys.readouterr().out
    for system in ("kvflow decode", "torch GEMV floor", "memory floor"):
        assert system in out
    assert "llama.cpp (llama-bench)" not in out  # only with --llama-bench
    table = out[out.index("goal ") :].splitlines()
    assert table[0].split() == ["goal", "measured", "target", "status"]
    rows = {row[:48].strip(): row[48:].split() for row in table[1:]}
    assert tuple(rows) == GOAL_NAMES
    assert rows["decode tok/s: kvflow / llama.cpp"] == ["-", ">", "1", "SKIP"]
    for name in GOAL_NAMES[1:]:
        assert float(rows[name][0]) > 0 and rows[name][-1] in ("PASS", "MISS", "info")
    # The KV cache holds exactly K and V of every layer's KV heads per token: nothing padded, nothing extra.
    assert rows["KV bytes/token: measured / formula"] == ["1.000", "==", "1", "PASS"]
    kv = results["kv_cache"]
    assert (
        kv["bytes_per_token"] == kv["formula"] == 2 * 2 * 2 * 32 * 2
    )  # layers, kv heads, head_dim, bf16
    saved = json.loads(json_path.read_text())
    assert [goal["status"] for goal in saved["goals"]] == [row[-1] for row in rows.values()]
    load = saved["load_memory"]
    assert load["peak_rss_bytes"] > load["baseline_rss_bytes"] > 0
    assert load["weight_bytes"] > 0 and load["kv_cache_bytes"] == 64 * 16 * kv["formula"]
    assert len(saved["decode_ms_per_token"]) == len(saved["ttft_engine_s"]) == 2


def test_gemv_floor_reads_every_matrix_of_a_decode_step(tmp_path: Path) -> None:
    """The floors' weight set is exactly the checkpoint's matrices (the tied LM head read once more than stored:
    the embedding row lookup is not a matrix read), with the Qwen2 qkv biases."""
    benchmark = load_benchmark()
    path = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", dtype="bfloat16")
    shape = benchmark.ModelShape.from_checkpoint(path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as reader:
        sizes = {name: reader.get_slice(name).get_shape() for name in reader.keys()}  # noqa: SIM118
    matrices = sum(rows * cols for name, (rows, cols) in _matrices(sizes))
    qkv_biases = sum(size[0] for name, size in sizes.items() if name.endswith("_proj.bias"))
    counted = sum(
        out_features * in_features + (out_features if bias else 0)
        for out_features, in_features, bias in shape.decode_linear_shapes()
    )
    assert counted == matrices + qkv_biases  # embed_tokens counted as the (tied) LM head
    floor = benchmark.measure_gemv_floor(shape, benchmark.torch.bfloat16, repeats=1)
    assert floor.weight_bytes == 2 * counted and floor.tokens_per_s > 0


def _matrices(sizes: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
    return [(name, size) for name, size in sizes.items() if len(size) == 2]


def test_goal_status_compares_against_its_target() -> None:
    goal = load_benchmark().Goal
    assert goal("a", 1.2, ">", 1.0).status == "PASS"
    assert goal("a", 1.0, ">", 1.0).status == "MISS"
    assert goal("a", 1.1, "<=", 1.1).status == "PASS"
    assert goal("a", 1.3, "<=", 1.2).status == "MISS"
    assert goal("a", 1.0, "==", 1.0).status == "PASS"
    assert goal("a", 1.01, "==", 1.0).status == "MISS"
    assert goal("a", None, ">", 1.0).status == "SKIP"
    assert goal("a", 0.5, "", None).status == "info"
