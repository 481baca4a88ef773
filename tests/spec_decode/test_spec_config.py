"""The engine option `speculative_config` (`--speculative-config JSON`): parsing, errors naming the key, the CLI
flag, the fallback to synchronous scheduling and the named refusal of the not-yet-implemented draft model."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvflow.config import EngineConfig, SpeculativeConfig
from kvflow.engine.arg_utils import EngineArgs
from kvflow.model_info import resolve_model_info


def ngram_option(**extra: object) -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": 3, **extra}


# ------------------------------------------------------------------------------------------------ parsing
def test_absent_or_empty_is_no_speculation() -> None:
    assert SpeculativeConfig.from_option(None) is None
    assert SpeculativeConfig.from_option({}) is None
    assert EngineConfig().speculative_config is None


def test_ngram_with_the_default_lookup_bounds() -> None:
    assert SpeculativeConfig.from_option(ngram_option()) == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_max=5, prompt_lookup_min=2
    )
    assert SpeculativeConfig.from_option(
        ngram_option(prompt_lookup_max=4, prompt_lookup_min=1)
    ) == SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=1)


def test_a_lookup_bound_given_alone_moves_the_other_default() -> None:
    only_max = SpeculativeConfig.from_option(ngram_option(prompt_lookup_max=1))
    assert only_max is not None and (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (
        1,
        1,
    )
    only_min = SpeculativeConfig.from_option(ngram_option(prompt_lookup_min=7))
    assert only_min is not None and (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (
        7,
        7,
    )


def test_a_model_alone_implies_draft_model() -> None:
    config = SpeculativeConfig.from_option({"model": "/drafts/small", "num_speculative_tokens": 4})
    assert config == SpeculativeConfig("draft_model", 4, model="/drafts/small")


def test_unknown_keys_are_named_with_the_accepted_ones() -> None:
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_option(ngram_option(draft_tensor_parallel_size=1, foo=2))
    message = str(info.value)
    assert "unknown keys ['draft_tensor_parallel_size', 'foo']" in message
    for key in (
        "method",
        "num_speculative_tokens",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "model",
        "disable_by_batch_size",
    ):
        assert repr(key) in message


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            {"method": "eagle", "num_speculative_tokens": 2},
            r"method: unknown speculative proposer 'eagle'; ",
        ),
        ({"method": 3, "num_speculative_tokens": 2}, r"method: unknown speculative proposer 3"),
        (
            {"num_speculative_tokens": 2},
            r"needs 'method' \(one of ngram, draft_model[^)]*\) or a draft 'model'",  # tests may register more
        ),
        ({"method": "ngram"}, r"needs 'num_speculative_tokens'"),
        (
            ngram_option(num_speculative_tokens=0),
            r"num_speculative_tokens must be an integer >= 1, got 0",
        ),
        (
            ngram_option(num_speculative_tokens=True),
            r"num_speculative_tokens must be an integer >= 1",
        ),
        (
            ngram_option(num_speculative_tokens="3"),
            r"num_speculative_tokens must be an integer >= 1",
        ),
        (ngram_option(prompt_lookup_max=0), r"prompt_lookup_max must be an integer >= 1, got 0"),
        (
            ngram_option(prompt_lookup_min=2.5),
            r"prompt_lookup_min must be an integer >= 1, got 2.5",
        ),
        (
            ngram_option(prompt_lookup_min=4, prompt_lookup_max=3),
            r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(3\)",
        ),
        (ngram_option(model="/draft"), r"model is for method 'draft_model'; method 'ngram'"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2},
            r"method 'draft_model' needs 'model'",
        ),
        ({"model": 7, "num_speculative_tokens": 2}, r"model must be a path \(a string\), got 7"),
        (
            {"model": "/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            r"prompt_lookup_max applies to method 'ngram' only, not 'draft_model'",
        ),
        (["ngram"], r"must be a JSON object \(a dict\)"),
        (
            ngram_option(disable_by_batch_size=0),
            r"disable_by_batch_size must be an integer >= 1 \(or null\), got 0",
        ),
        (
            ngram_option(disable_by_batch_size="8"),
            r"disable_by_batch_size must be an integer >= 1 \(or null\), got '8'",
        ),
    ],
)
def test_every_bad_value_names_its_key(option: object, message: str) -> None:
    with pytest.raises(ValueError, match=r"^speculative_config " + message):
        SpeculativeConfig.from_option(option)  # type: ignore[arg-type]


def test_the_config_is_frozen() -> None:
    config = SpeculativeConfig("ngram", 2)
    with pytest.raises(AttributeError):
        config.num_speculative_tokens = 3  # type: ignore[misc]


def test_checking_a_method_imports_no_proposer() -> None:
    """config.py checks method names against the registry, which imports nothing heavy."""
    code = (
        "import sys; from kvflow.config import SpeculativeConfig; SpeculativeConfig('ngram', 2); "
        "print(sorted(m for m in ('torch', 'numpy', 'kvflow.spec_decode.ngram') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------ EngineArgs
def test_engine_args_land_the_config_in_the_engine_config() -> None:
    args = EngineArgs(model="hash", device="cpu", speculative_config=ngram_option())
    config = args.create_engine_config(resolve_model_info("hash"))
    assert config.speculative_config == SpeculativeConfig("ngram", 3)
    no_spec = EngineArgs(model="hash", device="cpu").create_engine_config(
        resolve_model_info("hash")
    )
    assert no_spec.speculative_config is None


def test_the_cli_flag_parses_json_into_the_config() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    namespace = parser.parse_args(
        [
            "--model",
            "hash",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
        ]
    )
    args = EngineArgs.from_cli_args(namespace)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    config = args.create_engine_config(resolve_model_info("hash"))
    assert config.speculative_config == SpeculativeConfig("ngram", 2)


def test_a_bad_cli_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--speculative-config", "[1, 2]"])
    assert info.value.code == 2 and "--speculative-config" in capsys.readouterr().err


def test_kvflow_generate_help_lists_the_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvflow.entrypoints.cli", "generate", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--speculative-config" in result.stdout


def test_a_bad_option_fails_at_engine_args() -> None:
    with pytest.raises(ValueError, match=r"^speculative_config has unknown keys \['k'\]"):
        EngineArgs(model="hash", speculative_config={"method": "ngram", "k": 2})


def test_a_model_alone_means_draft_model() -> None:
    args = EngineArgs(
        model="hash", speculative_config={"model": "/draft", "num_speculative_tokens": 2}
    )
    config = args._speculative_config()
    assert config is not None and (config.method, config.model) == ("draft_model", "/draft")


def test_speculation_keeps_the_scheduling_mode_asked_for() -> None:
    """Speculative decoding runs under both scheduling modes (async: draft slots the worker fills)."""
    hash_model = resolve_model_info("hash")
    for async_scheduling in (True, False):
        config = EngineArgs(
            model="hash",
            device="cpu",
            async_scheduling=async_scheduling,
            speculative_config=ngram_option(),
        ).create_engine_config(hash_model)
        assert config.scheduler_config.async_scheduling is async_scheduling
        assert config.speculative_config is not None
