"""benchmarks/parallel_dp.py in quick mode: real DP=1 and DP=2 servers loaded by `kvflow bench serve`; it prints
the ratio, both engine cores' share of the DP=2 server's requests, and what 2 cores cannot show."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "parallel_dp.py"


@pytest.mark.slow
def test_quick_run_prints_the_dp_ratio_and_both_engines_share() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    row = re.search(
        r"^hash .* ([0-9.]+)x .*engine 0: (\d+) / engine 1: (\d+)$", result.stdout, re.MULTILINE
    )
    assert row, result.stdout
    ratio, engine0, engine1 = float(row.group(1)), int(row.group(2)), int(row.group(3))
    assert ratio > 0
    assert engine0 + engine1 == 32 and min(engine0, engine1) >= 8  # a burst spreads evenly
    assert "Neither shows the near-linear scaling" in result.stdout
