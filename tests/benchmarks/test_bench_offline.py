"""`kvflow bench throughput` and `kvflow bench latency`: quick runs through the CLI's entry point on the hash model
and the default model, their vLLM summary lines and JSON, and the usage errors."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from kvflow.entrypoints.cli.main import main

HASH_ENGINE = ["--model", "hash", "--max-model-len", "256", "--num-kv-blocks", "128"]
DEFAULT_ENGINE = ["--max-model-len", "256", "--num-kv-blocks", "128", "--max-num-seqs", "8"]
THROUGHPUT_LINE = re.compile(
    r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s$"
)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    main(["bench", *argv])
    return capsys.readouterr().out.splitlines()


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def count_after(lines: list[str], label: str) -> int:
    [line] = [line for line in lines if line.startswith(label)]
    return int(line[len(label) :])


def test_throughput_on_token_id_prompts_counts_every_sample(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    result_file = tmp_path / "throughput.json"
    lines = run(
        capsys, "throughput", *HASH_ENGINE,
        "--input-len", "24", "--output-len", "5", "--num-prompts", "12", "--n", "2",
        "--output-json", str(result_file),
    )  # fmt: skip
    match = THROUGHPUT_LINE.match(lines[0])
    assert match, lines
    requests_per_s, total_per_s, output_per_s = map(float, match.groups())
    assert count_after(lines, "Total num prompt tokens:") == 12 * 24
    assert (
        count_after(lines, "Total num output tokens:") == 12 * 5 * 2
    )  # EOS ignored: every sample full
    saved = json.loads(result_file.read_text())
    assert saved["num_requests"] == 12 and saved["total_num_tokens"] == 12 * 24 + 12 * 10
    assert saved["requests_per_second"] == pytest.approx(12 / saved["elapsed_time"])
    assert saved["tokens_per_second"] == pytest.approx(
        saved["total_num_tokens"] / saved["elapsed_time"]
    )
    assert requests_per_s == pytest.approx(saved["requests_per_second"], abs=0.01)
    assert total_per_s == pytest.approx(saved["tokens_per_second"], abs=0.01)
    assert output_per_s == pytest.approx(total_per_s * 120 / (288 + 120), abs=0.02)


def test_throughput_on_text_prompts_of_exact_length_and_a_sharegpt_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    result_file = tmp_path / "throughput.json"
    lines = run(
        capsys, "throughput", *DEFAULT_ENGINE, "--dataset-name", "random",
        "--input-len", "40", "--output-len", "3", "--num-prompts", "8", "--output-json", str(result_file),
    )  # fmt: skip
    # The default model has a tokenizer: text prompts, each exactly 40 tokens as the engine encodes them.
    assert THROUGHPUT_LINE.match(lines[0]), lines
    assert count_after(lines, "Total num prompt tokens:") == 8 * 40
    assert count_after(lines, "Total num output tokens:") == 8 * 3
    assert json.loads(result_file.read_text())["total_num_tokens"] == 8 * (40 + 3)

    conversation = {
        "conversations": [
            {"from": "human", "value": "Write a short story about a cat who likes the rain."},
            {"from": "gpt", "value": "Once upon a time a small grey cat sat at the window."},
        ]
    }
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps([conversation]))
    lines = run(
        capsys, "throughput", *DEFAULT_ENGINE, "--dataset-path", str(dataset),
        "--output-len", "2", "--num-prompts", "3",
    )  # fmt: skip
    assert THROUGHPUT_LINE.match(lines[0]), lines
    assert count_after(lines, "Total num output tokens:") == 3 * 2
    assert (
        count_after(lines, "Total num prompt tokens:") % 3 == 0
    )  # one conversation, drawn 3 times


def test_latency_prints_the_mean_and_percentiles_and_saves_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    result_file = tmp_path / "latency.json"
    lines = run(
        capsys, "latency", *HASH_ENGINE, "--input-len", "16", "--output-len", "4",
        "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "4",
        "--output-json", str(result_file),
    )  # fmt: skip
    saved = json.loads(result_file.read_text())
    assert set(saved) == {"avg_latency", "std_latency", "latencies", "percentiles"}
    latencies = saved["latencies"]
    assert len(latencies) == 4 and all(latency > 0 for latency in latencies)
    assert saved["avg_latency"] == pytest.approx(statistics.fmean(latencies))
    assert lines[0] == f"Avg latency: {saved['avg_latency']} seconds"
    assert lines[1] == f"Std latency: {saved['std_latency']} seconds"
    percentiles = {int(key): value for key, value in saved["percentiles"].items()}
    assert list(percentiles) == [10, 25, 50, 75, 90, 99]
    assert percentiles[50] == pytest.approx(statistics.median(latencies))
    assert min(latencies) <= percentiles[10] <= percentiles[90] <= max(latencies)
    assert lines[2:] == [
        f"{percentage}% percentile latency: {value} seconds"
        for percentage, value in percentiles.items()
    ]


def test_bad_flags_are_usage_errors_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--num-prompts must be >= 1" in usage_error(
        capsys, "throughput", *HASH_ENGINE, "--num-prompts", "0"
    )
    assert "argument --dataset-name: invalid choice: 'sonnet'" in usage_error(
        capsys, "throughput", "--dataset-name", "sonnet"
    )
    assert "--dataset-name sharegpt needs --dataset-path" in usage_error(
        capsys, "throughput", "--dataset-name", "sharegpt"
    )
    assert "--dataset-path /nonexistent.json: no such file" in usage_error(
        capsys, "throughput", "--dataset-path", "/nonexistent.json"
    )
    assert "--random-range-ratio must be in [0, 1)" in usage_error(
        capsys, "throughput", "--random-range-ratio", "1.5"
    )
    assert "--batch-size must be >= 1, got 0" in usage_error(
        capsys, "latency", *HASH_ENGINE, "--batch-size", "0"
    )
    assert "argument --num-iters: invalid int value" in usage_error(
        capsys, "latency", "--num-iters", "many"
    )
    too_long = usage_error(
        capsys, "latency", *HASH_ENGINE, "--input-len", "250", "--output-len", "8"
    )
    assert "does not fit max_model_len=256" in too_long and "--max-model-len" in too_long
    assert "Traceback" not in too_long
