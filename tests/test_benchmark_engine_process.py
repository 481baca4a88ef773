"""benchmarks/engine_process.py in quick mode: both workloads run on both clients and the table shows them.

Structural checks only (never timing assertions: CI machines are noisy). Imported as `benchmarks.<name>`.
"""

from __future__ import annotations

import importlib


def load_benchmark():  # type: ignore[no-untyped-def]
    return importlib.import_module("benchmarks.engine_process")


def test_quick_run_reports_both_workloads_on_both_clients() -> None:
    benchmark = load_benchmark()
    report = benchmark.main(["--quick"])
    lines = report.splitlines()
    assert "in-process" in lines[3] and "engine process" in lines[3]
    for workload, unit in (("hash model", "req/s"), ("default model", "tok/s")):
        rate_row, cpu_row = [line for line in lines if line.startswith(workload)]
        assert unit in rate_row and rate_row.rstrip().endswith("x")
        assert " + " in cpu_row  # the engine process's CPU time: front end + engine-core process
    assert any(line.startswith("CPU seconds per round") for line in lines)
