"""The server's own options (the engine's are `EngineArgs`): plain data, light to import for the CLI."""

from __future__ import annotations

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
    limits: ServingLimits = field(default_factory=ServingLimits)
    timeout_keep_alive_s: float = 75.0
    uvicorn_log_level: str = "warning"
