"""Structural checks of benchmarks/structured_outputs.py in quick mode (never timing assertions: CI is noisy)."""

from __future__ import annotations

import importlib


def test_quick_run_reports_both_backends() -> None:
    module = importlib.import_module("benchmarks.structured_outputs")
    results = module.main(["--quick"])
    assert [result["backend"] for result in results] == ["xgrammar", "guidance"]
    for result in results:
        assert result["throughput_ratio"] > 0 and result["ttft_ratio"] > 0
        assert result["fill_us_per_step"] > 0 and result["mask_us_per_step"] > 0
        assert len(result["constrained_tok_s"]) == len(result["unconstrained_tok_s"]) == 1
