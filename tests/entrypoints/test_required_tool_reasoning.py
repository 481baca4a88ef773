"""`tool_choice: "required"` (and a named function) under `--reasoning-parser qwen3`, with and without speculative
decoding (a draft model), streamed and not, with the official `openai` client (issue 44).

The model is a tiny Qwen3-style checkpoint whose template opens the thought (`<think>\\n`, as Qwen3-Thinking's
does), so the forced call's constraint starts after `</think>`: the model thinks first, then must call; with
`open_thought: false` the prompt does not open it (Qwen3's own template) and the constraint lets the model open
a thought before the call. A `logit_bias` on the `</think>` token makes the random model close its thought after
a few words. Without it the
thought runs to max_tokens: the reply then says so (`unmet_tool_choice`, finish_reason "length", the thought as
reasoning) instead of coming back as empty content chunks, which is what the issue saw. Speculative decoding
changes nothing in either case: streamed and unstreamed replies agree on every server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvflow.entrypoints.openai.chat_reply import ReplyParser
from kvflow.entrypoints.openai.tool_calls import RequiredToolCallsParser
from kvflow.reasoning import REASONING_PARSERS
from kvflow.testing.qwen3_style import QWEN3_STYLE_IDS, make_qwen3_style_checkpoint
from tests.entrypoints.server import DEFAULT_SERVER, RemoteServer, running_server
from tests.entrypoints.test_tool_calling_api import TOOLS

MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
CLOSE_THOUGHT_SOON = {str(QWEN3_STYLE_IDS["</think>"]): 6.0}
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_style_checkpoint(tmp_path_factory.mktemp("qwen3_style") / "model")


@pytest.fixture(scope="module", params=["reasoning", "reasoning+draft"])
def client(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[openai.OpenAI]:
    options = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    options += ["--reasoning-parser", "qwen3"]
    if request.param == "reasoning+draft":
        draft = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3}
        options += ["--speculative-config", json.dumps(draft)]
    server: RemoteServer
    with running_server(str(checkpoint), *DEFAULT_SERVER, *options) as server:
        yield server.client()


def reply(client: openai.OpenAI, stream: bool, **fields: Any) -> dict[str, Any]:
    """One choice as a client assembles it: reasoning, content, calls (name, arguments), finish_reason and the
    choice's `unmet_tool_choice`."""
    [model] = client.models.list().data
    response = client.chat.completions.create(
        model=model.id, messages=MESSAGES, tools=TOOLS, temperature=0, stream=stream, **fields
    )
    if not stream:
        choice = response.choices[0]
        extras = choice.message.model_extra or {}
        return {
            "reasoning": extras.get("reasoning"),
            "content": choice.message.content or None,
            "calls": [
                (call.function.name, call.function.arguments)
                for call in choice.message.tool_calls or []
            ],
            "finish_reason": choice.finish_reason,
            "unmet_tool_choice": (choice.model_extra or {}).get("unmet_tool_choice"),
        }
    reasoning, content, calls, finish, unmet = "", "", {}, None, None
    for chunk in response:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                name, arguments = calls.get(call.index, (call.function.name, ""))
                calls[call.index] = (name, arguments + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
            unmet = (choice.model_extra or {}).get("unmet_tool_choice") or unmet
    return {
        "reasoning": reasoning or None,
        "content": content or None,
        "calls": [calls[index] for index in sorted(calls)],
        "finish_reason": finish,
        "unmet_tool_choice": unmet,
    }


@pytest.mark.parametrize(
    "template_kwargs",
    [{}, {"open_thought": False}],
    ids=["the-prompt-opens-the-thought", "the-model-opens-it"],
)
def test_the_model_thinks_then_the_call_is_forced_streamed_as_unstreamed(
    client: openai.OpenAI, template_kwargs: dict[str, Any]
) -> None:
    """Where the prompt opens the thought, the call's constraint starts after `</think>`; where the model must
    open it itself (Qwen3's own template), the constraint lets an optional thought come first (it used to force
    the call's JSON from the first token: no thought at all)."""
    fields = {
        "tool_choice": "required",
        "parallel_tool_calls": False,  # one call, then the reply ends
        "max_tokens": 400,
        "logit_bias": CLOSE_THOUGHT_SOON,
        "extra_body": {"chat_template_kwargs": template_kwargs},
    }
    whole = reply(client, False, **fields)
    assert whole["reasoning"], whole  # it thought first
    assert len(whole["calls"]) == 1 and whole["finish_reason"] == "tool_calls", whole  # then called
    [(name, arguments)] = whole["calls"]
    assert name in {"get_weather", "get_time"}
    json.loads(arguments)
    assert whole["content"] is None and whole["unmet_tool_choice"] is None
    assert reply(client, True, **fields) == whole


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_thought_cut_by_max_tokens_says_why_no_call_came(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    whole = reply(client, False, tool_choice=tool_choice, max_tokens=24)
    assert whole["finish_reason"] == "length" and whole["calls"] == [], whole
    assert whole["reasoning"] and whole["content"] is None  # the thought is there, as reasoning
    explanation = whole["unmet_tool_choice"]
    assert explanation and "max_tokens" in explanation and "</think>" in explanation, whole
    assert ("'required'" if tool_choice == "required" else "function 'get_time'") in explanation
    assert reply(client, True, tool_choice=tool_choice, max_tokens=24) == whole


@pytest.mark.parametrize(
    ("text", "finish", "explains"),
    [
        ("a long thought, cut", "length", "inside its reasoning, before </think>"),
        ("a thought</think>\n\n[", "length", "before a call was complete"),
        ('a thought</think>\n\n[{"name": "get_time", "parameters": {}}]', "stop", None),
        ("a thought that stopped", "stop", "stopped (stop) inside its reasoning"),
    ],
)
def test_the_explanation_is_the_same_whole_and_streamed(
    text: str, finish: str, explains: str | None
) -> None:
    parser = ReplyParser(
        REASONING_PARSERS.get("qwen3")(),
        True,
        RequiredToolCallsParser({"get_time"}),
        forced_call="'required'",
    )
    made_calls = bool(parser.parse(text).tool_calls)
    whole = parser.unmet_tool_choice(text, made_calls, finish)
    assert (whole is None) if explains is None else (explains in (whole or "")), whole
    for cut in range(len(text) + 1):
        stream = parser.stream()
        stream.push(text[:cut])
        stream.push(text[cut:])
        stream.finish()
        assert stream.unmet_tool_choice(finish) == whole
