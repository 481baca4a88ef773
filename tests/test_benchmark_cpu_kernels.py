"""Structural check of benchmarks/cpu_kernels.py in quick mode (no timing assertions: CI is noisy)."""

from __future__ import annotations

import importlib
import re

import pytest

from kvflow.kernels import load_cpu_kernels


def test_quick_run_prints_every_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    if load_cpu_kernels() is None:
        pytest.skip("CPU kernels unavailable")
    module = importlib.import_module("benchmarks.cpu_kernels")
    module.main(["--quick", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    before, rest = out.split("\nGEMM kernels (bf16): kernels.linear uses ", 1)
    kernel_section, after = rest.split("\nop (batch 1)", 1)
    kernel_rows = re.findall(r"\n(\w+) +16 +\d+", kernel_section)
    # a row per shape: widened_fp32 GFLOP/s at least
    assert kernel_rows == ["qkv", "o", "gate_up", "down"], kernel_section
    out = before + "\nop (batch 1)" + after
    assert "read bandwidth" in out
    for name in ("qkv", "o", "gate_up", "down", "lm_head", "add + RMSNorm", "SiLU", "RoPE"):
        assert f"\n{name}" in out, name
    assert "decode attention" in out
    assert "GEMM (bf16, M > 8): kernels.linear dispatches to" in out
    assert len(re.findall(r"\n\w+ +16 .*\d\.\d\dx", out)) == 5  # a GEMM speedup per shape at M = 16
    assert len(re.findall(r"\d\.\d\dx", out)) == 14  # a speedup on every row
