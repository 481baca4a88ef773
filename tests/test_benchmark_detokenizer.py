"""benchmarks/detokenizer.py: it measures every output length, with and without stop strings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "detokenizer.py"


@pytest.mark.slow
def test_every_length_gets_a_positive_figure_and_a_ratio_to_the_first() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["128", "1024", "8192", "32768"]
    assert all(len(row) == 5 and all(float(value) > 0 for value in row[1:]) for row in rows)
    assert rows[0][2] == rows[0][4] == "1.00"
