"""The `kvflow` console script, run as a real subprocess."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def kvflow_command() -> list[str]:
    script = shutil.which("kvflow", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "kvflow.entrypoints.cli"]


def test_demo_subcommand_verifies_its_outputs() -> None:
    result = subprocess.run(
        [*kvflow_command(), "demo", "--num-requests", "20", "--max-tokens", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "verified:            20/20" in result.stdout
    assert "prefix-cache hits" in result.stdout


def test_missing_subcommand_is_a_usage_error() -> None:
    result = subprocess.run(
        kvflow_command(), capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert "usage: kvflow" in result.stderr


def test_generate_runs_the_default_model_and_is_deterministic() -> None:
    command = [
        *kvflow_command(),
        "generate",
        "Hello, my name is",
        "--max-tokens",
        "8",
        "--show-stats",
    ]
    first = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("Hello, my name is")
    assert len(first.stdout.strip()) > len("Hello, my name is")
    assert "output tokens: 8" in first.stderr
    second = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert (
        second.stdout == first.stdout
    )  # greedy by default, and the default model is built deterministically


def test_generate_sampling_options_and_several_prompts() -> None:
    result = subprocess.run(
        [
            *kvflow_command(),
            "generate",
            "one",
            "two",
            "--max-tokens",
            "4",
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
            "--seed",
            "3",
            "-n",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        sum(line.startswith("one") for line in lines) == 2
        and sum(line.startswith("two") for line in lines) == 2
    )


def test_generate_rejects_bad_sampling_parameters_with_a_clear_message() -> None:
    result = subprocess.run(
        [*kvflow_command(), "generate", "hi", "--top-p", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "SamplingParams.top_p" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_and_chat_have_help() -> None:
    for subcommand, expected in (("generate", "--max-tokens"), ("chat", "--system")):
        result = subprocess.run(
            [*kvflow_command(), subcommand, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert (
            result.returncode == 0
            and expected in result.stdout
            and "--temperature" in result.stdout
        )


def test_chat_answers_each_line_and_keeps_the_conversation() -> None:
    result = subprocess.run(
        [*kvflow_command(), "chat", "--max-tokens", "6", "--system", "Be brief."],
        input="Hi there\n\nHow are you?\n/exit\nnot read\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    replies = result.stdout.splitlines()
    assert (
        2 <= len(replies) <= 2 + 6
    )  # one reply per user turn (a reply may itself contain newlines)
    assert "Traceback" not in result.stderr


def test_generate_takes_every_engine_option_and_rejects_bad_ones_in_one_line() -> None:
    base = [*kvflow_command(), "generate", "Hello", "--max-tokens", "4"]
    tuned = subprocess.run(
        [*base, "--max-num-seqs", "2", "--no-enable-prefix-caching", "--no-async-scheduling"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    default = subprocess.run(base, capture_output=True, text=True, timeout=300, check=False)
    assert tuned.returncode == 0 and default.returncode == 0, tuned.stderr + default.stderr
    assert tuned.stdout == default.stdout  # greedy output does not depend on these engine options
    bad = subprocess.run(
        [*base, "--max-num-seqs", "0"], capture_output=True, text=True, timeout=300, check=False
    )
    assert bad.returncode == 2
    assert "max_num_seqs must be >= 1" in bad.stderr and "Traceback" not in bad.stderr
