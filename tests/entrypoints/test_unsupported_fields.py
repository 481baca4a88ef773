"""`unsupported.py` without a server: every refused field is declared in the protocol models, refusals name the
field, the off values pass, the fields beam search does not take are refused only with it (and length_penalty
only without it), and unknown field names are logged once each, boundedly."""

from __future__ import annotations

import logging

import pytest

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.entrypoints.openai.unsupported import (
    BEAM_SEARCH_FIELDS,
    UNSUPPORTED_FIELDS,
    UnknownFields,
    refuse_unsupported_fields,
)

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_every_refused_field_is_declared_so_it_is_typed_and_documented() -> None:
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert {field.name for field in (*UNSUPPORTED_FIELDS, *BEAM_SEARCH_FIELDS)} <= declared


def test_defaults_are_off_and_a_refusal_names_its_field() -> None:
    refuse_unsupported_fields(ChatCompletionRequest(messages=MESSAGES))
    refuse_unsupported_fields(CompletionRequest(prompt="Hi"))
    with pytest.raises(OpenAIServingError) as caught:
        refuse_unsupported_fields(
            ChatCompletionRequest(
                messages=MESSAGES, guided_whitespace_pattern=r"\s*", use_beam_search=True
            )
        )
    assert caught.value.param == "guided_whitespace_pattern"  # the first in the table's order
    assert "not supported by kvflow yet" in caught.value.message


# A value beam search does not take, per field of BEAM_SEARCH_FIELDS.
NOT_WITH_BEAM_SEARCH: dict[str, object] = {
    "stream": True,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "logit_bias": {"7": 1.0},
    "allowed_token_ids": [1, 2],
    "bad_words": ["no"],
    "seed": 0,
    "stop": "x",
    "stop_token_ids": [7],
    "min_tokens": 1,
    "prompt_logprobs": 0,
    "response_format": {"type": "json_object"},
    "structured_outputs": {"choice": ["a"]},
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a"],
    "guided_grammar": "root ::= 'a'",
    "structural_tag": "{}",
}


def test_every_beam_search_refusal_has_a_case() -> None:
    assert {field.name for field in BEAM_SEARCH_FIELDS} == set(NOT_WITH_BEAM_SEARCH)


@pytest.mark.parametrize(("name", "value"), NOT_WITH_BEAM_SEARCH.items())
def test_a_field_beam_search_does_not_take_is_refused_with_it_only(
    name: str, value: object
) -> None:
    refuse_unsupported_fields(CompletionRequest(prompt="Hi", **{name: value}))
    with pytest.raises(OpenAIServingError) as caught:
        refuse_unsupported_fields(
            CompletionRequest(prompt="Hi", use_beam_search=True, **{name: value})
        )
    assert caught.value.param == name
    assert "does not apply to beam search" in caught.value.message


def test_beam_search_takes_neutral_values_and_length_penalty_needs_it() -> None:
    neutral = dict(top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, stop=[], stream=False)
    for request_type, prompt in (
        (CompletionRequest, {"prompt": "Hi"}),
        (ChatCompletionRequest, {"messages": MESSAGES}),
    ):
        refuse_unsupported_fields(
            request_type(**prompt, use_beam_search=True, length_penalty=0.5, **neutral)
        )
        with pytest.raises(OpenAIServingError) as caught:
            refuse_unsupported_fields(request_type(**prompt, length_penalty=0.5))
        assert caught.value.param == "length_penalty"
        assert "only with use_beam_search" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, None),  # tool_calls.py checks tools and tool_choice
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, None),
        ({"functions": [{"name": "f"}]}, "functions"),  # OpenAI's deprecated spelling of tools
        ({"function_call": "auto"}, "function_call"),
        ({"function_call": "none"}, None),
    ],
)
def test_tools_pass_and_the_deprecated_functions_api_is_refused(
    fields: dict[str, object], param: str | None
) -> None:
    request = ChatCompletionRequest(messages=MESSAGES, **fields)
    if param is None:
        refuse_unsupported_fields(request)
        return
    with pytest.raises(OpenAIServingError) as caught:
        refuse_unsupported_fields(request)
    assert caught.value.param == param
    assert "as tools" in caught.value.message


def test_unknown_fields_are_logged_once_each_and_boundedly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unknown = UnknownFields(max_names=3)
    with caplog.at_level(logging.WARNING, logger="kvflow.entrypoints.openai.unsupported"):
        unknown.report({"metadata": 1})
        unknown.report({"metadata": 2, "store": True})
        unknown.report(None)
        unknown.report({"a": 1, "b": 2, "c": 3})
        unknown.report({"d": 4})
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].endswith("['metadata']")
    assert messages[1].endswith("['store']")
    assert messages[2].endswith("['a']")  # the third name fills the bound ...
    assert "further ones are not" in messages[3]  # ... said once, then nothing more
    assert len(messages) == 4
