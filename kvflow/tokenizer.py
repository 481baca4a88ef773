"""Tokenizer loading and chat templates for Hugging Face checkpoint folders.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (the fast tokenizer saved as tokenizer.json) with what
tokenizer_config.json and friends add: BOS/EOS handling, special tokens and the Jinja chat template, rendered the
way `transformers` renders it (sandboxed, same globals and filters), so prompts match the reference exactly.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
COMPILED_TEMPLATE_CACHE_SIZE = 64
# Texts at least this long are encoded through `encode_batch`, which releases the GIL while it works.
_LONG_TEXT_CHARS = 4096


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (including `raise_exception` calls and sandbox violations)."""


class Tokenizer:
    """A fast tokenizer plus the configuration that `transformers` layers on top of it.

    Invariants: every id this class reports (`bos_token_id`, `eos_token_id`, `eos_token_ids`, `all_special_ids`)
    is below `vocab_size`; `eos_token_id == eos_token_ids[0]` whenever either is set; `encode(text)` adds BOS
    exactly once when the configuration asks for it (`add_bos_token`, or the post-processor), never twice;
    `decode` is the plain `tokenizers` decode (no `clean_up_tokenization_spaces`), so incremental decoding can
    reproduce it exactly.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        name_or_path: str = "",
        special_tokens: Mapping[str, str | None] | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_special_tokens: Iterable[str] = (),
        chat_template: str | None = None,
        named_chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        """`special_tokens` maps "bos_token"/"eos_token"/"unk_token"/"pad_token" to token strings;
        `bos_token_id` and `eos_token_ids` are fallbacks and extra EOS ids (generation_config.json);
        `add_bos_token`/`add_eos_token` None means "as the post-processor does"."""
        self._backend = backend
        self.name_or_path = name_or_path
        self._vocab_size = max(
            backend.get_vocab_size(with_added_tokens=True),
            max(backend.get_added_tokens_decoder(), default=-1) + 1,
        )
        self._special_tokens: dict[str, str] = {}
        for name, token in (special_tokens or {}).items():
            if token is None:
                continue
            if backend.token_to_id(token) is None:
                logger.warning(
                    "%s: %s %r is not in the vocabulary; ignoring it",
                    name_or_path or "tokenizer",
                    name,
                    token,
                )
                continue
            self._special_tokens[name] = token
        self._bos_token_id = self._named_token_id("bos_token")
        if self._bos_token_id is None and bos_token_id is not None and self._valid_id(bos_token_id):
            self._bos_token_id = bos_token_id
            self._special_tokens["bos_token"] = backend.id_to_token(bos_token_id)
        self._eos_token_ids = self._resolve_eos_ids(eos_token_ids)
        if "eos_token" not in self._special_tokens and self._eos_token_ids:
            self._special_tokens["eos_token"] = backend.id_to_token(self._eos_token_ids[0])
        self._extra_special_ids = {backend.token_to_id(token) for token in extra_special_tokens} - {
            None
        }
        self._add_bos_token = add_bos_token
        self._add_eos_token = add_eos_token
        self._post_processor_adds_bos, self._post_processor_adds_eos = self._probe_post_processor()
        self._chat_template = chat_template
        self._named_chat_templates = dict(named_chat_templates or {})
        # Compiled templates by source, least recently used first; bounded, since request templates come and go.
        self._compiled_templates: OrderedDict[str, jinja2.Template] = OrderedDict()

    # ------------------------------------------------------------------------------------------------ ids
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (for callers that need its fast paths)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's vocabulary may be padded beyond it)."""
        return self._vocab_size

    def __len__(self) -> int:
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (tokenizer_config.json's eos_token, else generation_config.json's first)."""
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the primary EOS first, then generation_config.json's (or config.json's)."""
        return list(self._eos_token_ids)

    @property
    def pad_token_id(self) -> int | None:
        return self._named_token_id("pad_token")

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of the named special tokens (bos/eos/unk/pad) and of every added token marked special (a copy)."""
        return set(self._all_special_ids)

    @cached_property
    def _all_special_ids(self) -> frozenset[int]:
        ids = {
            token_id
            for token_id, added in self._backend.get_added_tokens_decoder().items()
            if added.special
        }
        ids |= {self._backend.token_to_id(token) for token in self._special_tokens.values()}
        return frozenset(ids | self._extra_special_ids)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Token strings as stored in the vocabulary (byte-level BPE shows bytes as e.g. 'Ġ'); "" for unknown ids."""
        return [self._backend.id_to_token(int(token_id)) or "" for token_id in ids]

    # ------------------------------------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS (and EOS) as the configuration says. A long text
        goes through `encode_batch`, which lets other threads run (an event loop, say) while it tokenizes."""
        if len(text) >= _LONG_TEXT_CHARS:
            encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        ids = encoding.ids
        if add_special_tokens:
            ids = self._apply_add_bos_eos(ids)
        return ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(
            [int(token_id) for token_id in token_ids], skip_special_tokens=skip_special_tokens
        )

    # ------------------------------------------------------------------------------------------------ chat
    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None (a checkpoint may still have named templates)."""
        return self._chat_template

    @property
    def named_chat_templates(self) -> dict[str, str]:
        return dict(self._named_chat_templates)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text with the checkpoint's (or the given) Jinja chat template.

        `chat_template` is a template source or the name of one of the checkpoint's named templates. The
        template sees `messages`, `tools`, `add_generation_prompt`, the special tokens (`bos_token`,
        `eos_token`, ...) and any extra keyword arguments (e.g. `documents`, `enable_thinking`). The rendered
        text usually contains the BOS token already: encode it with `add_special_tokens=False` (see
        `encode_chat`). Messages are checked first (`check_chat_messages`): a malformed one is a ValueError
        naming its index, never an error from inside the template.
        """
        source, variables = self.chat_template_inputs(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            **kwargs,
        )
        return render_chat_template(self._compile(source), variables)

    def chat_template_inputs(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> tuple[str, dict[str, Any]]:
        """What `apply_chat_template` renders: the template source and the variables it sees (checked messages,
        tools, add_generation_prompt, the special tokens, `kwargs`), for a renderer elsewhere (the server renders
        templates sent by clients in a sandbox process)."""
        checked_messages = check_chat_messages(messages)
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise TypeError("tools must be JSON-schema dicts (Python callables are not converted)")
        variables = {
            **self._special_tokens,
            **kwargs,
            "messages": checked_messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        return self._resolve_chat_template(chat_template), variables

    def is_named_chat_template(self, chat_template: str | None) -> bool:
        """Whether `chat_template` names one of the checkpoint's own templates (None: its default)."""
        return chat_template is None or chat_template in self._named_chat_templates

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """`apply_chat_template` then `encode` without adding special tokens (the template placed them)."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    # ------------------------------------------------------------------------------------------------ internals
    def _valid_id(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab_size

    def _named_token_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return self._backend.token_to_id(token) if token is not None else None

    def _resolve_eos_ids(self, extra_eos_ids: Sequence[int]) -> list[int]:
        eos_ids: list[int] = []
        named_eos = self._named_token_id("eos_token")
        for token_id in ([named_eos] if named_eos is not None else []) + [
            int(i) for i in extra_eos_ids
        ]:
            if not self._valid_id(token_id):
                logger.warning(
                    "%s: EOS id %d is outside the vocabulary (%d); ignoring it",
                    self.name_or_path or "tokenizer",
                    token_id,
                    self._vocab_size,
                )
            elif token_id not in eos_ids:
                eos_ids.append(token_id)
        return eos_ids

    def _probe_post_processor(self) -> tuple[bool, bool]:
        """Whether the post-processor itself adds BOS before / EOS after a sequence."""
        plain = self._backend.encode("a", add_special_tokens=False).ids
        full = self._backend.encode("a", add_special_tokens=True).ids
        start = next(
            (k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain),
            None,
        )
        if start is None:
            return False, False
        prefix, suffix = full[:start], full[start + len(plain) :]
        adds_bos = bool(prefix) and prefix[0] == self._bos_token_id
        adds_eos = bool(suffix) and suffix[-1] == self.eos_token_id
        return adds_bos, adds_eos

    def _apply_add_bos_eos(self, ids: list[int]) -> list[int]:
        if self._bos_token_id is not None:
            if self._add_bos_token and not self._post_processor_adds_bos:
                ids = [self._bos_token_id, *ids]
            elif self._add_bos_token is False and self._post_processor_adds_bos:
                ids = ids[1:]
        eos_token_id = self.eos_token_id
        if eos_token_id is not None:
            if self._add_eos_token and not self._post_processor_adds_eos:
                ids = [*ids, eos_token_id]
            elif self._add_eos_token is False and self._post_processor_adds_eos:
                ids = ids[:-1]
        return ids

    def _resolve_chat_template(self, chat_template: str | None) -> str:
        if chat_template is not None:
            return self._named_chat_templates.get(chat_template, chat_template)
        if self._chat_template is not None:
            return self._chat_template
        if self._named_chat_templates:
            raise ValueError(
                f"{self.name_or_path or 'this tokenizer'} has several chat templates and no default: "
                f"pass chat_template= one of {sorted(self._named_chat_templates)}"
            )
        raise ValueError(
            f"{self.name_or_path or 'this tokenizer'} has no chat template (none in "
            f"{TOKENIZER_CONFIG_FILE} or {CHAT_TEMPLATE_FILE}): pass chat_template= a Jinja template"
        )

    def _compile(self, source: str) -> jinja2.Template:
        """The compiled template of `source`, from an LRU cache of `COMPILED_TEMPLATE_CACHE_SIZE` entries."""
        template = self._compiled_templates.get(source)
        if template is None:
            template = compile_chat_template(source)
            self._compiled_templates[source] = template
            if len(self._compiled_templates) > COMPILED_TEMPLATE_CACHE_SIZE:
                self._compiled_templates.popitem(last=False)
        else:
            self._compiled_templates.move_to_end(source)
        return template

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name_or_path={self.name_or_path!r}, vocab_size={self._vocab_size}, "
            f"bos_token_id={self._bos_token_id}, eos_token_ids={self._eos_token_ids})"
        )


# ---------------------------------------------------------------------------------------------------- jinja
def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like transformers: no HTML escaping (Jinja's own tojson escapes <, >, & and '), unicode kept as is.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` (assistant-mask markers) and renders the body
    unchanged, so templates that use it work here too."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    @staticmethod
    def _render_body(caller: Callable[[], str]) -> str:
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment `transformers` uses (immutable sandbox,
    trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, unescaped `tojson`)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTagExtension],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"chat template is not valid Jinja (line {error.lineno}): {error.message}"
        ) from error


def render_chat_template(
    template: jinja2.Template, variables: Mapping[str, Any], max_chars: int | None = None
) -> str:
    """Render a compiled chat template; every failure is a ChatTemplateError saying why. With `max_chars`, the
    rendering stops (ChatTemplateError) as soon as its output grows past that many characters."""
    try:
        if max_chars is None:
            return template.render(**variables)
        pieces: list[str] = []
        num_chars = 0
        for piece in template.generate(**variables):
            num_chars += len(piece)
            if num_chars > max_chars:
                raise ChatTemplateError(
                    f"chat template output is longer than {max_chars} characters"
                )
            pieces.append(piece)
        return "".join(pieces)
    except jinja2.exceptions.SecurityError as error:
        raise ChatTemplateError(f"chat template attempted an unsafe operation: {error}") from error
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template error: {error}") from error
    except (
        TypeError,
        AttributeError,
    ) as error:  # e.g. iterating a value the template did not expect
        raise ChatTemplateError(
            f"chat template error: {error} (the template cannot render these messages)"
        ) from error


# ---------------------------------------------------------------------------------------------------- loading
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


def check_chat_messages(messages: object) -> list[Mapping[str, Any]]:
    """Check a conversation before a chat template renders it; ValueError naming the first bad message's index.

    Each message is a dict with a string `role` and a `content` that is a string or a list of parts, each a dict
    with a `type` (`{"type": "text", "text": str}`; other types, such as images, are passed through for templates
    that know them). `content` may be None or missing only on a message with `tool_calls` (an assistant's tool
    call, as in vLLM); such a message is rendered with content "" (returned as a copy; the caller's messages are
    never changed). Anywhere else a missing content is an error rather than a failure inside the template: pass ""
    for an empty message. Returns the messages to render.
    """
    if not isinstance(messages, list) or not all(
        isinstance(message, Mapping) for message in messages
    ):
        raise ValueError(
            "messages must be a list of dicts such as {'role': 'user', 'content': 'Hi'}"
        )
    checked: list[Mapping[str, Any]] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(
                f"messages[{index}] needs a 'role' string such as 'user', got {role!r}"
            )
        if message.get("content") is None and message.get("tool_calls"):
            message = {**message, "content": ""}
        _check_message_content(f"messages[{index}] (role {role!r})", message.get("content"))
        checked.append(message)
    return checked


def _check_message_content(where: str, content: object) -> None:
    if content is None:
        raise ValueError(
            f"{where} has no content: give it a 'content' string (\"\" for an empty message) or a list of "
            "{'type': 'text', 'text': ...} parts"
        )
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(
            f"{where}: content must be a string or a list of parts, got {type(content).__name__}"
        )
    for part_index, part in enumerate(content):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise ValueError(
                f"{where}: content[{part_index}] must be a dict with a 'type', such as "
                f"{{'type': 'text', 'text': 'Hi'}}, got {part!r}"
            )
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise ValueError(
                f"{where}: content[{part_index}] is a text part without a 'text' string"
            )
