"""What each request field does, through the official `openai` client against a real server on the built-in
default model: the server's `--chat-template FILE` and `continue_final_message`."""

from __future__ import annotations

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
