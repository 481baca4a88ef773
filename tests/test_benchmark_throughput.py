"""benchmarks/throughput.py in quick mode: it runs every system on a tiny checkpoint and prints its table.

Structural checks only (never timing assertions: CI machines are noisy). Loaded by path, like a plain script.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARK_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput.py"


def load_benchmark():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kvflow_benchmark_throughput", BENCHMARK_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_workload_is_fixed_by_its_seed() -> None:
    benchmark = load_benchmark()
    first = benchmark.make_workload(64, (32, 256), (32, 128), 32000, seed=0)
    again = benchmark.make_workload(64, (32, 256), (32, 128), 32000, seed=0)
    assert first == again
    assert all(32 <= len(prompt) <= 256 for prompt in first.prompts)
    assert all(32 <= n <= 128 for n in first.output_lens) and len(first.output_lens) == 64


def test_quick_run_prints_every_system(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    benchmark.main(["--quick", "--checkpoint-dir", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    for system in ("HF static", "kvflow ", "kvflow forward only", "kvflow sync"):
        assert system in out
    assert "kvflow / HF static throughput:" in out and "async / sync scheduling throughput:" in out
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
