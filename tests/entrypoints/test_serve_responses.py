"""POST /v1/responses (OpenAI's Responses API) with the official `openai` client, on the built-in model: one server
with vLLM's tool and reasoning flags (`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser
qwen3`, constraints applied in the reasoning too, so a regex can force a thought) and the admin endpoints (a pause
holds a background response in progress while it is cancelled).

Prompts are checked exactly: a response's `usage.input_tokens` equals /tokenize's count of the chat conversation it
stands for (instructions as a system message, a previous response's exchange before the new input, function calls
and their outputs as `tool_calls` and `tool` messages). Greedy replies are compared whole against streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvflow.entrypoints.openai.protocol import ChatMessage, FunctionCall, ToolCall
from kvflow.entrypoints.openai.response_store import ResponseStore, StoredResponse
from kvflow.entrypoints.openai.responses_items import input_messages, output_items, output_messages
from kvflow.testing.waiting import wait_until
from tests.entrypoints.server import DEFAULT_SERVER, RemoteServer, running_server

MODEL = "default"
QUESTION = "Is Paris in France?"
THOUGHT_REPLY = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,4}\n</think>\n\n(Yes|No), [a-z]{2,8}\."
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER}
]
USER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
JSON_FORMAT: Any = {"format": {"type": "json_schema", "name": "user", "schema": USER_SCHEMA}}


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(
        *DEFAULT_SERVER,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--structured-outputs-config",
        json.dumps({"enable_in_reasoning": True}),
        "--enable-admin-endpoints",
    ) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.responses.create(
        model=MODEL, temperature=0, **{"max_output_tokens": 12, **fields}
    )


def prompt_tokens(server: RemoteServer, messages: list[Any], tools: Any = None) -> int:
    body = {"model": MODEL, "messages": messages, "tools": tools}
    return server.post("/tokenize", json=body).json()["count"]


def chat_tools(tools: list[Any]) -> list[Any]:
    return [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in tools
    ]


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[list[Any], Any]:
    """The raw events of a streamed response and the response its last event carries; checks the sequence
    numbers and that every item's events sit between its added and done events."""
    events = list(
        client.responses.create(
            model=MODEL, temperature=0, stream=True, **{"max_output_tokens": 12, **fields}
        )
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    open_index = None
    for event in events[2:-1]:
        if event.type == "response.output_item.added":
            assert open_index is None, "one item at a time"
            open_index = event.output_index
        elif event.type == "response.output_item.done":
            assert event.output_index == open_index
            open_index = None
        else:
            assert event.output_index == open_index, event
    assert open_index is None
    return events, events[-1].response


# ---------------------------------------------------------------------------------------------------- text
def test_string_input_and_instructions(client: openai.OpenAI, server: RemoteServer) -> None:
    response = create(client, input=QUESTION, instructions="Answer in French.")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.output[0].type == "message"
    usage = response.usage
    assert usage.output_tokens == 12 and usage.output_tokens_details.reasoning_tokens == 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens == prompt_tokens(
        server,
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": QUESTION}],
    )
    assert response.temperature == 0 and response.max_output_tokens == 12


def test_message_items_render_as_the_string_does(client: openai.OpenAI) -> None:
    plain = create(client, input=QUESTION)
    items = create(
        client,
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": QUESTION}],
            }
        ],
    )
    assert (items.output_text, items.usage.input_tokens) == (
        plain.output_text,
        plain.usage.input_tokens,
    )


def test_stream_events_in_order_and_text_as_whole(client: openai.OpenAI) -> None:
    whole = create(client, input=QUESTION)
    events, final = streamed(client, input=QUESTION)
    types = [event.type for event in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-4].text == final.output_text == whole.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == 12
    # A streamed response is stored by the time its last event is read.
    assert create(client, input="More.", previous_response_id=final.id).status == "incomplete"


def test_stream_helper_and_json_schema_format(client: openai.OpenAI) -> None:
    response = create(client, input="Invent a user.", text=JSON_FORMAT, max_output_tokens=64)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), USER_SCHEMA)
    assert response.text.format.type == "json_schema"
    with client.responses.stream(
        model=MODEL,
        input="Invent a user.",
        text=JSON_FORMAT,
        max_output_tokens=64,
        temperature=0,
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == response.output_text
    json_object = create(
        client,
        input="Invent a user.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=64,
    )
    assert json_object.status == "completed"
    assert isinstance(json.loads(json_object.output_text), dict)


# ---------------------------------------------------------------------------------------------------- store
def test_previous_response_id_prepends_the_exchange(
    client: openai.OpenAI, server: RemoteServer
) -> None:
    first = create(client, input=QUESTION, instructions="Answer in French.")
    second = create(client, input="And Rome?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    conversation = [
        {"role": "user", "content": QUESTION},  # the instructions are not carried over
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And Rome?"},
    ]
    assert second.usage.input_tokens == prompt_tokens(server, conversation)
    third = create(client, input="And Berlin?", previous_response_id=second.id)
    conversation += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And Berlin?"},
    ]
    assert third.usage.input_tokens == prompt_tokens(server, conversation)


def test_retrieve_delete_and_store_false(client: openai.OpenAI) -> None:
    stored = create(client, input=QUESTION, metadata={"run": "7"})
    again = client.responses.retrieve(stored.id)
    assert (again.id, again.output_text, again.status, again.metadata) == (
        stored.id,
        stored.output_text,
        "incomplete",
        {"run": "7"},
    )
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    unstored = create(client, input=QUESTION, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.retrieve(unstored.id)
    assert unstored.id in error.value.body["message"]
    with pytest.raises(openai.NotFoundError) as error:
        create(client, input="More.", previous_response_id=unstored.id)
    assert error.value.body["param"] == "previous_response_id"


def test_input_items_are_listed_by_page(client: openai.OpenAI, server: RemoteServer) -> None:
    items: list[Any] = [
        {"role": "user", "content": "Hi"},
        {"id": "msg_mine", "type": "message", "role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    response = create(client, input=items)
    listed = list(client.responses.input_items.list(response.id, limit=1))  # three pages
    assert [item.type for item in listed] == ["message"] * 3
    assert [item.role for item in listed] == ["user", "assistant", "user"][::-1]  # newest first
    assert listed[1].id == "msg_mine" and listed[2].content[0].text == "Hi"
    ascending = client.responses.input_items.list(response.id, order="asc")
    assert [item.id for item in ascending.data] == [item.id for item in reversed(listed)]
    assert server.get(f"/v1/responses/{response.id}/input_items?limit=0").status_code == 400


def test_unknown_id_is_a_404_in_openai_shape(server: RemoteServer) -> None:
    for method, path in [
        ("GET", "/v1/responses/resp_nope"),
        ("POST", "/v1/responses/resp_nope/cancel"),
    ]:
        answer = server.http().request(method, path)
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["type"] == "NotFoundError" and error["code"] == 404
        assert "resp_nope" in error["message"]


def test_store_keeps_the_most_recently_used() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name, "status": "completed"}))
    store.get("a")  # now b is the least recently used
    store.put("c", StoredResponse({"id": "c", "status": "completed"}))
    assert "a" in store and "c" in store and "b" not in store
    with pytest.raises(Exception, match="'b' not found"):
        store.get("b")
    store.put("d", StoredResponse({"id": "d", "status": "in_progress"}))  # running: never evicted
    store.put("e", StoredResponse({"id": "e", "status": "completed"}))
    assert "d" in store and "e" in store and len(store) == 2


# ---------------------------------------------------------------------------------------------------- tools
def test_required_call_and_its_output_round_trip(
    client: openai.OpenAI, server: RemoteServer
) -> None:
    # "required" constrains the reply to an array of calls; the toy model may go on adding calls until
    # max_output_tokens (status incomplete): the calls that closed are kept.
    required = create(
        client,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=64,
    )
    calls = [item for item in required.output if item.type == "function_call"]
    assert calls and required.status in ("completed", "incomplete")
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    response = create(
        client,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=48,
    )
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow_up = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'},
    ]
    final = create(client, input=follow_up, tools=TOOLS, tool_choice="none")
    assert final.output[0].type == "message"
    function = {"name": call.name, "arguments": call.arguments}
    messages = [
        follow_up[0],
        {
            "role": "assistant",
            "tool_calls": [{"id": call.call_id, "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "clear"}'},
    ]
    assert final.usage.input_tokens == prompt_tokens(server, messages, chat_tools(TOOLS))
    # The same call continued through previous_response_id renders the same prompt.
    continued = create(
        client,
        input=follow_up[2:],
        previous_response_id=response.id,
        tools=TOOLS,
        tool_choice="none",
    )
    assert continued.usage.input_tokens == final.usage.input_tokens


def test_named_call_streams_its_arguments(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(
        input="Weather?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=48,
    )
    whole = create(client, **fields)
    events, final = streamed(client, **fields)
    types = [event.type for event in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [
        event.delta for event in events if event.type == "response.function_call_arguments.delta"
    ]
    [call] = final.output
    assert "".join(deltas) == events[-3].arguments == call.arguments == whole.output[0].arguments
    assert events[2].item.call_id == call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


# ---------------------------------------------------------------------------------------------------- reasoning
def test_reasoning_items_whole_and_streamed(client: openai.OpenAI, server: RemoteServer) -> None:
    forced = {"structured_outputs": {"regex": THOUGHT_REPLY}}
    response = create(client, input=QUESTION, max_output_tokens=64, extra_body=forced)
    assert response.status == "completed"
    reasoning, message = response.output
    assert message.type == "message"
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    thought = reasoning.content[0].text
    assert thought and "<think>" not in thought and "</think>" not in response.output_text
    details = response.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < response.usage.output_tokens
    events, final = streamed(client, input=QUESTION, max_output_tokens=64, extra_body=forced)
    types = [event.type for event in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    reasoning_deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(reasoning_deltas) == thought == final.output[0].content[0].text
    assert final.output_text == response.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    # A reasoning item passed back is taken, as the assistant message's reasoning.
    passed_back = [
        {"role": "user", "content": QUESTION},
        reasoning.model_dump(exclude_none=True),
        {"role": "assistant", "content": response.output_text},
        {"role": "user", "content": "Why?"},
    ]
    # What a stateless client (store false, encrypted reasoning asked for) sends back.
    again = create(client, input=passed_back, store=False, include=["reasoning.encrypted_content"])
    assert again.status == "incomplete"


# ---------------------------------------------------------------------------------------------------- background
def test_background_runs_on_and_cancels(client: openai.OpenAI, server: RemoteServer) -> None:
    done = create(client, input=QUESTION, background=True)
    assert done.status in ("queued", "in_progress") and done.background
    wait_until(
        lambda: client.responses.retrieve(done.id).status == "incomplete",
        "the background response finished",
    )
    assert client.responses.retrieve(done.id).output_text
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)  # already finished
    assert server.post("/pause?mode=keep").status_code == 200
    try:
        held = create(client, input=QUESTION, background=True)
        assert client.responses.retrieve(held.id).status in ("queued", "in_progress")
        assert client.responses.cancel(held.id).status == "cancelled"
        assert client.responses.cancel(held.id).status == "cancelled"  # idempotent
    finally:
        assert server.post("/resume").status_code == 200
    assert client.responses.retrieve(held.id).status == "cancelled"
    plain = create(client, input=QUESTION)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(plain.id)


# ---------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"background": True, "store": False}, "background"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_bad_fields_are_400s_naming_them(
    server: RemoteServer, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": QUESTION, **fields}
    answer = server.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def test_response_ids_abort_like_request_ids(server: RemoteServer) -> None:
    """A response's id names its live request for /abort_requests (held by a pause, so it is surely still
    running); the stream ends as cancelled."""
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 900, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream(
            "POST", "/v1/responses", json=body, headers={"X-Request-Id": "abort-me"}
        ) as stream,
    ):
        lines = stream.iter_lines()
        assert next(line for line in lines if "output_text.delta" in line)
        assert server.post("/pause?mode=keep").status_code == 200
        try:
            answer = server.post("/abort_requests", json={"request_ids": ["resp_abort-me"]})
            assert answer.json()["aborted"] == ["resp_abort-me"]
        finally:
            assert server.post("/resume").status_code == 200
        last = [line for line in lines if line.startswith("data: ")][-1]
    final = json.loads(last.removeprefix("data: "))
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "cancelled"


# ---------------------------------------------------------------------------------------------------- items
def test_input_items_become_chat_messages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    messages = input_messages(
        [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            {
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}],
            },
            call,
            {**call, "call_id": "c2"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
        ]
    )
    assert [message["role"] for message in messages] == ["system", "user", "assistant", "tool"]
    assistant = messages[2]
    assert assistant["reasoning_content"] == "hm" and assistant["content"] == [
        {"type": "text", "text": "Let me see."}
    ]
    assert [tool_call["id"] for tool_call in assistant["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "1"}
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_output_items_round_trip_to_the_assistant_message() -> None:
    message = ChatMessage(
        role="assistant",
        content="Sure.",
        reasoning="hm",
        tool_calls=[ToolCall(id="c1", function=FunctionCall(name="f", arguments="{}"))],
    )
    items = output_items(message, "incomplete")
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert [item["status"] for item in items] == ["completed", "completed", "incomplete"]
    [assistant] = output_messages(items)
    assert assistant["reasoning"] == "hm" and assistant["tool_calls"][0]["id"] == "c1"
    cut_in_thought = output_items(ChatMessage(role="assistant", reasoning="hm"), "incomplete")
    [assistant] = output_messages(cut_in_thought)
    assert assistant["reasoning"] == "hm" and assistant["content"] == [{"type": "text", "text": ""}]
