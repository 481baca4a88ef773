"""Structural checks of benchmarks/scheduler_overhead.py in quick mode (never timing assertions: CI is noisy).

The benchmark is imported as `benchmarks.scheduler_overhead`; run by path it works as a plain script too.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

MAX_BYTES_PER_REQUEST_DIFFERENCE = (
    4.0  # wider int encodings of counters and block ids at longer histories
)


def load_benchmark() -> ModuleType:
    return importlib.import_module("benchmarks.scheduler_overhead")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark()


@pytest.fixture(scope="module")
def quick_report(bench: ModuleType):
    return bench.run_benchmark(bench.QUICK_CONFIG)


def bytes_row(report, use_v2_model_runner: bool, history_len: int):
    (row,) = [
        row
        for row in report.message_bytes
        if row.use_v2_model_runner == use_v2_model_runner and row.history_len == history_len
    ]
    return row


def test_quick_config_covers_short_and_long_histories(bench: ModuleType) -> None:
    assert {100, 4000} <= set(bench.QUICK_CONFIG.histories)


def test_timing_rows_cover_every_size(bench: ModuleType, quick_report) -> None:
    assert [timing.num_requests for timing in quick_report.timings] == list(
        bench.QUICK_CONFIG.sizes
    )
    for timing in quick_report.timings:
        assert timing.num_steps == bench.QUICK_CONFIG.steps
        assert timing.step_us_median >= 0 and timing.step_us_mean >= 0


@pytest.mark.parametrize("use_v2_model_runner", [True, False])
def test_delta_bytes_do_not_grow_with_history(quick_report, use_v2_model_runner: bool) -> None:
    short = bytes_row(quick_report, use_v2_model_runner, 100)
    long = bytes_row(quick_report, use_v2_model_runner, 4000)
    assert short.num_requests == long.num_requests and short.num_steps == long.num_steps
    assert short.num_steps % 16 == 0  # whole blocks: every request crosses as many block boundaries
    difference = abs(long.delta_bytes_per_request - short.delta_bytes_per_request)
    assert difference <= MAX_BYTES_PER_REQUEST_DIFFERENCE, (short, long)


@pytest.mark.parametrize("use_v2_model_runner", [True, False])
def test_full_list_baseline_grows_with_history(quick_report, use_v2_model_runner: bool) -> None:
    short = bytes_row(quick_report, use_v2_model_runner, 100)
    long = bytes_row(quick_report, use_v2_model_runner, 4000)
    # Each request's list gains at least ~1 byte per extra history token.
    assert long.full_list_bytes_per_request - short.full_list_bytes_per_request >= 4000 - 100
    # The delta message is far smaller than resending histories at the long history.
    assert long.full_list_bytes_per_step > 10 * long.delta_bytes_per_step


def test_steady_message_carries_no_history(bench: ModuleType) -> None:
    """In steady decoding neither protocol ships token lists: no new requests, no all_token_ids, no chunks."""
    for use_v2_model_runner in (True, False):
        scheduler = bench.decoding_scheduler(4, 100, 16, use_v2_model_runner)
        output = scheduler.schedule()
        bench.check_steady_output(output, 4)
        cached = output.scheduled_cached_reqs
        assert cached.all_token_ids == {}
        assert all(chunk == [] for chunk in cached.new_token_ids)


def test_report_table_names_command_and_every_size(bench: ModuleType, quick_report) -> None:
    text = bench.format_report(quick_report, ["--quick"])
    assert text.splitlines()[0].endswith("python benchmarks/scheduler_overhead.py --quick")
    timing_rows = {line.split()[0] for line in text.splitlines() if line[:7].strip().isdigit()}
    for size in bench.QUICK_CONFIG.sizes:
        assert str(size) in timing_rows
    for protocol in ("slot", "persistent"):
        for history_len in bench.QUICK_CONFIG.histories:
            assert any(
                line.split()[:2] == [protocol, str(history_len)] for line in text.splitlines()
            )


def test_main_quick_prints_table(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--sizes", "8,16", "--steps", "3", "--histories", "100,200"]) == 0
    out = capsys.readouterr().out
    assert "reproduce with: python benchmarks/scheduler_overhead.py --quick" in out
    rows = [line.split() for line in out.splitlines()]
    assert any(row[:2] == ["8", "3"] for row in rows) and any(
        row[:2] == ["16", "3"] for row in rows
    )


def test_goal_column_and_line_say_whether_each_goal_size_meets_the_goal(bench: ModuleType) -> None:
    def timing(num_requests: int, us_per_request: float):
        step_us = us_per_request * num_requests
        return bench.StepTiming(num_requests, 10, step_us / 2, step_us / 2, step_us, step_us)

    lines = bench.format_timing_table([timing(64, 9.0), timing(256, 4.0), timing(1024, 4.5)])
    goal_column = {
        line.split()[0]: line.split()[-1] for line in lines if line[:7].strip().isdigit()
    }
    assert goal_column == {"64": "-", "256": "met", "1024": "MISSED"}  # 64 is no goal size
    assert lines[-1].strip() == (
        f"goal: <= {bench.GOAL_US_PER_REQUEST} us/req at N=256 and N=1024 -- "
        "N=256: 4.00 us/req, met; N=1024: 4.50 us/req, MISSED"
    )


def test_goal_line_names_goal_sizes_a_run_left_out(bench: ModuleType, quick_report) -> None:
    text = bench.format_report(quick_report)
    assert "N=256: not measured; N=1024: not measured" in text
