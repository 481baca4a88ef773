"""Loading a tokenizer from a Hugging Face checkpoint folder: tokenizer.json plus what tokenizer_config.json,
chat_template.jinja / chat_template.json / additional_chat_templates/, generation_config.json and config.json add.

Every missing or corrupt file is an error that names the file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import tokenizers

from kvflow.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer of a Hugging Face checkpoint folder (or a tokenizer.json file and its neighbours).

    Reads tokenizer.json (required), tokenizer_config.json, chat_template.jinja, chat_template.json,
    additional_chat_templates/*.jinja, and generation_config.json / config.json for EOS/BOS fallbacks.
    Missing or corrupt files raise errors that name the file.
    """
    path = Path(path).expanduser()
    directory, tokenizer_file = (
        (path.parent, path) if path.is_file() else (path, path / TOKENIZER_FILE)
    )
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such tokenizer folder")
    if not tokenizer_file.is_file():
        hint = (
            " (only a slow sentencepiece tokenizer.model is present)"
            if (directory / "tokenizer.model").exists()
            else ""
        )
        raise FileNotFoundError(
            f"{tokenizer_file}: not found{hint}; kvflow needs a Hugging Face fast tokenizer"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # tokenizers raises plain Exception subclasses for parse errors
        raise ValueError(f"{tokenizer_file}: not a valid tokenizer file ({error})") from error
    config = _read_json_object(directory / TOKENIZER_CONFIG_FILE)
    generation_config = _read_json_object(directory / GENERATION_CONFIG_FILE)
    model_config = _read_json_object(directory / MODEL_CONFIG_FILE)
    text_config = (
        model_config.get("text_config") if isinstance(model_config.get("text_config"), dict) else {}
    )

    extra_special_tokens = _register_added_tokens(
        backend, config, directory / TOKENIZER_CONFIG_FILE
    )
    special_tokens = {name: _token_content(config.get(name)) for name in _NAMED_SPECIAL_TOKENS}
    eos_source = generation_config if "eos_token_id" in generation_config else model_config
    eos_token_ids = _as_ids(eos_source.get("eos_token_id", text_config.get("eos_token_id")))
    bos_token_id = _first_id(
        generation_config.get(
            "bos_token_id", model_config.get("bos_token_id", text_config.get("bos_token_id"))
        )
    )
    chat_template, named_templates = _load_chat_templates(directory, config)
    return Tokenizer(
        backend,
        name_or_path=str(directory),
        special_tokens=special_tokens,
        bos_token_id=bos_token_id,
        eos_token_ids=eos_token_ids,
        add_bos_token=_optional_bool(config.get("add_bos_token")),
        add_eos_token=_optional_bool(config.get("add_eos_token")),
        extra_special_tokens=extra_special_tokens,
        chat_template=chat_template,
        named_chat_templates=named_templates,
    )


def _read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in `file`, {} if the file does not exist; a corrupt file is a ValueError naming it."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _register_added_tokens(
    backend: tokenizers.Tokenizer, config: dict[str, Any], config_file: Path
) -> list[str]:
    """Add tokens declared in `added_tokens_decoder` that tokenizer.json lacks; return the extra special tokens."""
    known = {added.content for added in backend.get_added_tokens_decoder().values()}
    declared = config.get("added_tokens_decoder") or {}
    extra_special: list[str] = []
    if not isinstance(declared, dict) or not all(str(key).isdigit() for key in declared):
        raise ValueError(f"{config_file}: added_tokens_decoder must map token ids to token objects")
    for token_id, spec in sorted(declared.items(), key=lambda item: int(item[0])):
        content = _token_content(spec)
        if content is None or not isinstance(spec, dict):
            continue
        special = bool(spec.get("special", False))
        if special:
            extra_special.append(content)
        if content not in known:
            added = tokenizers.AddedToken(
                content,
                single_word=bool(spec.get("single_word", False)),
                lstrip=bool(spec.get("lstrip", False)),
                rstrip=bool(spec.get("rstrip", False)),
                normalized=bool(spec.get("normalized", not special)),
                special=special,
            )
            (backend.add_special_tokens if special else backend.add_tokens)([added])
        if backend.token_to_id(content) != int(token_id):
            logger.warning(
                "%s: added token %r has id %s in the config but %s in the tokenizer",
                config_file,
                content,
                token_id,
                backend.token_to_id(content),
            )
    for key in ("additional_special_tokens", "extra_special_tokens"):
        tokens = config.get(key) or []
        values = tokens.values() if isinstance(tokens, dict) else tokens
        extra_special += [token for token in map(_token_content, values) if token is not None]
    return extra_special


def _load_chat_templates(
    directory: Path, config: dict[str, Any]
) -> tuple[str | None, dict[str, str]]:
    """The default chat template and the named ones. chat_template.jinja wins over chat_template.json, which wins
    over tokenizer_config.json's `chat_template` (a string, or a list of {"name", "template"})."""
    default, named = _split_templates(
        config.get("chat_template"), directory / TOKENIZER_CONFIG_FILE
    )
    json_file = directory / CHAT_TEMPLATE_JSON_FILE
    if json_file.is_file():
        json_default, json_named = _split_templates(
            _read_json_object(json_file).get("chat_template"), json_file
        )
        default, named = json_default or default, {**named, **json_named}
    extra_dir = directory / ADDITIONAL_CHAT_TEMPLATES_DIR
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            named[file.stem] = _read_text(file)
    jinja_file = directory / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        default = _read_text(jinja_file)
    if default is None:
        default = named.get("default")
    return default, named


def _split_templates(value: Any, source: Path) -> tuple[str | None, dict[str, str]]:
    if value is None:
        return None, {}
    if isinstance(value, str):
        return value, {}
    if isinstance(value, list) and all(
        isinstance(item, dict) and {"name", "template"} <= item.keys() for item in value
    ):
        named = {str(item["name"]): str(item["template"]) for item in value}
        return named.get("default"), named
    raise ValueError(
        f"{source}: chat_template must be a string or a list of {{'name', 'template'}} objects"
    )


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{file}: cannot read ({error})") from error


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [
            int(token_id)
            for token_id in value
            if isinstance(token_id, int) and not isinstance(token_id, bool)
        ]
    return []


def _first_id(value: Any) -> int | None:
    ids = _as_ids(value)
    return ids[0] if ids else None


def _optional_bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None
