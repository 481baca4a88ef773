"""Tokenizer loading (the random-weight model's tokenizer, transformers layouts), encode/decode, chat templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvflow.default_model import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
)
from kvflow.default_model.random_weights import build_random_model, build_tokenizer
from kvflow.tokenizer import ChatInputError, ChatTemplateError, Tokenizer, load_tokenizer

UNICODE_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "café naïve façade crème brûlée",
    "日本語のテキストと中文文本",
    "emoji 🚀🎉 and a family 👨‍👩‍👧 (ZWJ) and a flag 🇫🇷",
    "combining e\u0301 and tabs\tand\nnewlines\r\n",
    "Ünïcödé ∑ ∫ √ ≈ ≠ — “quotes” \u2018single\u2019 …",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("random") / "model"
    build_random_model(folder)  # its tokenizer's ids are fixed: 1024 entries, specials 1020-1023
    return load_tokenizer(folder)


def _write_folder(
    folder: Path,
    *,
    config: dict[str, Any] | None = None,
    post_processor: bool = True,
    extra_files: dict[str, Any] | None = None,
) -> Path:
    """A checkpoint folder holding the random-weight model's tokenizer.json and the given config files."""
    folder.mkdir(parents=True, exist_ok=True)
    backend = build_tokenizer()
    if not post_processor:
        backend.post_processor = None
    backend.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in (extra_files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


# ---------------------------------------------------------------------------------------------------- random model
def test_random_model_tokenizer_properties(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == len(tokenizer) == 1024
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == (BOS_TOKEN, 1020)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == (IM_END_TOKEN, 1023)
    assert tokenizer.eos_token_ids == [
        1023,
        1021,
    ]  # tokenizer_config's eos first, then generation_config's
    assert tokenizer.pad_token_id == 1021
    assert tokenizer.all_special_ids == {1020, 1021, 1022, 1023}
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.convert_ids_to_tokens([1022, 1023]) == [IM_START_TOKEN, IM_END_TOKEN]


def test_encode_adds_bos_exactly_once(tokenizer: Tokenizer) -> None:
    plain = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.encode("Hello world") == [1020, *plain]
    assert tokenizer.encode("") == [1020]
    assert tokenizer.encode("", add_special_tokens=False) == []
    assert 1020 not in plain


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_unicode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_round_trips(tokenizer: Tokenizer, text: str) -> None:
    # Text that spells a special token encodes to that token, which decoding skips by design.
    assume(
        not any(
            added.content in text for added in tokenizer.backend.get_added_tokens_decoder().values()
        )
    )
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_special_tokens_in_text_are_single_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1022 and ids[-1] == 1023
    assert tokenizer.decode(ids) == "user\nHi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


def test_convert_ids_to_tokens_shows_byte_level_symbols(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
    assert tokens == ["Ġa"]
    assert tokenizer.convert_ids_to_tokens([10**6]) == [""]


# ---------------------------------------------------------------------------------------------------- chat templates
def test_chat_template_renders_chatml(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template(MESSAGES)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert text == without_prompt + "<|im_start|>assistant\n"


def test_chat_text_parts_are_joined_and_other_parts_refused(tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    assert tokenizer.apply_chat_template([{"role": "user", "content": parts}]).endswith(
        "<|im_start|>user\nHello\nthere<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ChatInputError, match=r"content\[1\] is a 'image' part"):
        tokenizer.apply_chat_template([{"role": "user", "content": [parts[0], {"type": "image"}]}])


def test_encode_chat_has_a_single_bos(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_chat(MESSAGES)
    assert ids[0] == 1020 and ids.count(1020) == 1
    suffix = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(suffix) :] == suffix


def test_template_raise_exception_is_a_clear_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unsupported role function"):
        tokenizer.apply_chat_template([{"role": "function", "content": "42"}])
    with pytest.raises(ChatTemplateError, match="system message must come first"):
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
        "{{ raise_exception.__globals__['__builtins__'] }}",
        "{% set _ = messages.append({'role': 'user'}) %}",
        "{{ messages[0].update({'content': 'changed'}) }}",
        "{{ messages[0].pop('content') }}",
    ],
)
def test_template_cannot_escape_the_sandbox(tokenizer: Tokenizer, source: str) -> None:
    messages = [{"role": "user", "content": "original"}]
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tokenizer.apply_chat_template(messages, chat_template=source)
    assert messages == [{"role": "user", "content": "original"}]


def test_unsafe_attributes_render_as_nothing(tokenizer: Tokenizer) -> None:
    assert (
        tokenizer.apply_chat_template(MESSAGES, chat_template="[{{ raise_exception.__globals__ }}]")
        == "[]"
    )


def test_template_helpers_and_kwargs(tokenizer: Tokenizer) -> None:
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ messages[0] | tojson(indent=None) }}|"
        "{{ flavour }}|{{ strftime_now('%Y') | length }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
        "{% generation %}{{ add_generation_prompt }}{% endgeneration %}"
    )
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "<b>now</b> & café"},
        }
    ]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}],
        chat_template=template,
        tools=tools,
        flavour="vanilla",
        add_generation_prompt=False,
    )
    tools_json = json.dumps(tools, ensure_ascii=False)
    assert text == (
        f'{BOS_TOKEN}|{IM_END_TOKEN}|{tools_json}|{{"role": "user", "content": "x"}}|'
        "vanilla|4|user|False"
    )


def test_template_errors(tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        tokenizer.apply_chat_template(MESSAGES, chat_template="{% if %}")
    with pytest.raises(ChatTemplateError, match="undefined"):
        tokenizer.apply_chat_template(MESSAGES, chat_template="{{ nothing.here }}")
    with pytest.raises(ChatInputError, match="messages must be a list"):
        tokenizer.apply_chat_template("Hi")  # type: ignore[arg-type]
    with pytest.raises(ChatInputError, match="JSON-schema"):
        tokenizer.apply_chat_template(MESSAGES, tools=[print])  # type: ignore[list-item]
    no_template = load_tokenizer(_write_folder(tmp_path / "bare", config={"bos_token": BOS_TOKEN}))
    assert no_template.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template(MESSAGES)
    assert no_template.apply_chat_template(MESSAGES, chat_template="{{ messages | length }}") == "4"


# ---------------------------------------------------------------------------------------------------- file layouts
def test_transformers_saved_layout(tmp_path: Path) -> None:
    """transformers 5 writes the template to chat_template.jinja and a minimal tokenizer_config.json."""
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=IM_END_TOKEN,
        pad_token=END_OF_TEXT_TOKEN,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        1020,
        1023,
        1021,
    )
    assert tokenizer.vocab_size == len(reloaded)
    assert tokenizer.all_special_ids == set(reloaded.all_special_ids) | {1022}
    for text in UNICODE_TEXTS:
        assert tokenizer.encode(text) == reloaded(text)["input_ids"], text
        ids = tokenizer.encode(text + "<|im_end|>")
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == reloaded.decode(
                ids, skip_special_tokens=skip
            )
    for add_generation_prompt in (True, False):
        assert tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt
        ) == reloaded.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )


def test_special_tokens_as_added_token_dicts_and_named_templates(tmp_path: Path) -> None:
    config = {
        "bos_token": {
            "__type": "AddedToken",
            "content": BOS_TOKEN,
            "lstrip": False,
            "rstrip": False,
        },
        "eos_token": {"content": END_OF_TEXT_TOKEN},
        "unk_token": None,
        "chat_template": [
            {"name": "default", "template": "default:{{ messages | length }}"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        ],
    }
    tokenizer = load_tokenizer(_write_folder(tmp_path, config=config))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token) == (
        1020,
        1021,
        None,
    )
    assert tokenizer.chat_template == "default:{{ messages | length }}"
    assert tokenizer.apply_chat_template(MESSAGES) == "default:4"
    assert (
        tokenizer.apply_chat_template(MESSAGES, chat_template="tool_use", tools=[{"a": 1}])
        == "tools:1"
    )


def test_named_templates_without_default(tmp_path: Path) -> None:
    config = {"chat_template": [{"name": "rag", "template": "rag"}]}
    tokenizer = load_tokenizer(
        _write_folder(
            tmp_path,
            config=config,
            extra_files={"additional_chat_templates/tool_use.jinja": "tool"},
        )
    )
    assert tokenizer.chat_template is None
    assert tokenizer.named_chat_templates == {"rag": "rag", "tool_use": "tool"}
    with pytest.raises(ValueError, match="several chat templates"):
        tokenizer.apply_chat_template(MESSAGES)
    assert tokenizer.apply_chat_template(MESSAGES, chat_template="tool_use") == "tool"


def test_template_file_precedence(tmp_path: Path) -> None:
    folder = _write_folder(
        tmp_path / "json",
        config={"chat_template": "from-config"},
        extra_files={"chat_template.json": {"chat_template": "from-json"}},
    )
    assert load_tokenizer(folder).chat_template == "from-json"
    folder = _write_folder(
        tmp_path / "jinja",
        config={"chat_template": "from-config"},
        extra_files={"chat_template.jinja": "from-jinja"},
    )
    assert load_tokenizer(folder).chat_template == "from-jinja"


def test_eos_fallbacks_from_generation_and_model_config(tmp_path: Path) -> None:
    folder = _write_folder(
        tmp_path / "gen",
        config={},
        extra_files={
            "generation_config.json": {"eos_token_id": [1021, 1023], "bos_token_id": 1020},
            "config.json": {"eos_token_id": 5},
        },
    )
    tokenizer = load_tokenizer(folder)
    assert (tokenizer.eos_token_id, tokenizer.eos_token_ids, tokenizer.eos_token) == (
        1021,
        [1021, 1023],
        END_OF_TEXT_TOKEN,
    )
    assert (tokenizer.bos_token_id, tokenizer.bos_token) == (1020, BOS_TOKEN)
    folder = _write_folder(tmp_path / "model", extra_files={"config.json": {"eos_token_id": 1023}})
    assert load_tokenizer(folder).eos_token_ids == [1023]
    folder = _write_folder(tmp_path / "none")
    tokenizer = load_tokenizer(folder)
    assert (tokenizer.eos_token_id, tokenizer.eos_token_ids, tokenizer.bos_token_id) == (
        None,
        [],
        None,
    )
    folder = _write_folder(
        tmp_path / "bad", extra_files={"generation_config.json": {"eos_token_id": 99999}}
    )
    assert (
        load_tokenizer(folder).eos_token_ids == []
    )  # outside the vocabulary: ignored with a warning


@pytest.mark.parametrize(
    ("add_bos_token", "post_processor", "expect_bos"),
    [
        (True, False, True),  # Llama-2 style: the config asks, no post-processor: add it ourselves
        (True, True, True),  # both: still exactly one
        (False, True, False),  # the config turns the post-processor's BOS off
        (None, True, True),  # unspecified: as the post-processor does
        (None, False, False),
    ],
)
def test_add_bos_token(
    tmp_path: Path, add_bos_token: bool | None, post_processor: bool, expect_bos: bool
) -> None:
    config: dict[str, Any] = {"bos_token": BOS_TOKEN}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    tokenizer = load_tokenizer(
        _write_folder(tmp_path, config=config, post_processor=post_processor)
    )
    plain = tokenizer.encode("Hi there", add_special_tokens=False)
    assert tokenizer.encode("Hi there") == ([1020] if expect_bos else []) + plain


def test_add_eos_token(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(
        _write_folder(tmp_path, config={"eos_token": IM_END_TOKEN, "add_eos_token": True})
    )
    assert tokenizer.encode("Hi")[-1] == 1023
    assert tokenizer.encode("Hi", add_special_tokens=False)[-1] != 1023


def test_added_tokens_decoder_registers_missing_tokens(tmp_path: Path) -> None:
    config = {
        "added_tokens_decoder": {
            "1024": {
                "content": "<|tool|>",
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
            },
            "1025": {"content": "<think>", "special": False, "normalized": False},
        }
    }
    tokenizer = load_tokenizer(_write_folder(tmp_path, config=config))
    assert tokenizer.vocab_size == 1026
    assert (tokenizer.token_to_id("<|tool|>"), tokenizer.token_to_id("<think>")) == (1024, 1025)
    assert 1024 in tokenizer.all_special_ids and 1025 not in tokenizer.all_special_ids
    ids = tokenizer.encode("a<|tool|>b<think>c", add_special_tokens=False)
    assert 1024 in ids and 1025 in ids
    assert tokenizer.decode(ids) == "ab<think>c"


def test_tokenizer_json_path_is_accepted(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path, config={"bos_token": BOS_TOKEN})
    assert load_tokenizer(folder / "tokenizer.json").bos_token_id == 1020


# ---------------------------------------------------------------------------------------------------- errors
def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such tokenizer folder"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json: not found.*tokenizer\.model"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("tokenizer.json", "{ not json", r"tokenizer\.json: not a valid tokenizer file"),
        (
            "tokenizer.json",
            json.dumps({"version": "1.0", "model": {"type": "Nope"}}),
            r"tokenizer\.json: not a valid tokenizer file",
        ),
        ("tokenizer_config.json", "{ not json", r"tokenizer_config\.json: not valid JSON"),
        ("tokenizer_config.json", "[1, 2]", r"tokenizer_config\.json: expected a JSON object"),
        (
            "tokenizer_config.json",
            json.dumps({"chat_template": 3}),
            r"tokenizer_config\.json: chat_template must",
        ),
        (
            "tokenizer_config.json",
            json.dumps({"added_tokens_decoder": {"x": {}}}),
            r"tokenizer_config\.json: added_tokens_decoder must",
        ),
        ("generation_config.json", "{", r"generation_config\.json: not valid JSON"),
        ("config.json", "nope", r"config\.json: not valid JSON"),
    ],
)
def test_corrupt_files_are_named(tmp_path: Path, file: str, content: str, message: str) -> None:
    folder = _write_folder(tmp_path, config={})
    (folder / file).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tokenizer(folder)
