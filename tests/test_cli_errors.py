"""User mistakes end `kvflow` with one line `kvflow <command>: error: ...` and status 2, never a traceback; Ctrl-C
ends it with status 130 and a closed stdout with status 1, quietly. Real subprocesses."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.test_cli import (
    HASH_MODEL,
    SMALL_CACHE,
    kvflow_command,
    kvflow_env,
    non_log_lines,
    run_kvflow,
)


def assert_one_line_error(
    result: subprocess.CompletedProcess[str], fragment: str | None, command: str = "generate"
) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = non_log_lines(result.stderr)  # log lines (INFO ...) may come before it
    assert line.startswith(f"kvflow {command}: error: "), line
    if fragment is not None:
        assert fragment in line, line


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--top-p", "1.5"], "SamplingParams.top_p"),
        # Each case is a process start (~3 s): the slow-marked ones repeat a kind of error another case covers.
        pytest.param(["--min-tokens", "100"], "SamplingParams.min_tokens", marks=pytest.mark.slow),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
        pytest.param(["--device", "tpu"], "device", marks=pytest.mark.slow),
        (["--kv-cache-memory-bytes", "1"], "kv_cache_memory_bytes"),
        pytest.param(  # more memory than any machine has
            ["--kv-cache-memory-bytes", str(10**15)], None, marks=pytest.mark.slow
        ),
        (["--model", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["--stop-token-ids", "1,x"], "--stop-token-ids"),  # a usage error: one line, too
        pytest.param(["--skip-tokenizer-init"], "--prompt-token-ids", marks=pytest.mark.slow),
        (HASH_MODEL, "--prompt-token-ids"),  # a model without a tokenizer
        pytest.param(  # "Hello" is not a list of ids
            ["--prompt-token-ids"], "--prompt-token-ids", marks=pytest.mark.slow
        ),
    ],
)
def test_a_bad_option_is_one_line_and_status_2(args: list[str], fragment: str | None) -> None:
    result = run_kvflow("generate", "Hello", "--max-tokens", "2", *args, timeout=300)
    assert_one_line_error(result, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch build without CUDA")
def test_device_cuda_without_cuda_is_one_line() -> None:
    result = run_kvflow("generate", "Hello", "--max-tokens", "2", "--device", "cuda", *SMALL_CACHE)
    assert_one_line_error(result, "cuda")


def test_an_invalid_logging_level_is_refused_before_anything_loads() -> None:
    result = run_kvflow("generate", "Hello", KVFLOW_LOGGING_LEVEL="LOUD", timeout=60)
    assert_one_line_error(result, "KVFLOW_LOGGING_LEVEL='LOUD'")
    assert result.stderr.count("\n") == 1  # no log line either: the engine never started


def test_a_cache_dir_that_is_a_file_or_below_one_is_one_line(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("not a folder")
    for cache_dir in (not_a_folder, not_a_folder / "below"):
        result = run_kvflow("generate", "Hello", KVFLOW_CACHE_DIR=str(cache_dir), timeout=120)
        assert_one_line_error(result, str(not_a_folder))


def test_ctrl_c_during_generate_exits_130_without_a_traceback() -> None:
    command = [
        *kvflow_command(),
        "generate",
        "Once upon a time",
        "--max-tokens",
        "100000",
        "--ignore-eos",
        *SMALL_CACHE,
    ]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=kvflow_env(),
    )
    try:
        assert process.stderr is not None
        seen = []
        for line in process.stderr:  # the KV cache line comes right before generation starts
            seen.append(line)
            if "KV cache" in line:
                break
        assert process.poll() is None, "".join(seen)  # ~2000 tokens to go: still generating
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert non_log_lines(stderr) == ["kvflow generate: interrupted"]
    assert stdout == ""


def test_a_closed_stdout_ends_quietly_with_status_1() -> None:
    process = subprocess.Popen(
        [*kvflow_command(), "generate", "--prompt-token-ids", "1,2,3", *HASH_MODEL],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=kvflow_env(KVFLOW_LOGGING_LEVEL="WARNING"),
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # like `kvflow generate ... | head -0`: nobody reads the samples
    try:
        stderr = process.stderr.read()
        process.wait(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1
    assert stderr == ""  # no BrokenPipeError, no "Exception ignored" from the final flush
