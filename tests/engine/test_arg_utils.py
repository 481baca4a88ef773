"""EngineArgs: one declaration of the engine options, shared by LLM, AsyncLLM and the CLI."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

import pytest

from kvflow import LLM, AsyncLLM
from kvflow.engine.arg_utils import EngineArgs
from kvflow.model_info import resolve_model_info

# The engine flags DESIGN.md promises `kvflow serve` (and so every command built on EngineArgs).
DESIGN_FLAGS = (
    "--model",
    "--dtype",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--num-kv-blocks",
    "--kv-cache-memory-bytes",
    "--no-enable-prefix-caching",
    "--async-scheduling",
    "--no-async-scheduling",
    "--scheduling-policy",
    "--seed",
    "--skip-tokenizer-init",
    "--tensor-parallel-size",
    "--data-parallel-size",
)


def parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def test_defaults_are_the_documented_engine_defaults() -> None:
    args = EngineArgs()
    assert (args.model, args.max_num_seqs, args.block_size, args.scheduling_policy) == (
        None,
        128,
        16,
        "fcfs",
    )
    assert args.async_scheduling and args.enable_prefix_caching and args.enable_chunked_prefill
    assert args.use_v2_model_runner and args.seed == 0 and args.dtype == "auto"


@pytest.mark.parametrize(
    ("field_name", "value"),
    [
        ("max_num_seqs", "8"),
        ("max_num_seqs", True),  # a bool is not a count
        ("block_size", 1.5),
        ("model", 3),
        ("enable_prefix_caching", "yes"),
        ("num_kv_blocks", "many"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_field(field_name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field_name} must be"):
        EngineArgs(**{field_name: value})


def test_choices_and_invalid_parallelism_are_value_errors() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(dtype="int4")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineArgs(scheduling_policy="lifo")
    with pytest.raises(ValueError, match=r"^data_parallel_size must be >= 1"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="'uni' runs a single rank; tensor_parallel_size=2"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineArgs(distributed_executor_backend="mpi")
    assert (
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray").tensor_parallel_size
        == 2
    )


def test_model_and_tokenizer_accept_paths(tmp_path: Path) -> None:
    args = EngineArgs(model=tmp_path, tokenizer=tmp_path)  # type: ignore[arg-type]
    assert args.model == str(tmp_path) and args.tokenizer == str(tmp_path)


def test_every_field_has_a_flag_and_the_flags_round_trip() -> None:
    cli = parser()
    flags = {flag for action in cli._actions for flag in action.option_strings}
    for option in dataclasses.fields(EngineArgs):
        assert "--" + option.name.replace("_", "-") in flags, option.name
    assert set(DESIGN_FLAGS) <= flags
    assert EngineArgs.from_cli_args(cli.parse_args([])) == EngineArgs()
    parsed = EngineArgs.from_cli_args(
        cli.parse_args(
            [
                "--model",
                "hash",
                "--max-num-seqs",
                "4",
                "--no-enable-prefix-caching",
                "--no-async-scheduling",
                "--scheduling-policy",
                "priority",
                "--max-model-len",
                "256",
            ]
        )
    )
    assert parsed == EngineArgs(
        model="hash",
        max_num_seqs=4,
        enable_prefix_caching=False,
        async_scheduling=False,
        scheduling_policy="priority",
        max_model_len=256,
    )


def test_a_bad_choice_on_the_command_line_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["--dtype", "int4"])
    assert info.value.code == 2 and "--dtype" in capsys.readouterr().err


def test_engine_config_applies_the_model_and_device_defaults() -> None:
    hash_model = resolve_model_info("hash")
    config = EngineArgs(model="hash", device="cpu").create_engine_config(hash_model)
    scheduler_config = config.scheduler_config
    assert scheduler_config.max_model_len == hash_model.max_model_len
    assert scheduler_config.max_num_batched_tokens == 2048  # the CPU default
    no_chunking = EngineArgs(model="hash", device="cpu", enable_chunked_prefill=False)
    # Without chunked prefill a whole prompt must fit one step.
    assert (
        no_chunking.create_engine_config(hash_model).scheduler_config.max_num_batched_tokens
        == hash_model.max_model_len
    )
    with pytest.raises(ValueError, match="max_model_len=999999 is larger than the model supports"):
        EngineArgs(model="hash", max_model_len=999999).create_engine_config(hash_model)


def test_llm_and_async_llm_take_the_same_options() -> None:
    options = {"max_num_seqs": 3, "num_kv_blocks": 64, "block_size": 4, "max_model_len": 128}
    llm = LLM("hash", **options)
    assert llm.engine_config.scheduler_config.max_num_seqs == 3
    from_args = LLM.from_engine_args(EngineArgs(model="hash", **options))
    assert from_args.engine_config == llm.engine_config
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model="hash", **options))
    try:
        assert async_llm.engine_config == llm.engine_config
    finally:
        async_llm.shutdown()
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM("hash", max_num_sequences=3)
    with pytest.raises(ValueError, match=r"^max_num_seqs must be"):
        LLM("hash", max_num_seqs="3")
    with pytest.raises(ValueError, match=r"^max_num_seqs must be"):
        asyncio.run(_make_async_llm(max_num_seqs=2.0))


async def _make_async_llm(**options: object) -> AsyncLLM:
    return AsyncLLM("hash", **options)
