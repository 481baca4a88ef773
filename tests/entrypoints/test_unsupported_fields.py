"""`unsupported.py` without a server: every refused field is declared in the protocol models, refusals name the
field, the off values pass, and unknown field names are logged once each, boundedly."""

from __future__ import annotations

import logging

import pytest

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.entrypoints.openai.unsupported import (
    UNSUPPORTED_FIELDS,
    UnknownFields,
    refuse_unsupported_fields,
)

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_every_refused_field_is_declared_so_it_is_typed_and_documented() -> None:
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert {field.name for field in UNSUPPORTED_FIELDS} <= declared


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
