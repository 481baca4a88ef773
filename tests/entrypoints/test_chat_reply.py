"""The reply parser of /v1/chat/completions (`chat_reply.py`, `tool_calls.py`): a reply split into reasoning, content
and tool calls is the same whole and streamed, at every split of the text; forced calls ("required", named) parse
the constrained JSON; tool_choice resolution refuses what vLLM refuses, naming the field."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvflow.entrypoints.openai.chat_reply import ReplyDelta, ReplyParser, finish_reason
from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.tool_calls import (
    AUTO,
    NAMED,
    NONE,
    REQUIRED,
    NamedToolCallParser,
    RequiredToolCallsParser,
    resolve_tool_choice,
)
from kvflow.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kvflow.reasoning import REASONING_PARSERS

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def streamed(parser: ReplyParser, pieces: list[str]) -> dict[str, Any]:
    """The reply as a client assembles it from the stream's deltas."""
    stream = parser.stream()
    deltas = [stream.push(piece) for piece in pieces]
    total = ReplyDelta()
    for delta in [*deltas, stream.finish()]:
        total = total.merge(delta)
    calls: dict[int, dict[str, str]] = {}
    for call in total.tool_calls:
        if call.index not in calls:
            assert call.id is not None and call.name is not None, "a call's first piece names it"
            calls[call.index] = {"name": call.name, "arguments": ""}
        else:
            assert call.id is None and call.name is None
        calls[call.index]["arguments"] += call.arguments
    return {
        "reasoning": total.reasoning or None,
        "content": total.content or None,
        "calls": [calls[index] for index in sorted(calls)],
        "made_calls": stream.made_calls,
    }


def whole(parser: ReplyParser, text: str) -> dict[str, Any]:
    message = parser.parse(text)
    assert message.reasoning == message.reasoning_content
    return {
        "reasoning": message.reasoning,
        "content": message.content or None,
        "calls": [
            {"name": call.function.name, "arguments": call.function.arguments}
            for call in message.tool_calls
        ],
    }


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """Every split into two pieces, one character at a time, and a few random multi-piece splits."""
    result = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
    result.append(list(text))
    rng = random.Random(seed)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, max(len(text) - 1, 0))))
        result.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return result


def check_stream_equals_whole(parser: ReplyParser, text: str) -> dict[str, Any]:
    expected = whole(parser, text)
    for pieces in splits(text):
        got = streamed(parser, pieces)
        assert got["made_calls"] == bool(expected["calls"])
        del got["made_calls"]
        assert got == expected, pieces
    return expected


HERMES_REPLY = (
    "<think>\nThe user wants weather.\n</think>\n\nLet me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_reasoning_then_hermes_calls_split_the_same_whole_and_streamed() -> None:
    parser = ReplyParser(
        REASONING_PARSERS.get("qwen3")(),
        starts_in_reasoning=False,
        tools=TOOL_PARSERS.get("hermes")(None),
    )
    expected = check_stream_equals_whole(parser, HERMES_REPLY)
    assert expected == {
        "reasoning": "The user wants weather.",
        "content": "Let me look.\n\n",  # the text between the calls too, verbatim
        "calls": [
            {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            {"name": "get_time", "arguments": "{}"},
        ],
    }


def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    parser = ReplyParser(None, False, TOOL_PARSERS.get("hermes")(None), parallel=False)
    expected = check_stream_equals_whole(parser, HERMES_REPLY)
    assert [call["name"] for call in expected["calls"]] == ["get_weather"]
    assert "<tool_call>" not in (expected["content"] or "")


def test_include_reasoning_false_drops_the_reasoning_only() -> None:
    parser = ReplyParser(
        REASONING_PARSERS.get("deepseek_r1")(), True, None, include_reasoning=False
    )
    message = parser.parse("thinking hard</think>The answer.")
    assert (message.reasoning, message.content) == (None, "The answer.")
    delta = parser.stream().push("thinking</think>ok")
    assert delta.message(include_reasoning=False).model_dump(exclude_unset=True) == {
        "content": "ok"
    }


def test_required_calls_parse_each_closed_element_whole_and_streamed() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"city": "a \\"}\\" b"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    parser = ReplyParser(None, False, RequiredToolCallsParser({"get_weather", "get_time"}))
    expected = check_stream_equals_whole(parser, text)
    assert expected["calls"] == [
        {"name": "get_weather", "arguments": json.dumps({"city": 'a "}" b'})},
        {"name": "get_time", "arguments": "{}"},
    ]
    assert expected["content"] is None
    # Cut short (finish_reason "length"): the closed calls stay, the open one is dropped, on both paths.
    truncated = check_stream_equals_whole(parser, text[: text.index("get_time") + 12])
    assert [call["name"] for call in truncated["calls"]] == ["get_weather"]


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    parser = ReplyParser(None, False, NamedToolCallParser("get_weather"))
    expected = check_stream_equals_whole(parser, '{"city": "Paris"}')
    assert expected["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    stream = parser.stream()
    first, second = stream.push('{"city"'), stream.push(': "Paris"}')
    assert first.tool_calls[0].name == "get_weather" and first.tool_calls[0].arguments == '{"city"'
    assert second.tool_calls[0].id is None and second.tool_calls[0].arguments == ': "Paris"}'
    assert whole(parser, "")["calls"] == []


def test_finish_reason_is_tool_calls_only_for_a_reply_that_ended_by_itself() -> None:
    assert finish_reason("stop", made_calls=True) == "tool_calls"
    assert finish_reason("length", made_calls=True) == "length"
    assert finish_reason("stop", made_calls=False) == "stop"


# ---------------------------------------------------------------------------------------------------- tool_choice
def test_tool_choice_defaults_and_modes() -> None:
    assert resolve_tool_choice(None, None, None, auto_enabled=False).mode == NONE
    assert resolve_tool_choice([WEATHER], "none", None, auto_enabled=False).mode == NONE
    assert resolve_tool_choice([WEATHER], None, None, auto_enabled=True).mode == AUTO
    required = resolve_tool_choice([WEATHER, TIME], "required", False, auto_enabled=False)
    assert (required.mode, required.parallel) == (REQUIRED, False)
    named = resolve_tool_choice(
        [WEATHER, TIME],
        {"type": "function", "function": {"name": "get_time"}},
        None,
        auto_enabled=False,
    )
    assert (named.mode, named.function_name) == (NAMED, "get_time")


def test_forced_calls_build_json_schema_constraints() -> None:
    required = resolve_tool_choice([WEATHER, TIME], "required", False, auto_enabled=False)
    constraint = required.constraint()
    assert constraint is not None and isinstance(constraint.json, dict)
    schema = constraint.json
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    options = schema["items"]["anyOf"]
    assert [option["properties"]["name"]["enum"] for option in options] == [
        ["get_weather"],
        ["get_time"],
    ]
    assert options[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    # A tool without parameters takes none.
    assert options[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    named = resolve_tool_choice(
        [WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, False
    )
    assert named.constraint().json == WEATHER["function"]["parameters"]  # type: ignore[union-attr]
    assert resolve_tool_choice([WEATHER], "auto", None, True).constraint() is None


@pytest.mark.parametrize(
    ("tools", "tool_choice", "auto_enabled", "param", "words"),
    [
        ([WEATHER], "auto", False, "tool_choice", "--enable-auto-tool-choice"),
        ([WEATHER], None, False, "tool_choice", "--tool-call-parser"),
        (None, "required", True, "tool_choice", "needs tools"),
        ([WEATHER], "sometimes", True, "tool_choice", "must be 'none', 'auto', 'required'"),
        (
            [WEATHER],
            {"type": "function", "function": {"name": "nope"}},
            True,
            "tool_choice",
            "not among the tools",
        ),
        ([{"type": "retrieval"}], "required", True, "tools", "must be a function tool"),
        ([{"type": "function", "function": {}}], "required", True, "tools", "needs a 'name'"),
        ([WEATHER, WEATHER], "required", True, "tools", "more than once"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            "required",
            True,
            "tools",
            "JSON schema object",
        ),
    ],
)
def test_bad_tool_choices_are_400s_naming_the_field(
    tools: Any, tool_choice: Any, auto_enabled: bool, param: str, words: str
) -> None:
    with pytest.raises(OpenAIServingError) as error:
        resolve_tool_choice(tools, tool_choice, None, auto_enabled)
    assert error.value.param == param
    assert words in str(error.value)


def test_parameters_without_a_type_still_make_arguments_an_object() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    named = resolve_tool_choice(
        [tool], {"type": "function", "function": {"name": "f"}}, None, False
    )
    assert named.constraint().json == {"type": "object", "properties": {}}  # type: ignore[union-attr]
