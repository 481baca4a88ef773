"""The one chat renderer (`kvflow.tokenizer.chat`): chat_template as a file, text or name (vLLM's rule),
chat_template_kwargs, continue_final_message (checked against transformers), content parts, tool messages, and
errors that name the argument at fault."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.default_model import BOS_TOKEN, CHAT_TEMPLATE, END_OF_TEXT_TOKEN, IM_END_TOKEN
from kvflow.default_model.random_weights import build_random_model, build_tokenizer
from kvflow.tokenizer import (
    ChatInputError,
    ChatTemplateError,
    RenderedChat,
    Tokenizer,
    load_chat_template,
    load_tokenizer,
    prepare_chat,
    render_chat,
)

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
]
# Shows what a template sees: each message's role, content and extra keys, then the flags.
ECHO_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}|{{ m.content }}"
    "{% if m.tool_calls %}|calls={{ m.tool_calls | tojson }}{% endif %}"
    "{% if m.tool_call_id %}|id={{ m.tool_call_id }}{% endif %}"
    "{% if m.name %}|name={{ m.name }}{% endif %}]{% endfor %}"
    "{% if tools %}tools={{ tools | length }}{% endif %}"
    "{% if add_generation_prompt %}<gen>{% endif %}{{ flavour | default('') }}"
)
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("random") / "model"
    build_random_model(folder)
    return load_tokenizer(folder)


# ---------------------------------------------------------------------------------------------------- templates
def test_rendered_chat_is_the_template_text_encoded_without_special_tokens(
    tokenizer: Tokenizer,
) -> None:
    rendered = render_chat(tokenizer, MESSAGES)
    assert rendered.prompt_text == (
        f"{BOS_TOKEN}<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered.prompt_token_ids == tokenizer.encode(
        rendered.prompt_text, add_special_tokens=False
    )
    assert rendered.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    assert rendered.as_prompt() == {
        "prompt": rendered.prompt_text,
        "prompt_token_ids": rendered.prompt_token_ids,
    }
    assert tokenizer.encode_chat(MESSAGES) == rendered.prompt_token_ids
    assert tokenizer.apply_chat_template(MESSAGES) == rendered.prompt_text


def test_chat_template_file_text_and_name(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """vLLM's rule: an existing file is read (as a str or a Path), text with '{', '}' or a newline is the
    template itself, and so is one of the checkpoint's named templates."""
    template_file = tmp_path / "real.jinja"
    template_file.write_text(ECHO_TEMPLATE)
    expected = "[system|You are terse.][user|Hi!]<gen>"
    assert (
        render_chat(tokenizer, MESSAGES, chat_template=str(template_file)).prompt_text == expected
    )
    assert render_chat(tokenizer, MESSAGES, chat_template=template_file).prompt_text == expected
    assert render_chat(tokenizer, MESSAGES, chat_template=ECHO_TEMPLATE).prompt_text == expected
    assert load_chat_template("{{ x }}") == "{{ x }}"
    assert load_chat_template("line one\nline two") == "line one\nline two"
    assert load_chat_template(None) is None
    assert load_chat_template("tool_use", named_templates={"tool_use"}) == "tool_use"


@pytest.mark.parametrize("value", ["real.jinja", "templates/missing.jinja", "tool_use"])
def test_a_path_like_template_that_does_not_exist_is_an_error(
    tokenizer: Tokenizer, value: str
) -> None:
    """The bug this replaces: LLM.chat(chat_template="real.jinja") rendered the literal string as the prompt."""
    with pytest.raises(ChatInputError, match="looks like a file path") as caught:
        render_chat(tokenizer, MESSAGES, chat_template=value)
    assert caught.value.field == "chat_template"
    with pytest.raises(ChatInputError, match="cannot be read"):
        load_chat_template(Path(value))


def test_prepare_chat_never_reads_a_file(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """What a server takes from a request: the text is the template, even when it names a file."""
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read me")
    prepared = prepare_chat(tokenizer, MESSAGES, chat_template=str(secret))
    assert prepared.render(tokenizer) == str(secret)


def test_chat_template_kwargs_reach_the_template(tokenizer: Tokenizer) -> None:
    rendered = render_chat(
        tokenizer, MESSAGES, chat_template=ECHO_TEMPLATE, chat_template_kwargs={"flavour": "mint"}
    )
    assert rendered.prompt_text.endswith("<gen>mint")
    special = render_chat(
        tokenizer, MESSAGES, chat_template="{{ bos_token }}{{ eos_token }}"
    ).prompt_text
    assert special == BOS_TOKEN + IM_END_TOKEN
    for reserved in ("messages", "tools", "add_generation_prompt", "continue_final_message"):
        with pytest.raises(ChatInputError, match=reserved) as caught:
            render_chat(tokenizer, MESSAGES, chat_template_kwargs={reserved: 1})
        assert caught.value.field == "chat_template_kwargs"


def test_add_generation_prompt(tokenizer: Tokenizer) -> None:
    with_prompt = render_chat(tokenizer, MESSAGES).prompt_text
    without = render_chat(tokenizer, MESSAGES, add_generation_prompt=False).prompt_text
    assert with_prompt == without + "<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------------- continue
@pytest.mark.parametrize("prefix", ["The answer is", "The answer is ", "  spaced  ", "Line\n"])
def test_continue_final_message_ends_the_prompt_inside_the_last_message(
    tokenizer: Tokenizer, prefix: str
) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": prefix}]
    text = render_chat(
        tokenizer, messages, add_generation_prompt=False, continue_final_message=True
    ).prompt_text
    full = render_chat(tokenizer, messages, add_generation_prompt=False).prompt_text
    assert full.startswith(text) and text.rstrip().endswith(prefix.strip())
    assert not text.endswith(IM_END_TOKEN + "\n")


def test_continue_final_message_matches_transformers(tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=IM_END_TOKEN,
        pad_token=END_OF_TEXT_TOKEN,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    for prefix in ("The answer is", "The answer is ", "  spaced  ", "Line\n", "x"):
        messages = [*MESSAGES, {"role": "assistant", "content": prefix}]
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        rendered = render_chat(
            tokenizer, messages, add_generation_prompt=False, continue_final_message=True
        )
        assert rendered.prompt_text == expected, prefix


def test_continue_final_message_errors(tokenizer: Tokenizer) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    with pytest.raises(ChatInputError, match="cannot both be true") as caught:
        render_chat(tokenizer, messages, continue_final_message=True)
    assert caught.value.field == "continue_final_message"
    with pytest.raises(ChatInputError, match="does not contain the final message") as caught:
        render_chat(
            tokenizer,
            messages,
            chat_template="{% for m in messages %}{{ m.role }}{% endfor %}",
            add_generation_prompt=False,
            continue_final_message=True,
        )
    assert caught.value.field == "continue_final_message"


# ---------------------------------------------------------------------------------------------------- messages
def test_text_parts_are_joined_with_newlines(tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": "What is a"}, {"type": "text", "text": "KV cache?"}]
    joined = render_chat(tokenizer, [{"role": "user", "content": "What is a\nKV cache?"}])
    assert render_chat(tokenizer, [{"role": "user", "content": parts}]) == joined
    assert render_chat(tokenizer, [{"role": "user", "content": tuple(parts)}]) == joined


def test_tool_messages_reach_the_template_as_they_come(tokenizer: Tokenizer) -> None:
    original = copy.deepcopy(TOOL_CONVERSATION)
    text = render_chat(
        tokenizer, TOOL_CONVERSATION, chat_template=ECHO_TEMPLATE, tools=TOOLS
    ).prompt_text
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert text == (
        "[user|Weather in Paris?]"
        f"[assistant||calls={json.dumps(calls)}]"  # no content: rendered as ""; arguments parsed
        "[tool|22 C|id=call_1|name=get_weather]tools=1<gen>"
    )
    assert original == TOOL_CONVERSATION  # the caller's messages are never changed


def test_custom_roles_and_extra_keys_pass_through(tokenizer: Tokenizer) -> None:
    messages = [{"role": "developer", "content": "Be kind.", "name": "ops"}]
    text = render_chat(tokenizer, messages, chat_template=ECHO_TEMPLATE).prompt_text
    assert text == "[developer|Be kind.|name=ops]<gen>"


BAD_MESSAGES: list[tuple[Any, str]] = [
    ([], "messages must not be empty"),
    ("Hi", "messages must be a list"),
    (["Hi"], r"messages\[0\] must be a dict"),
    ([{"content": "Hi"}], r"messages\[0\] needs a 'role' string"),
    ([{"role": 7, "content": "Hi"}], r"messages\[0\] needs a 'role' string .* got 7"),
    ([{"role": "user"}], r"messages\[0\] \(role 'user'\) has no content"),
    ([{"role": "user", "content": 5}], r"messages\[0\] \(role 'user'\): content must be a string"),
    ([{"role": "user", "content": ["Hi"]}], r"content\[0\] must be a dict with a 'type'"),
    (
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
        r"content\[0\] is a text part without a 'text' string",
    ),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        r"content\[0\] is a 'image_url' part",
    ),
    (
        [{"role": "assistant", "content": None, "tool_calls": "call"}],
        r"\(role 'assistant'\): tool_calls must be a list",
    ),
    (
        [
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}],
            }
        ],
        r"tool_calls\[0\]\.function\.arguments is not valid JSON",
    ),
]


@pytest.mark.parametrize(("messages", "error"), BAD_MESSAGES, ids=[e for _, e in BAD_MESSAGES])
def test_bad_messages_are_errors_naming_the_place(
    tokenizer: Tokenizer, messages: Any, error: str
) -> None:
    with pytest.raises(ChatInputError, match=error) as caught:
        render_chat(tokenizer, messages)
    assert caught.value.field == "messages"
    assert isinstance(caught.value, ValueError)


def test_bad_tools_and_template_failures(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatInputError, match="tools must be a list") as caught:
        render_chat(tokenizer, MESSAGES, tools=[print])  # type: ignore[list-item]
    assert caught.value.field == "tools"
    with pytest.raises(ChatTemplateError, match="unsupported role function"):
        render_chat(tokenizer, [{"role": "function", "content": "x"}])  # OpenAI's retired role


def test_the_default_template_renders_tools_the_way_qwen25s_does(tokenizer: Tokenizer) -> None:
    """Tools listed in the system turn, a call as <tool_call> JSON with its arguments parsed, consecutive tool
    results in one user turn of <tool_response> blocks; without tools, plain ChatML."""
    conversation = [
        {"role": "system", "content": "Be brief."},
        *TOOL_CONVERSATION,
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    text = render_chat(tokenizer, conversation, tools=TOOLS).prompt_text
    assert text.startswith("<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in text
    assert text.count("<|im_start|>system") == 1
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    plain = render_chat(tokenizer, [{"role": "user", "content": "Hi"}]).prompt_text
    assert plain == "<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_checkpoint_without_a_template_names_chat_template(tmp_path: Path) -> None:
    folder = tmp_path / "bare"
    folder.mkdir()
    build_tokenizer().save(str(folder / "tokenizer.json"))
    bare = load_tokenizer(folder)
    with pytest.raises(ChatInputError, match="no chat template") as caught:
        render_chat(bare, MESSAGES)
    assert caught.value.field == "chat_template"
    assert render_chat(bare, MESSAGES, chat_template="{{ messages | length }}") == RenderedChat(
        "2", bare.encode("2", add_special_tokens=False)
    )
