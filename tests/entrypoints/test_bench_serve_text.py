"""`kvflow bench serve --tokenizer` against a real `kvflow serve` of the default model: text prompts of exactly
`--random-input-len` tokens, and "Total input tokens" as the server counted them (its usage; the chat endpoint's
content lengths are in tests/benchmarks/test_bench_datasets.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from kvflow.default_model import ensure_default_model
from tests.entrypoints.server import DEFAULT_SERVER, RemoteServer, kvflow_command, running_server


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(*DEFAULT_SERVER) as remote:
        yield remote


def bench(server: RemoteServer, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        *kvflow_command(), "bench", "serve", "--base-url", server.url,
        "--tokenizer", str(ensure_default_model()), *args,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def table_value(stdout: str, label: str) -> float:
    [line] = [line for line in stdout.splitlines() if line.startswith(label)]
    return float(line[len(label) :].strip())


def test_text_prompts_are_exactly_the_random_input_len(server: RemoteServer) -> None:
    # The run sent 1,425 input tokens for 20 x 64: random ids decoded to text encode back to more.
    run = bench(
        server, "--random-input-len", "64", "--random-output-len", "2", "--num-prompts", "20"
    )
    assert run.returncode == 0, run.stderr
    assert table_value(run.stdout, "Successful requests:") == 20
    assert table_value(run.stdout, "Total input tokens:") == 20 * 64
    assert table_value(run.stdout, "Total generated tokens:") == 20 * 2
    server.wait_for_metric("kvflow:prompt_tokens_total", 20 * 64)
