"""benchmarks/parallel.py in quick mode: the TP part runs TP=1 and TP=2 on a tiny checkpoint and prints its table.

Structural checks only (never timing assertions: CI machines are noisy), plus the one property the table exists to
show: the bytes a decode step sends to the workers do not grow with the requests' history.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest


def load_benchmark():  # type: ignore[no-untyped-def]
    return importlib.import_module("benchmarks.parallel")


def test_quick_run_prints_tp1_and_tp2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    benchmark.main(["--quick", "--checkpoint-dir", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    rows = {
        int(match[0]): match[1:]
        for match in re.findall(r"^\s+(\d)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\S+)\s+(\S+)$", out, re.M)
    }
    assert set(rows) == {1, 2}, out
    assert rows[1][3:] == ("in-process", "in-process")
    first_bytes, last_bytes = int(rows[2][3]), int(rows[2][4])
    assert 0 < last_bytes <= first_bytes + 32  # 11 decode steps of history added nothing
    assert re.search(
        r"TP=2 \(\d+ threads/rank\) / TP=1 \(\d+ threads/rank\) median decode step time", out
    )
    assert (
        "DP part" not in out
    )  # --dp runs benchmarks/parallel_dp.py (tests/test_benchmark_parallel_dp.py)
