"""Reasoning output over HTTP with the official `openai` client (`kvflow serve --reasoning-parser qwen3`): the text
between `<think>` and `</think>` is `message.reasoning` (and `reasoning_content`), the rest `content`, whole and
streamed (reasoning deltas first); `chat_template_kwargs` reach the template (Qwen3's `enable_thinking`).

The server constrains the reasoning too (`enable_in_reasoning`), so a regex can force a reply with a thought in
it on the built-in model; the rule that a constraint otherwise starts after the reasoning has its own tests
(tests/structured_output/test_reasoning_end.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kvflow.default_model import CHAT_TEMPLATE
from tests.entrypoints.server import DEFAULT_SERVER, RemoteServer, running_server

MODEL = "default"
MESSAGES: list[Any] = [{"role": "user", "content": "Is Paris in France?"}]
# The built-in template, with Qwen3's generation prompt: enable_thinking=false closes an empty thought.
QWEN3_STYLE_TEMPLATE = CHAT_TEMPLATE.replace(
    "    {{- '<|im_start|>assistant\\n' }}\n",
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n",
)
THOUGHT_REPLY = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,4}\n</think>\n\n(Yes|No), [a-z]{2,8}\."
ANSWER_ONLY = r"(Yes|No), [a-z]{2,8}\."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    assert QWEN3_STYLE_TEMPLATE != CHAT_TEMPLATE
    template = tmp_path_factory.mktemp("templates") / "qwen3_style.jinja"
    template.write_text(QWEN3_STYLE_TEMPLATE)
    with running_server(
        *DEFAULT_SERVER,
        "--reasoning-parser",
        "qwen3",
        "--structured-outputs-config",
        json.dumps({"enable_in_reasoning": True}),
        "--chat-template",
        str(template),
    ) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def reply(client: openai.OpenAI, stream: bool, regex: str, **extra: Any) -> dict[str, Any]:
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=64,
        stream=stream,
        extra_body={"structured_outputs": {"regex": regex}, **extra},
    )
    if not stream:
        message = response.choices[0].message
        extras = message.model_extra or {}
        assert extras.get("reasoning_content") == extras.get("reasoning")
        return {
            "reasoning": extras.get("reasoning"),
            "content": message.content,
            "finish_reason": response.choices[0].finish_reason,
        }
    reasoning, content, order = "", "", []
    finish = None
    for chunk in response:
        for choice in chunk.choices:
            delta = choice.delta.model_extra or {}
            if delta.get("reasoning"):
                assert delta.get("reasoning_content") == delta["reasoning"]
                reasoning += delta["reasoning"]
                order.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                order.append("content")
            finish = choice.finish_reason or finish
    assert order == sorted(order, key=["reasoning", "content"].index), "reasoning comes first"
    return {"reasoning": reasoning or None, "content": content or None, "finish_reason": finish}


@pytest.mark.parametrize("stream", [False, True])
def test_a_thought_is_split_from_the_answer(client: openai.OpenAI, stream: bool) -> None:
    message = reply(client, stream, THOUGHT_REPLY)
    assert message["finish_reason"] == "stop"
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,4}", message["reasoning"] or ""), message
    assert re.fullmatch(r"(Yes|No), [a-z]{2,8}\.", message["content"] or ""), message
    # The same request without the parser's markers is all content.
    plain = reply(client, stream, ANSWER_ONLY)
    assert plain["reasoning"] is None and re.fullmatch(ANSWER_ONLY, plain["content"] or "")


def test_streamed_and_whole_replies_agree(client: openai.OpenAI) -> None:
    assert reply(client, True, THOUGHT_REPLY) == reply(client, False, THOUGHT_REPLY)


def test_include_reasoning_false_drops_the_thought(client: openai.OpenAI) -> None:
    message = reply(client, False, THOUGHT_REPLY, include_reasoning=False)
    assert message["reasoning"] is None
    assert re.fullmatch(r"(Yes|No), [a-z]{2,8}\.", message["content"] or "")


def test_enable_thinking_reaches_the_template(server: RemoteServer) -> None:
    def prompt(**kwargs: Any) -> str:
        body = {"model": MODEL, "messages": MESSAGES, **kwargs}
        tokens = server.post("/tokenize", json=body).json()["tokens"]
        return server.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]

    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith(
        "assistant\n<think>\n\n</think>\n\n"
    )
    assert prompt().endswith("assistant\n")


def test_a_prompt_that_closed_the_thought_leaves_the_reply_all_content(
    client: openai.OpenAI,
) -> None:
    """With `enable_thinking: false` the prompt ends the (empty) thought: whatever the reply holds is content."""
    message = reply(
        client,
        False,
        r"[a-z]{2,8} </think> (Yes|No)\.",
        chat_template_kwargs={"enable_thinking": False},
    )
    assert message["reasoning"] is None
    assert "</think>" in (message["content"] or "")


def test_the_parser_path_also_serves_completions_untouched(client: openai.OpenAI) -> None:
    """/v1/completions has no reasoning split: the forced thought is its text, markers and all."""
    text = (
        client.completions.create(
            model=MODEL,
            prompt="Q: Is Paris in France?\nA:",
            temperature=0,
            max_tokens=64,
            extra_body={"structured_outputs": {"regex": THOUGHT_REPLY}},
        )
        .choices[0]
        .text
    )
    assert text.startswith("<think>\n") and "</think>" in text
