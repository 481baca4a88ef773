"""What each request field does, through the official `openai` client against a real server on the built-in
default model: the server's `--chat-template FILE`, `continue_final_message`, and no silent fields (every field of
OpenAI's or vLLM's schema that kvflow does not implement yet is a 400 naming it unless sent "off"; an unknown field is
ignored and logged once)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvflow.default_model import ensure_default_model
from kvflow.tokenizer import Tokenizer, load_tokenizer, render_chat
from tests.entrypoints.server import DEFAULT_SERVER, RemoteServer, running_server
from tests.test_cli import run_kvflow
from tests.test_cli_errors import assert_one_line_error

MODEL = "default"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a KV cache?"},
]
# The server's own template: ChatML with a marker on every turn, so a prompt shows which template made it.
SERVER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }} (served)\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]

# field -> (a value kvflow refuses until it is implemented, the value that means "off"), per endpoint.
# (Structured outputs and the logits controls are implemented: tests/entrypoints/test_structured_outputs_api.py.)
SHARED_FIELDS: dict[str, tuple[Any, Any]] = {
    "guided_whitespace_pattern": (r"\s*", None),
    "logits_processors": (["my.module:Processor"], None),
}
CHAT_FIELDS: dict[str, tuple[Any, Any]] = {
    **SHARED_FIELDS,
    "functions": ([{"name": "get_weather", "parameters": {}}], None),
    "function_call": ("auto", None),
}
COMPLETION_FIELDS: dict[str, tuple[Any, Any]] = {
    **SHARED_FIELDS,
    "prompt_embeds": ("AAAA", None),
}
CASES = [("chat", field, *values) for field, values in CHAT_FIELDS.items()] + [
    ("completions", field, *values) for field, values in COMPLETION_FIELDS.items()
]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "served.jinja"
    path.write_text(SERVER_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(template_file: Path) -> Iterator[RemoteServer]:
    with running_server(*DEFAULT_SERVER, "--chat-template", str(template_file)) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(ensure_default_model())


def create(client: openai.OpenAI, endpoint: str, **extra_body: Any) -> Any:
    """One short request to `endpoint` ("chat" or "completions") with `extra_body` fields."""
    if endpoint == "chat":
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=extra_body
        )
    return client.completions.create(
        model=MODEL, prompt="Hello, my name is", max_tokens=1, extra_body=extra_body
    )


# ---------------------------------------------------------------------------------------------------- templates
def test_the_servers_chat_template_makes_every_chat_prompt(
    server: RemoteServer, client: openai.OpenAI, tokenizer: Tokenizer, template_file: Path
) -> None:
    expected = render_chat(tokenizer, MESSAGES, chat_template=template_file)
    assert "<|im_start|>user (served)\nWhat is a KV cache?" in expected.prompt_text
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"return_token_ids": True}
    )
    assert response.prompt_token_ids == expected.prompt_token_ids
    tokenized = server.post("/tokenize", json={"messages": MESSAGES}).json()
    assert tokenized["tokens"] == expected.prompt_token_ids
    # A request naming one of the checkpoint's templates would still use its own: none here, and a request's
    # template source is refused without --trust-request-chat-template.
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, "chat", chat_template="{{ 'x' }}")
    assert caught.value.param == "chat_template"


def test_a_chat_template_that_is_neither_a_file_nor_a_template_fails_at_startup(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "missing.jinja"
    result = run_kvflow(
        "serve", *DEFAULT_SERVER, "--port", "0", "--chat-template", str(missing), timeout=180
    )
    assert_one_line_error(result, "missing.jinja' looks like a file path", command="serve")


def test_continue_final_message_continues_the_last_message(
    client: openai.OpenAI, tokenizer: Tokenizer, template_file: Path
) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "A KV cache is"}]
    expected = render_chat(
        tokenizer,
        messages,
        chat_template=template_file,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert expected.prompt_text.endswith("(served)\nA KV cache is")
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "return_token_ids": True,
        },
    )
    assert response.prompt_token_ids == expected.prompt_token_ids
    with pytest.raises(
        openai.BadRequestError
    ) as caught:  # add_generation_prompt is true by default
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            extra_body={"continue_final_message": True},
        )
    assert caught.value.param == "continue_final_message"


# ---------------------------------------------------------------------------------------------------- fields
@pytest.mark.parametrize(
    ("endpoint", "field", "value", "off"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_an_unimplemented_field_is_a_400_naming_it_unless_it_is_off(
    client: openai.OpenAI, endpoint: str, field: str, value: Any, off: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, endpoint, **{field: value})
    assert caught.value.status_code == 400
    assert caught.value.param == field
    assert "not supported by kvflow yet" in caught.value.message
    served = create(client, endpoint, **{field: off})
    assert served.choices and served.usage.completion_tokens == 1


def test_tools_without_tool_choice_mean_auto_a_400_naming_both_flags_and_with_none_reach_the_template(
    client: openai.OpenAI,
) -> None:
    """vLLM's rule: tools without tool_choice mean "auto", which needs --enable-auto-tool-choice and
    --tool-call-parser (this server has neither)."""
    for fields in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=1, tools=TOOLS, **fields
            )
        assert caught.value.param == "tool_choice"
        assert "--enable-auto-tool-choice and --tool-call-parser" in caught.value.message
    served = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, tools=TOOLS, tool_choice="none"
    )
    assert served.choices[0].message.role == "assistant"
    # A named function needs no parser: the reply is constrained to its (empty) parameters.
    forced = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = forced.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments), dict
    )


def test_an_empty_conversation_is_a_400_naming_messages(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    assert caught.value.param == "messages"
    assert "must not be empty" in caught.value.message


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_unknown_field_is_ignored_and_logged_once(
    server: RemoteServer, client: openai.OpenAI, endpoint: str
) -> None:
    name = f"kvflow_test_unknown_{endpoint}"
    for _ in range(3):
        assert create(client, endpoint, **{name: {"any": "value"}}).usage.completion_tokens == 1
    assert server.log.count(name) == 1
