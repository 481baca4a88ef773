"""benchmarks/serving.py in quick mode: it starts real servers, measures, and prints its three tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"


@pytest.mark.slow
def test_quick_run_prints_the_overhead_ratio_cpu_per_token_and_latencies() -> None:
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
    cpu = re.search(
        r"API server process CPU: ([0-9.]+) s, ([0-9]+) us per output token", result.stdout
    )
    assert cpu and int(cpu.group(2)) > 0
    [sweep_row] = [line for line in result.stdout.splitlines() if line.strip().startswith("inf")]
    assert len(sweep_row.split()) == 8 and all(float(value) > 0 for value in sweep_row.split()[1:])
