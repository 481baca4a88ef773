"""benchmarks/serving.py in quick mode: it starts real servers, measures, and prints its three tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"


@pytest.mark.slow
def test_quick_run_prints_the_overhead_ratio_api_cpu_per_token_and_latencies() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ratio = re.search(r"serve / in-process: ([0-9.]+)x", result.stdout)
    assert ratio and float(ratio.group(1)) > 0
    hash_rows = [
        line.split()
        for line in result.stdout.splitlines()
        if re.match(r"^\s+[12]\s+\d+\s+(yes|no)\s", line)
    ]
    # API processes 1 and 2, streamed and not: serve tok/s, in-process tok/s (both layouts), ratios, and the API
    # processes', engine's and client's CPU per token, all measured (> 0), nothing failed.
    assert sorted((row[0], row[2]) for row in hash_rows) == [
        ("1", "no"),
        ("1", "yes"),
        ("2", "no"),
        ("2", "yes"),
    ]
    assert all(len(row) == 11 and all(float(value) > 0 for value in row[3:]) for row in hash_rows)
    assert "FAILED" not in result.stdout
    [sweep_row] = [line for line in result.stdout.splitlines() if line.strip().startswith("inf")]
    assert len(sweep_row.split()) == 8 and all(float(value) > 0 for value in sweep_row.split()[1:])
