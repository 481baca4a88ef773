"""Structural checks of benchmarks/structured_outputs.py in quick mode (never timing assertions: CI is noisy)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARK_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "structured_outputs.py"


def test_quick_run_reports_both_backends() -> None:
    spec = importlib.util.spec_from_file_location("kvflow_benchmark_structured", BENCHMARK_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvflow_benchmark_structured"] = module
    spec.loader.exec_module(module)
    results = module.main(["--quick"])
    assert [result["backend"] for result in results] == ["xgrammar", "guidance"]
    for result in results:
        assert result["throughput_ratio"] > 0 and result["ttft_ratio"] > 0
        assert result["fill_us_per_step"] > 0 and result["mask_us_per_step"] > 0
        assert len(result["constrained_tok_s"]) == len(result["unconstrained_tok_s"]) == 1
