"""`kvflow bench serve` against a real `kvflow serve` (the hash model: token-id prompts, exact lengths)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.server import HASH_SERVER, RemoteServer, kvflow_command, running_server


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(*HASH_SERVER) as remote:
        yield remote


def bench(server: RemoteServer, *args: str) -> subprocess.CompletedProcess[str]:
    command = [*kvflow_command(), "bench", "serve", "--base-url", server.url, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def table_value(stdout: str, label: str) -> float:
    [line] = [line for line in stdout.splitlines() if line.startswith(label)]
    return float(line[len(label) :].strip())


def test_bench_serve_prints_the_table_saves_json_and_plots(
    server: RemoteServer, tmp_path: Path
) -> None:
    result_file, plot_file = tmp_path / "result.json", tmp_path / "plot.png"
    run = bench(
        server,
        "--num-prompts", "24",
        "--random-input-len", "20",
        "--random-output-len", "6",
        "--max-concurrency", "8",
        "--save-result", str(result_file),
        "--plot", str(plot_file),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert table_value(run.stdout, "Successful requests:") == 24
    assert table_value(run.stdout, "Failed requests:") == 0
    assert table_value(run.stdout, "Total input tokens:") == 24 * 20
    assert (
        table_value(run.stdout, "Total generated tokens:") == 24 * 6
    )  # ignore_eos: exactly max_tokens
    for short in ("TTFT", "TPOT", "E2EL"):
        assert table_value(run.stdout, f"Mean {short} (ms):") > 0
    assert table_value(run.stdout, "P99 E2EL (ms):") >= table_value(run.stdout, "Median E2EL (ms):")
    saved = json.loads(result_file.read_text())
    assert (
        saved["completed"] == 24 and saved["output_lens"] == [6] * 24 and saved["model"] == "hash"
    )
    # One gap per chunk after the first: at most one per token. A chunk carries several tokens for a client
    # behind (on a loaded machine every reply may come in two chunks: no gap at all), so the mean ITL printed is
    # checked against the gaps saved, not against zero.
    assert all(len(itls) <= 5 for itls in saved["itls"])
    gaps = [gap for itls in saved["itls"] for gap in itls]
    mean_itl_ms = 1000 * sum(gaps) / len(gaps) if gaps else 0.0
    assert table_value(run.stdout, "Mean ITL (ms):") == pytest.approx(mean_itl_ms, abs=0.01)
    assert plot_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert server.metric("kvflow:num_requests_running", model_name="hash") == 0


def test_poisson_arrivals_and_failed_requests_are_reported(server: RemoteServer) -> None:
    # Prompts longer than the server's max_model_len fail with a 400: counted, not fatal.
    run = bench(
        server,
        "--num-prompts", "6",
        "--random-input-len", "4000",
        "--random-output-len", "4",
        "--request-rate", "50",
        "--seed", "3",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert table_value(run.stdout, "Failed requests:") == 6
    assert "HTTP 400" in run.stdout
    unreachable = subprocess.run(
        [
            *kvflow_command(),
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:9",
            "--num-prompts",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert unreachable.returncode == 2 and "pass --model" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr
