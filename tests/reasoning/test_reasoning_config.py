"""The engine option: `reasoning_parser` / `enable_in_reasoning` in structured_outputs_config, and EngineArgs'
`reasoning_parser` (`--reasoning-parser`), which lands in the same place."""

from __future__ import annotations

import argparse

import pytest

from kvflow.config import StructuredOutputsConfig
from kvflow.engine.arg_utils import EngineArgs


def test_defaults_constrain_from_the_first_token() -> None:
    config = StructuredOutputsConfig()
    assert (config.reasoning_parser, config.enable_in_reasoning) == (None, False)
    assert not config.constrains_after_reasoning
    assert StructuredOutputsConfig.from_option(None) == config


def test_from_option_takes_both_keys() -> None:
    config = StructuredOutputsConfig.from_option(
        {"backend": "guidance", "reasoning_parser": "qwen3", "enable_in_reasoning": True}
    )
    assert config == StructuredOutputsConfig("guidance", "qwen3", True)
    assert not config.constrains_after_reasoning
    assert StructuredOutputsConfig(reasoning_parser="deepseek_r1").constrains_after_reasoning


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            {"reasoning_parser": "granite"},
            r"reasoning_parser: unknown reasoning parser 'granite'.*qwen3",
        ),
        ({"reasoning_parser": 3}, "reasoning_parser must be a string"),
        ({"enable_in_reasoning": "yes"}, "enable_in_reasoning must be true or false"),
        ({"reasoning": "qwen3"}, r"unknown keys \['reasoning'\].*'reasoning_parser'"),
    ],
)
def test_bad_options_name_the_key(option: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsConfig.from_option(option)
    with pytest.raises(ValueError, match=message):
        EngineArgs(structured_outputs_config=option)


def test_engine_args_flag_lands_in_structured_outputs_config() -> None:
    args = EngineArgs(reasoning_parser="deepseek_r1")
    assert args._structured_outputs_config() == StructuredOutputsConfig(
        reasoning_parser="deepseek_r1"
    )
    agreeing = EngineArgs(
        reasoning_parser="qwen3",
        structured_outputs_config={"reasoning_parser": "qwen3", "enable_in_reasoning": True},
    )
    assert agreeing._structured_outputs_config() == StructuredOutputsConfig(
        reasoning_parser="qwen3", enable_in_reasoning=True
    )


def test_conflicting_parsers_name_both_places() -> None:
    with pytest.raises(
        ValueError, match=r"reasoning_parser='qwen3' and structured_outputs_config.*'deepseek_r1'"
    ):
        EngineArgs(
            reasoning_parser="qwen3", structured_outputs_config={"reasoning_parser": "deepseek_r1"}
        )
    with pytest.raises(
        ValueError, match=r"reasoning_parser must be one of \('qwen3', 'deepseek_r1'\)"
    ):
        EngineArgs(reasoning_parser="granite")


def test_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--reasoning-parser", "qwen3"]))
    assert args.reasoning_parser == "qwen3"
    assert "--reasoning-parser {qwen3,deepseek_r1}" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "granite"])
    assert "invalid choice: 'granite'" in capsys.readouterr().err
