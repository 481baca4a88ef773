"""Unit tests for kvflow.sampling_params.SamplingParams: defaults, normalisation and per-field validation."""

from __future__ import annotations

import math
import re

import pytest

from kvflow.sampling_params import SamplingParams


def test_defaults():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.seed, params.max_tokens, params.min_tokens) == (None, 16, 0)
    assert (params.ignore_eos, params.logprobs, params.prompt_logprobs) == (False, None, None)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert (params.include_stop_str_in_output, params.skip_special_tokens) == (False, True)
    assert params.output_kind == "cumulative"


def test_default_stop_is_empty_list():
    assert SamplingParams().stop == []


def test_default_stop_token_ids_is_empty_list():
    assert SamplingParams().stop_token_ids == []


def test_stop_string_becomes_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_stop_tuple_becomes_list():
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]


def test_stop_list_is_copied():
    stop = ["a"]
    params = SamplingParams(stop=stop)
    stop.append("b")
    assert params.stop == ["a"]


def test_stop_token_ids_tuple_becomes_list():
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]  # type: ignore[arg-type]


def test_stop_token_ids_list_is_copied():
    stop_token_ids = [3]
    params = SamplingParams(stop_token_ids=stop_token_ids)
    stop_token_ids.append(4)
    assert params.stop_token_ids == [3]


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0).is_greedy


def test_positive_temperature_is_not_greedy():
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 4},
        {"temperature": 0.0},
        {"temperature": 2.5},
        {"top_p": 0.01},
        {"top_k": -1},
        {"top_k": 50},
        {"min_p": 1.0},
        {"seed": 0},
        {"max_tokens": 1},
        {"min_tokens": 16},
        {"stop": ["\n", "END"]},
        {"stop_token_ids": [0, 2]},
        {"logprobs": 0},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": 5},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 0.5},
        {"output_kind": "delta"},
        {"output_kind": "final_only"},
        # The edges of the types the engine stores each field in.
        {"top_k": 2**31 - 1},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"max_tokens": 2**63 - 1},
        {"stop_token_ids": [2**63 - 1]},
        {"temperature": 3.4e38},
        {"repetition_penalty": 3.4e38},
        {"repetition_penalty": 2e-45},  # rounds to the smallest positive float32
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


INVALID_VALUES = [
    ("n", 0),
    ("n", 1.5),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("min_tokens", 17),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", ""),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, "2"]),
    ("logprobs", -1),
    ("logprobs", 1.5),
    ("logprobs", True),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 2.0),
    ("prompt_logprobs", "3"),
    ("prompt_logprobs", True),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("output_kind", "streaming"),
    ("seed", 1.5),
    ("seed", "42"),
    # Past the types the engine stores them in (int64, int32 for top_k, finite float32): each would overflow
    # inside an engine step (numpy, torch) or where the request crosses into the engine process (msgspec).
    ("top_k", 2**31),
    ("top_k", 2**63),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("seed", 2**64),
    ("max_tokens", 2**63),
    ("n", 2**63),
    ("logprobs", 2**64),
    ("prompt_logprobs", 2**64),
    ("stop_token_ids", [2**63]),
    ("temperature", 3.5e38),
    ("temperature", 10**400),
    ("repetition_penalty", 1e-46),  # 0 once rounded to float32: logits would be divided by zero
    ("repetition_penalty", 10**400),
    ("presence_penalty", 10**400),
]


@pytest.mark.parametrize(("field_name", "value"), INVALID_VALUES)
def test_invalid_value_raises_value_error_naming_field(field_name, value):
    with pytest.raises(ValueError, match=rf"\b{re.escape(field_name)}\b"):
        SamplingParams(**{field_name: value})


@pytest.mark.parametrize(
    ("field_name", "value"),
    [
        ("stop", 5),
        ("stop_token_ids", 5),
    ],
)
def test_non_iterable_value_raises_value_error_naming_field(field_name, value):
    with pytest.raises(ValueError, match=rf"\b{re.escape(field_name)}\b"):
        SamplingParams(**{field_name: value})


def test_min_tokens_above_custom_max_tokens_raises():
    with pytest.raises(ValueError, match=r"\bmin_tokens\b"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_min_tokens_equal_to_max_tokens_is_accepted():
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_bool_temperature_is_rejected():
    with pytest.raises(ValueError, match=r"\btemperature\b"):
        SamplingParams(temperature=True)  # type: ignore[arg-type]


def test_an_error_about_a_huge_value_stays_short():
    """A client's 10**5000 is named by its size, not printed (an int that long has no str at all)."""
    with pytest.raises(
        ValueError, match=r"SamplingParams\.max_tokens .* got an int of 16610 bits$"
    ) as info:
        SamplingParams(max_tokens=10**5000)
    assert len(str(info.value)) < 120


def test_validate_checks_a_params_object_changed_after_construction():
    params = SamplingParams()
    params.top_k = 2**40
    with pytest.raises(ValueError, match=r"\btop_k\b"):
        params.validate()
    params.top_k, params.stop = 0, None  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"\bstop\b"):
        params.validate()


def test_every_public_name_imports_from_the_package() -> None:
    """`from kvflow import X` works for each name in `kvflow.__all__`, as vLLM users write it (issue 44: the beam
    search parameters were missing)."""
    import kvflow

    assert "BeamSearchParams" in kvflow.__all__
    for name in kvflow.__all__:
        assert getattr(kvflow, name) is not None, name
