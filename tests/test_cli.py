"""The `kvflow` console script, run as a real subprocess: generate, demo, help and version.

Chat is in test_cli_chat.py, user mistakes and interruptions in test_cli_errors.py; both use the helpers here.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.entrypoints.cli import build_parser
from kvflow.models.hash_model import reference_tokens

# The hash model on a small engine (the model's own max_model_len needs far more KV cache than tests want).
HASH_MODEL = [
    "--model",
    "hash",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "64",
    "--max-num-seqs",
    "4",
]
# The default model with a small KV cache (and few enough slots that it holds them all at full length).
SMALL_CACHE = ["--num-kv-blocks", "256", "--max-num-seqs", "4", "--max-model-len", "1024"]
LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[")
HEADER = re.compile(r"^\[prompt (\d+), sample (\d+)\]$")


def kvflow_command() -> list[str]:
    script = shutil.which("kvflow", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "kvflow.entrypoints.cli"]


def kvflow_env(**overrides: str) -> dict[str, str]:
    """This environment at the default log level, plus `overrides`."""
    env = {key: value for key, value in os.environ.items() if key != "KVFLOW_LOGGING_LEVEL"}
    return {**env, **overrides}


def run_kvflow(
    *args: str, stdin: str | None = None, timeout: float = 300, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kvflow_command(), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=kvflow_env(**env),
    )


def non_log_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not LOG_LINE.match(line)]


def parse_samples(stdout: str) -> dict[tuple[int, int], list[str]]:
    """{(prompt, sample): the lines after its `[prompt P, sample S]` header}, in printed order."""
    samples: dict[tuple[int, int], list[str]] = {}
    current: list[str] | None = None
    for line in stdout.splitlines():
        header = HEADER.match(line)
        if header:
            current = samples.setdefault((int(header[1]), int(header[2])), [])
        else:
            assert current is not None, f"output before the first header: {line!r}"
            current.append(line)
    return samples


def test_demo_subcommand_verifies_its_outputs() -> None:
    result = run_kvflow("demo", "--num-requests", "20", "--max-tokens", "5", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "verified:            20/20" in result.stdout
    assert "prefix-cache hits" in result.stdout


def test_missing_subcommand_is_a_usage_error() -> None:
    result = run_kvflow(timeout=60)
    assert result.returncode == 2
    assert "usage: kvflow" in result.stderr


def test_generate_runs_the_default_model_and_is_deterministic_with_logs_on_stderr() -> None:
    args = ("generate", "Hello, my name is", "--max-tokens", "8", "--show-stats", *SMALL_CACHE)
    first = run_kvflow(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("Hello, my name is")
    assert len(first.stdout.strip()) > len("Hello, my name is")
    assert not any(LOG_LINE.match(line) for line in first.stdout.splitlines())  # logs: stderr
    assert "output tokens: 8" in first.stderr
    assert any(
        line.startswith("INFO ") and "KV cache" in line for line in first.stderr.splitlines()
    )
    second = run_kvflow(*args, KVFLOW_LOGGING_LEVEL="WARNING")
    # Greedy by default, and the default model is built deterministically.
    assert second.stdout == first.stdout
    assert "INFO" not in second.stderr


def test_several_prompts_and_samples_are_labelled_in_order() -> None:
    result = run_kvflow(
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
        *SMALL_CACHE,
    )
    assert result.returncode == 0, result.stderr
    samples = parse_samples(result.stdout)
    assert list(samples) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (prompt_index, _), lines in samples.items():
        assert lines[0].startswith(("one", "two")[prompt_index])


def test_generate_reads_prompts_from_stdin_one_per_line() -> None:
    args = ("generate", "--max-tokens", "3", *SMALL_CACHE)
    piped = run_kvflow(*args, "first", "-", stdin="second\n\n  \nthird\n")
    assert piped.returncode == 0, piped.stderr
    samples = parse_samples(piped.stdout)
    assert list(samples) == [(0, 0), (1, 0), (2, 0)]  # blank lines skipped
    for lines, prompt in zip(samples.values(), ["first", "second", "third"], strict=True):
        assert lines[0].startswith(prompt)
    alone = run_kvflow(*args, "second")
    assert samples[(1, 0)] == alone.stdout.splitlines()  # the same sample as on the command line


def test_token_id_prompts_print_token_ids_and_stop_token_ids_apply() -> None:
    prompt = [11, 22, 33]
    expected = reference_tokens(prompt, 8)
    ids = ",".join(map(str, prompt))
    base = ("generate", "--prompt-token-ids", ids, *HASH_MODEL, "--max-tokens", "8")
    plain = run_kvflow(*base)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == ",".join(map(str, expected)) + "\n"
    assert not {7, 9} & set(expected)
    # Comma-separated and repeatable; the stop token is the last one printed.
    stopped = run_kvflow(*base, "--stop-token-ids", f"7,{expected[3]}", "--stop-token-ids", "9")
    assert stopped.stdout == ",".join(map(str, expected[:4])) + "\n"


@pytest.mark.slow  # two more processes; min_tokens and the engine-core process are tested in tests/engine
def test_token_id_prompts_with_min_tokens_and_over_an_engine_process() -> None:
    prompt = [11, 22, 33]
    expected = reference_tokens(prompt, 8)
    base = ("generate", "--prompt-token-ids", ",".join(map(str, prompt)), *HASH_MODEL)
    base = (*base, "--max-tokens", "8")
    plain_stdout = ",".join(map(str, expected)) + "\n"
    # min_tokens holds the stop back; the sample runs to max_tokens (the stop id does not recur).
    held = run_kvflow(*base, "--stop-token-ids", str(expected[0]), "--min-tokens", "3")
    assert expected[0] not in expected[1:]
    assert held.stdout == plain_stdout
    # The same front end over an engine-core process.
    in_process = run_kvflow(*base, "--engine-process")
    assert in_process.returncode == 0, in_process.stderr
    assert in_process.stdout == plain_stdout and "engine core process" in in_process.stderr


@pytest.mark.slow  # three processes; LLM(data_parallel_size=2) itself is tested in tests/engine/test_dp_client.py
def test_generate_over_two_data_parallel_cores() -> None:
    prompt = [11, 22, 33]
    expected = reference_tokens(prompt, 8)
    base = ("generate", "--prompt-token-ids", ",".join(map(str, prompt)), *HASH_MODEL)
    base = (*base, "--max-tokens", "8")
    two = ",".join(map(str, [44, 55]))
    parallel = run_kvflow(*base[:3], two, *base[3:], "--data-parallel-size", "2")
    assert parallel.returncode == 0, parallel.stderr
    assert parallel.stdout.splitlines() == [
        "[prompt 0, sample 0]",
        ",".join(map(str, expected)),
        "[prompt 1, sample 0]",
        ",".join(map(str, reference_tokens([44, 55], 8))),
    ]


def test_skip_tokenizer_init_with_token_ids_matches_the_text_run() -> None:
    from kvflow.default_model import ensure_default_model
    from kvflow.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ensure_default_model())  # the conftest's cache, as the subprocesses
    prompt = "The capital of France is"
    text_run = run_kvflow("generate", prompt, "--max-tokens", "6", *SMALL_CACHE)
    ids = ",".join(map(str, tokenizer.encode(prompt)))
    id_run = run_kvflow(
        "generate",
        ids,
        "--prompt-token-ids",
        "--skip-tokenizer-init",
        "--max-tokens",
        "6",
        *SMALL_CACHE,
    )
    assert id_run.returncode == 0, id_run.stderr
    output_ids = [int(token) for token in id_run.stdout.strip().split(",")]
    assert len(output_ids) <= 6
    assert prompt + tokenizer.decode(output_ids) == text_run.stdout.rstrip("\n")


def test_logprobs_print_one_line_per_token_with_ranks_and_their_sum() -> None:
    result = run_kvflow(
        "generate", "Hello", "--max-tokens", "5", "--logprobs", "2", "--ignore-eos", *SMALL_CACHE
    )
    assert result.returncode == 0, result.stderr
    text, header, *rows, total = result.stdout.splitlines()
    assert text.startswith("Hello") and header.startswith("logprobs: position")
    assert len(rows) == 5
    values = []
    for position, row in enumerate(rows):
        main, top = row.split("  | ")
        fields = main.split()
        assert int(fields[0]) == position
        assert fields[-1] == "#1"  # greedy: the sampled token is the most likely one
        values.append(float(fields[-2]))
        alternatives = re.findall(r"\((\d+)\) (-?\d+\.\d+)", top)
        assert len(alternatives) == 2
        assert float(alternatives[0][1]) == values[-1]  # the top-1 alternative is the sampled token
        assert float(alternatives[0][1]) >= float(alternatives[1][1])
    assert total.startswith("cumulative logprob: ")
    assert abs(float(total.split(": ")[1]) - sum(values)) < 1e-3


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every (nested) subcommand's parser, by its name path (`bench serve`)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                found[name] = subparser
                found.update(
                    {f"{name} {sub}": nested for sub, nested in _subparsers(subparser).items()}
                )
    return found


def test_every_option_has_help_text_and_shows_a_default_that_says_something() -> None:
    subparsers = _subparsers(build_parser())
    assert {"generate", "chat", "demo", "serve", "bench", "bench serve"} <= set(subparsers)
    for name, subparser in subparsers.items():
        assert subparser.description, name
        formatter = subparser.formatter_class(prog=subparser.prog)
        for action in subparser._actions:
            if not action.option_strings:
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help text"
            help_text = formatter._get_help_string(action) % {"default": action.default}
            assert "(default: None)" not in help_text
            if isinstance(
                action, argparse._StoreTrueAction
            ):  # "--flag (default: False)" says nothing
                assert "(default: False)" not in help_text
            elif action.default is not None and action.default is not argparse.SUPPRESS:
                assert "default" in help_text, f"{name} {action.option_strings[0]}: {help_text}"


def test_help_output_lists_the_flags_and_the_output_format() -> None:
    generate_help = run_kvflow("generate", "--help", timeout=60)
    assert generate_help.returncode == 0, generate_help.stderr
    assert (
        "(default: 64)" in generate_help.stdout and "[prompt P, sample S]" in generate_help.stdout
    )
    for flag in ("--logprobs", "--min-tokens", "--stop-token-ids", "--prompt-token-ids"):
        assert flag in generate_help.stdout
    engine_flags = (
        "--num-kv-blocks",
        "--block-size",
        "--max-num-batched-tokens",
        "--seed",
        "--no-enable-prefix-caching",
        "--scheduling-policy",
        "--skip-tokenizer-init",
    )
    for flag in engine_flags:
        assert flag in generate_help.stdout
    assert "KVFLOW_LOGGING_LEVEL" in generate_help.stdout
    chat_help = run_kvflow("chat", "--help", timeout=60).stdout
    assert (
        "(default: 256)" in chat_help and "--chat-template" in chat_help and "/reset" in chat_help
    )
    assert "hash test model" in run_kvflow("demo", "--help", timeout=60).stdout


def test_version_matches_the_package_and_python_dash_m_kvflow_works() -> None:
    import kvflow

    script = run_kvflow("--version", timeout=60)
    module = subprocess.run(
        [sys.executable, "-m", "kvflow", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert script.returncode == 0 and module.returncode == 0, script.stderr + module.stderr
    assert script.stdout == module.stdout == f"kvflow {kvflow.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", kvflow.__version__)


def test_generate_takes_every_engine_option() -> None:
    base = ("generate", "Hello", "--max-tokens", "4")
    tuned = run_kvflow(
        *base,
        "--max-num-seqs",
        "2",
        "--no-enable-prefix-caching",
        "--no-async-scheduling",
        "--num-kv-blocks",
        "200",
        "--block-size",
        "32",
        "--max-num-batched-tokens",
        "64",
        "--scheduling-policy",
        "priority",
        "--seed",
        "5",
    )
    default = run_kvflow(*base, *SMALL_CACHE)
    assert tuned.returncode == 0 and default.returncode == 0, tuned.stderr + default.stderr
    assert tuned.stdout == default.stdout  # greedy output does not depend on these engine options
    assert "200 blocks x 32 tokens" in tuned.stderr  # and they reached the engine
