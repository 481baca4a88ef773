"""The server's own options (the engine's are `EngineArgs`): plain data, light to import for the CLI."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

MIB = 2**20
# How long a chat template sent with a request may render (`TemplateSandbox`).
REQUEST_TEMPLATE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServingLimits:
    """How much one request may ask of the server, each bound a `kvflow serve` flag.

    Without them one request could take the server down: `n` of a million expands into a million engine requests,
    100,000 stop strings are searched on every token, a body of gigabytes is read into memory. Each is checked
    before anything is tokenized or queued, and exceeding it is a 400 naming the field (413 for the body, which
    has none). `max_n` samples (`n`, `best_of`), `max_prompts` prompts in one completions request,
    `max_stop_strings` stop strings of at most `max_stop_string_chars` characters, `max_logit_bias` entries
    (OpenAI's 300), `max_request_body_bytes` of body; `max_stream_buffer_bytes` of a stream may wait for a client
    that does not read before its request is aborted (`serving_engine.bounded_stream`).
    """

    max_n: int = 128
    max_prompts: int = 1024
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1000
    max_logit_bias: int = 300
    max_request_body_bytes: int = 32 * MIB
    max_stream_buffer_bytes: int = MIB

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


# The variables that turn on runtime adapter loading (`--enable-runtime-lora-updating`): vLLM's and kvflow's own.
RUNTIME_LORA_UPDATING_ENVS = (
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING",
)
_TRUE = ("1", "true")
_FALSE = ("", "0", "false")


@dataclass(frozen=True)
class LoRAModulePath:
    """One adapter given with `--lora-modules`: the name clients send as `model`, its PEFT folder, and optionally
    the base model it was trained on (its card's `parent` in GET /v1/models; default: the served model name).

    Invariants: `name` and `path` are non-empty.
    """

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("--lora-modules: an adapter's name must not be empty")
        if not self.path:
            raise ValueError(f"--lora-modules: adapter {self.name!r} has an empty path")


def parse_lora_module(text: str) -> LoRAModulePath:
    """One `--lora-modules` value, as vLLM takes it: `name=path`, or JSON `{"name": ..., "path": ...,
    "base_model_name": ...}` (base_model_name optional). ValueError naming the flag and the value otherwise; a JSON
    key other than these three is an error, not ignored."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON: {error}") from error
        keys = {"name", "path", "base_model_name"}
        unknown = sorted(set(value) - keys)
        if unknown:
            raise ValueError(
                f"--lora-modules: {text!r} has unknown keys {unknown}; it takes name, path, base_model_name"
            )
        missing = [key for key in ("name", "path") if not isinstance(value.get(key), str)]
        if missing:
            raise ValueError(f"--lora-modules: {text!r} needs {' and '.join(missing)} (strings)")
        base = value.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: base_model_name in {text!r} must be a string")
        return LoRAModulePath(value["name"], value["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"--lora-modules: {text!r} is neither name=path nor JSON "
            '\'{"name": ..., "path": ..., "base_model_name": ...}\''
        )
    return LoRAModulePath(name, path)


def runtime_lora_updating_from_env(environ: dict[str, str] | None = None) -> str | None:
    """The name of the first of `RUNTIME_LORA_UPDATING_ENVS` set to a true value ("1" or "true", any case), or
    None. A value that is neither true nor false ("", "0", "false") is a ValueError naming the variable, not
    silently false."""
    environ = dict(os.environ) if environ is None else environ
    for name in RUNTIME_LORA_UPDATING_ENVS:
        value = environ.get(name)
        if value is None:
            continue
        value = value.strip().lower()
        if value in _TRUE:
            return name
        if value not in _FALSE:
            raise ValueError(f"{name}={environ[name]!r}: set it to 1 or true (or 0 / false)")
    return None


@dataclass(frozen=True)
class CORSConfig:
    """Which browser pages may call the server (`--allowed-origins` and its companions, vLLM's flags), answered
    by Starlette's CORS middleware. Without it (`ServerConfig.cors` None, the default) the server sends no CORS
    headers and browsers keep other sites' pages from reading its answers.

    `allowed_origins`: origins such as "https://app.example", or "*" for any; `allowed_methods` (upper case, as
    browsers send them) and `allowed_headers`: what a preflight may ask for ("*": any); `allow_credentials`: pages
    may send cookies and HTTP authentication. Browsers refuse "*" with credentials, so with both the answer names
    the request's own origin: any site may then call the server with the user's credentials.

    Invariants: every entry is a non-empty string; methods are upper case.
    """

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_methods", tuple(m.upper() for m in self.allowed_methods))
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            if not all(isinstance(value, str) and value for value in values):
                raise ValueError(
                    f"--{name.replace('_', '-')}: every entry must be a non-empty string"
                )

    @property
    def any_origin_with_credentials(self) -> bool:
        return self.allow_credentials and "*" in self.allowed_origins


def parse_json_string_list(text: str) -> tuple[str, ...]:
    """A flag's JSON list of strings (`--allowed-origins '["https://app.example"]'`, as in vLLM); ValueError
    saying what it expected otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"expected a JSON list of strings such as '[\"https://app.example\"]', got {text!r} ({error})"
        ) from error
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError(f"expected a JSON list of non-empty strings, got {text!r}")
    return tuple(value)


@dataclass(frozen=True)
class ServerConfig:
    """The server's options.

    `timeout_keep_alive_s`: how long an idle kept-alive connection stays open. Longer than the idle expiry of
    common HTTP clients (httpx and the openai client: 5 s, aiohttp: 15 s), so a client never reuses a connection
    at the moment the server closes it: with both at uvicorn's 5 s default, connections that went idle together
    were closed under requests just sent on them (a ReadError at the client, nothing in the server log).
    `trust_request_chat_template`: render chat templates sent with requests (in a sandbox process); refused
    otherwise, as in vLLM. `chat_template`: the server's default chat template (`--chat-template`), already loaded
    (`kvflow.tokenizer.chat.load_chat_template`): the template's text or the name of one of the checkpoint's
    templates; None, the checkpoint's default. Requests that send their own `chat_template` use theirs.
    `tool_call_parser`: the `TOOL_PARSERS` name that extracts calls from replies under tool_choice "auto",
    which `enable_auto_tool_choice` turns on (vLLM's `--enable-auto-tool-choice --tool-call-parser NAME`; the
    first needs the second).
    `max_stored_responses`: how many responses /v1/responses keeps in memory for `GET /v1/responses/{id}` and
    `previous_response_id` (`--max-stored-responses`); past it the least recently used one is forgotten.
    `lora_modules`: the adapters served from the start (`--lora-modules`, needs the engine's `enable_lora`), each
    registered under its name with `lora_int_id` 1, 2, ... in the order given; `enable_runtime_lora_updating`
    mounts POST /v1/load_lora_adapter and /v1/unload_lora_adapter (`--enable-runtime-lora-updating`, or
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING` / `KVFLOW_ALLOW_RUNTIME_LORA_UPDATING`); without it those paths are 404, as
    in vLLM.
    `cors`: the CORS policy (`CORSConfig`); None, no CORS headers at all.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "default"
    api_key: str | None = None
    enable_admin_endpoints: bool = False
    trust_request_chat_template: bool = False
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    max_stored_responses: int = 1000
    limits: ServingLimits = field(default_factory=ServingLimits)
    lora_modules: tuple[LoRAModulePath, ...] = ()
    enable_runtime_lora_updating: bool = False
    timeout_keep_alive_s: float = 75.0
    uvicorn_log_level: str = "warning"
    cors: CORSConfig | None = None
