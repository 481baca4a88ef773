"""Tool calling over HTTP with the official `openai` client, on the built-in model (`kvflow serve
--enable-auto-tool-choice --tool-call-parser hermes`): "required" and named calls whose arguments validate against
the tools' schemas, whole and streamed; "auto" through the hermes parser on a reply forced to hold a `<tool_call>`;
a full round trip with a `tool` message; and the 400s for what cannot be served."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.entrypoints.server import DEFAULT_SERVER, RemoteServer, running_server

MODEL = "default"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time", "parameters": TIME_PARAMETERS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
# A reply the hermes parser must split: text, then one call.
FORCED_CALL = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|London)", "unit": "celsius"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(
        *DEFAULT_SERVER, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    ) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def chat(client: openai.OpenAI, stream: bool, **fields: Any) -> dict[str, Any]:
    """One choice's message as a client assembles it: `content`, `tool_calls` (id, name, arguments) and
    `finish_reason`; a stream's deltas are checked on the way (a call's first delta names it, nothing of a call
    shows in content)."""
    official = {"tools", "tool_choice", "parallel_tool_calls", "max_tokens", "messages"}
    arguments = {"messages": MESSAGES, "max_tokens": 96, **fields}
    extra = {name: arguments.pop(name) for name in list(arguments) if name not in official}
    response = client.chat.completions.create(
        model=MODEL, temperature=0, stream=stream, extra_body=extra or None, **arguments
    )
    if not stream:
        choice = response.choices[0]
        return {
            "content": choice.message.content,
            "tool_calls": [
                {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
                for call in choice.message.tool_calls or []
            ],
            "finish_reason": choice.finish_reason,
        }
    content, calls, finish = "", {}, None
    for chunk in response:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.id.startswith("chatcmpl-tool-"), call
                    assert call.function.name, "a call's first delta has its name"
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {
        "content": content or None,
        "tool_calls": [calls[index] for index in sorted(calls)],
        "finish_reason": finish,
    }


def assert_valid_calls(
    message: dict[str, Any], names: set[str], finish_reasons: tuple[str, ...] = ("tool_calls",)
) -> None:
    assert message["tool_calls"], message
    for call in message["tool_calls"]:
        assert call["name"] in names
        assert call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert message["finish_reason"] in finish_reasons
    assert "<tool_call>" not in (message["content"] or "")


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_validate_against_the_tools_schemas(
    client: openai.OpenAI, stream: bool
) -> None:
    # The toy model may go on adding calls to the array until max_tokens: the calls that closed are kept, and the
    # call cut short comes back as content (nothing generated is lost).
    message = chat(client, stream, tools=TOOLS, tool_choice="required")
    assert_valid_calls(message, set(SCHEMAS), ("tool_calls", "length"))
    if message["finish_reason"] == "tool_calls":
        assert message["content"] is None
    else:
        assert message["content"] is None or message["content"].startswith("{"), message


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_cut_by_max_tokens_comes_back_as_content(
    client: openai.OpenAI, stream: bool
) -> None:
    """5 tokens cannot close a call: no call, finish_reason "length", and what was generated is the content (it
    used to vanish: tool_calls [] and content "")."""
    message = chat(client, stream, tools=TOOLS, tool_choice="required", max_tokens=5)
    assert message["finish_reason"] == "length"
    assert message["tool_calls"] == []
    assert message["content"] and message["content"].startswith("["), message


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_the_one_called(client: openai.OpenAI, stream: bool) -> None:
    message = chat(
        client,
        stream,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert_valid_calls(message, {"get_time"})
    assert len(message["tool_calls"]) == 1


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    message = chat(client, False, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert_valid_calls(message, set(SCHEMAS))
    assert len(message["tool_calls"]) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_call_out_of_the_reply(client: openai.OpenAI, stream: bool) -> None:
    message = chat(
        client, stream, tools=TOOLS, tool_choice="auto", structured_outputs={"regex": FORCED_CALL}
    )
    assert_valid_calls(message, {"get_weather"})
    assert message["content"] == "Let me check.\n"
    # Without tools the same reply is plain content, markup and all.
    plain = chat(client, stream, structured_outputs={"regex": FORCED_CALL})
    assert plain["tool_calls"] == [] and "<tool_call>" in plain["content"]
    assert plain["finish_reason"] == "stop"


def test_a_tool_round_trip_with_the_official_client(
    client: openai.OpenAI, server: RemoteServer
) -> None:
    messages: list[Any] = list(MESSAGES)
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=64,
    )
    call_message = first.choices[0].message
    [call] = call_message.tool_calls or []
    messages.append(call_message)  # the SDK's message object, as agent loops send it back
    result = json.dumps({"temperature": 21, "sky": "clear"})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=16
    )
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls in (None, [])
    assert isinstance(choice.message.content, str) and choice.message.content
    # The template rendered the call and its result the way Qwen2.5's does.
    body = {"model": MODEL, "messages": [_plain(message) for message in messages], "tools": TOOLS}
    tokens = server.post("/tokenize", json=body).json()["tokens"]
    prompt = server.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    arguments = json.loads(call.function.arguments)
    assert (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
        in prompt
    )
    # (/detokenize leaves out the special tokens <|im_start|> and <|im_end|>)
    assert f"\nuser\n<tool_response>\n{result}\n</tool_response>\nassistant\n" in prompt
    assert "<tools>\n" in prompt and '"name": "get_time"' in prompt


def _plain(message: Any) -> dict[str, Any]:
    return message if isinstance(message, dict) else message.model_dump(exclude_none=True)


# ---------------------------------------------------------------------------------------------------- refused
@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "another structured-output constraint",
        ),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", "function tool"),
        ({"functions": [{"name": "f"}]}, "functions", "tools"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, False, **fields)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert words in error["message"]
