"""`kvflow bench serve --backend openai-embeddings` (issue 43 item 5): embedding request bodies, the pooling result
table, and a run against a real `kvflow serve --runner pooling` on a tiny random BERT embedder."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.benchmarks.datasets import SampleRequest
from kvflow.benchmarks.request import (
    RequestResult,
    embedding_request_body,
    is_embedding_endpoint,
)
from kvflow.benchmarks.serve import format_embedding_table, summarize
from kvflow.entrypoints.cli.bench import resolve_target
from kvflow.entrypoints.cli.main import main
from kvflow.testing.pooling_checkpoints import make_tiny_encoder
from tests.entrypoints.server import RemoteServer, running_server

_TABLE_ROWS = (
    "Successful requests:",
    "Failed requests:",
    "Benchmark duration (s):",
    "Total input tokens:",
    "Request throughput (req/s):",
    "Total Token throughput (tok/s):",
    "Mean E2EL (ms):",
    "Median E2EL (ms):",
    "P99 E2EL (ms):",
)


def _rows(table: str) -> dict[str, float]:
    return {
        label: float(line[len(label) :].strip())
        for line in table.splitlines()
        for label in _TABLE_ROWS
        if line.startswith(label)
    }


def test_the_backend_loads_the_embeddings_endpoint() -> None:
    args = argparse.Namespace(
        base_url=None, host="127.0.0.1", port=9, endpoint=None, backend="openai-embeddings"
    )
    assert resolve_target(args) == ("http://127.0.0.1:9", "/v1/embeddings")
    assert is_embedding_endpoint("/v1/embeddings")
    assert not is_embedding_endpoint("/v1/completions")
    args.endpoint = "/v1/completions"
    with pytest.raises(ValueError, match="contradicts --backend openai-embeddings"):
        resolve_target(args)


def test_an_embedding_body_carries_the_prompt_as_its_one_input() -> None:
    assert embedding_request_body("m", SampleRequest([5, 6, 7], 3, 1)) == {
        "model": "m",
        "input": [5, 6, 7],
        "encoding_format": "float",
    }
    assert embedding_request_body("m", SampleRequest("hello", 2, 1))["input"] == "hello"


def test_the_pooling_table_has_throughput_and_end_to_end_latency_only() -> None:
    results = [
        RequestResult(success=True, prompt_len=10, ttft=0.1, latency=0.1),
        RequestResult(success=True, prompt_len=30, ttft=0.3, latency=0.3),
        RequestResult(success=False, error="HTTP 400: bad"),
    ]
    table = format_embedding_table(summarize(results, duration_s=2.0))
    rows = _rows(table)
    assert tuple(rows) == _TABLE_ROWS
    assert rows["Successful requests:"] == 2 and rows["Failed requests:"] == 1
    assert rows["Total input tokens:"] == 40 and rows["Request throughput (req/s):"] == 1.0
    assert rows["Total Token throughput (tok/s):"] == 20.0
    assert rows["Mean E2EL (ms):"] == rows["Median E2EL (ms):"] == 200.0
    assert "TTFT" not in table and "generated" not in table


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_encoder(
        tmp_path_factory.mktemp("bench-embeddings") / "embedder",
        "bert",
        sentence_transformers={"pooling": "mean", "normalize": True},
    )


@pytest.fixture(scope="module")
def server(embedder: Path) -> Iterator[RemoteServer]:
    with running_server(str(embedder), "--runner", "pooling") as server:
        yield server


def test_a_run_against_a_pooling_server_prints_vllms_embedding_table(
    server: RemoteServer,
    embedder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    saved = tmp_path / "result.json"
    main(
        [
            "bench",
            "serve",
            "--backend",
            "openai-embeddings",
            "--base-url",
            server.url,
            "--tokenizer",
            str(embedder),
            "--random-input-len",
            "24",
            "--random-range-ratio",
            "0.5",
            "--num-prompts",
            "12",
            "--max-concurrency",
            "4",
            "--save-result",
            str(saved),
        ]
    )
    out = capsys.readouterr().out
    assert "errors:" not in out
    rows = _rows(out)
    assert tuple(rows) == _TABLE_ROWS
    assert rows["Successful requests:"] == 12 and rows["Failed requests:"] == 0
    record = json.loads(saved.read_text())
    # The input tokens are the server's count (usage.prompt_tokens), [CLS] and [SEP] included.
    assert rows["Total input tokens:"] == sum(record["input_lens"]) == record["total_input_tokens"]
    assert all(length >= 2 for length in record["input_lens"])
    assert record["endpoint"] == "/v1/embeddings"
    assert rows["P99 E2EL (ms):"] >= rows["Median E2EL (ms):"] > 0
    assert re.search(r"Request throughput \(req/s\):\s+[0-9.]+", out)
