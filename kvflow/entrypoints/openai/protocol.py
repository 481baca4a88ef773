"""Request and response bodies of the OpenAI-compatible server, in OpenAI's shapes plus vLLM's extra fields.

Requests accept unknown fields (clients send `metadata` and the like); the handlers log each such name once and
ignore it, as vLLM does. Every field declared here either works or is refused: the fields of OpenAI's and vLLM's
schemas that kvflow does not implement yet (logits processors, prompt embeddings, ...) are declared so that
they are typed and documented, and `unsupported.py` refuses any of them sent with a value other than its "off" one
(a 400 naming it), because ignoring them would change what the client gets. The structured-output fields
(`response_format`, `structured_outputs`, `guided_*`, `structural_tag`) become one `StructuredOutputsParams` in
`serving_engine.request_controls`, which also checks the logits controls against the vocabulary. Value checks
(ranges, lengths) are left to `SamplingParams`, the input processor and the server's limits
(`limits.ServingLimits`), whose errors name the field; these models check types, and that every string in a request
is valid Unicode (JSON's `\ud800` escape decodes to a lone surrogate, which no tokenizer or encoder accepts), a 400
naming the field.
"""

from __future__ import annotations

import json
import re
import time
from contextvars import ContextVar
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

# ---------------------------------------------------------------------------------------------------- shared


class OpenAIBaseModel(BaseModel):
    """A request body: unknown fields are kept in `model_extra` (reported, then ignored). Every string in it, at
    any depth and in any field, is valid Unicode (a ValueError naming the field otherwise)."""

    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        check_unicode(value)
        return value

    @model_validator(mode="after")
    def _valid_unicode_extras(self) -> OpenAIBaseModel:
        check_unicode(self.model_extra or {})
        return self


class BodySurrogateScan:
    """What a scan of a request's raw body found: whether its JSON can decode to a lone surrogate at all. Only
    three things make one: a `\\uD800`-`\\uDFFF` escape, the UTF-8 bytes of a surrogate (JSON decodes bytes
    with "surrogatepass"), or a body that is not UTF-8 (a NUL byte: UTF-16 or UTF-32). A body with none of them
    needs no Unicode check of its values. `feed` takes the body chunk by chunk; a pattern split across two chunks
    is still found."""

    _PATTERN = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\x00")
    _OVERLAP = 3  # one byte shorter than the longest pattern (`\\ud8`)

    def __init__(self) -> None:
        self.possible = False
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if self.possible or not chunk:
            return
        window = self._tail + chunk
        self.possible = self._PATTERN.search(window) is not None
        self._tail = window[-self._OVERLAP :]


# The scan of the body being validated (set per request by `middleware.BodySurrogateScanMiddleware`). Without one
# (a model built outside a request), every value is checked.
BODY_SURROGATE_SCAN: ContextVar[BodySurrogateScan | None] = ContextVar(
    "kvflow_body_surrogate_scan", default=None
)


def check_unicode(value: Any) -> None:
    """ValueError if `value` (a JSON value) holds a string that is not valid Unicode: a lone surrogate, which
    JSON's `\\ud800`-style escapes can produce and UTF-8 cannot encode. Nothing to check when the request's body
    scan found no way to one (`BodySurrogateScan`: a large body of choices is not encoded twice).
    Otherwise containers are checked by encoding them (C speed: a prompt of token ids costs microseconds), strings
    directly."""
    scan = BODY_SURROGATE_SCAN.get()
    if scan is not None and not scan.possible:
        return
    if isinstance(value, str):
        _check_text(value)
    elif isinstance(value, list | dict):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except (
            RecursionError,
            ValueError,
            TypeError,
        ):  # a bad text (UnicodeEncodeError), or too deep
            _check_strings_in(value)  # says which text, and where


def _check_strings_in(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"holds text that is not valid Unicode (the lone surrogate {text[error.start]!r} at "
            f"character {error.start}); send text as UTF-8"
        ) from None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}` (`code` is the HTTP status)."""

    error: ErrorInfo


class StreamOptions(BaseModel):
    """`include_usage`: a last chunk with `usage` and no choices; `continuous_usage_stats` (vLLM): `usage` on every
    chunk too (only with `include_usage`)."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None


class UsageInfo(BaseModel):
    """Token counts of one response: each prompt counts once (not once per sample); `cached_tokens` are prompt
    tokens served from the prefix cache."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class Logprob(BaseModel):
    """One entry of vLLM's `prompt_logprobs`: `{token_id: {"logprob", "rank", "decoded_token"}}`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]


class JsonSchemaResponseFormat(OpenAIBaseModel):
    """`response_format.json_schema`, OpenAI's shape: the schema is under `schema`; `strict` is taken and needs no
    action (a constrained output always follows the schema)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON object), `json_schema` (a JSON
    value valid under `json_schema.schema`), or vLLM's `structural_tag` (the whole object is xgrammar's structural
    tag, e.g. `{"type": "structural_tag", "format": {...}}`; its other keys are kept in `model_extra`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None


class SamplingFields(OpenAIBaseModel):
    """The sampling fields /v1/completions and /v1/chat/completions share (None: the model's default)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    priority: int = 0
    request_id: str | None = None
    # Structured outputs: at most one of these sets a constraint (`serving_engine.request_controls`).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams' keys
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    # Taken when it names the server's backend (or "auto"); there are no per-request backends.
    guided_decoding_backend: str | None = None
    # Logits controls and prompt truncation (vLLM's extra fields).
    bad_words: list[str] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    truncate_prompt_tokens: int | None = None
    # Declared, refused until implemented unless "off" (unsupported.py).
    guided_whitespace_pattern: str | None = None
    logits_processors: list[Any] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0


# ---------------------------------------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids, or a list of such lists;
    token ids are used as given (no BOS is added)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    prompt_embeds: str | list[str] | None = None  # refused (unsupported.py)


class CompletionLogProbs(BaseModel):
    """Parallel lists, one entry per token: its text, logprob, the most likely tokens (`{text: logprob}`, the
    chosen token included) and its character offset in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(CompletionResponseChoice):
    """A streamed chunk's choice: the same fields, holding the newest piece (OpenAI's and vLLM's name for it)."""


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------------- chat


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. `messages` and the template fields are checked by the chat renderer
    (`kvflow.tokenizer.chat`)."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Tool calling (`tool_calls.py`): OpenAI function tools; tool_choice "none" | "auto" | "required" | a named
    # function ({"type": "function", "function": {"name": ...}}); None means "auto" with tools, else "none".
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated tools: refused
    function_call: str | dict[str, Any] | None = None
    # vLLM's extra chat fields
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = (
        True  # with --reasoning-parser: false drops the reasoning from the response
    )


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    """One call in `message.tool_calls`: `id` is what a `tool` message's `tool_call_id` answers."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """The assistant's reply: `content` is the text outside reasoning and tool calls (None when there is none
    and the reply made calls); `reasoning` (and `reasoning_content`, its older name, which clients still read)
    the text inside the reasoning markers, with `--reasoning-parser`."""

    role: str
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    """One choice; `unmet_tool_choice` (kvflow's, set only then) explains why a forced tool choice made no call."""

    model_config = ConfigDict(extra="allow")

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    """A call's first delta has `name` (and maybe arguments); later ones only pieces of `arguments`."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of call `index` of a streamed reply; `id` and `type` come on its first piece only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """A streamed piece of the reply. Chunks are sent with only the fields that were set (`exclude_unset`)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


# ---------------------------------------------------------------------------------------------------- models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvflow"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------------------------------- tokenization


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: either `prompt` (text, special tokens added by default) or `messages` (rendered with the
    chat template, special tokens not added again by default), like vLLM's two request forms."""

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---------------------------------------------------------------------------------------------------- control


class AbortRequestsRequest(OpenAIBaseModel):
    """POST /abort_requests: ids as the client knows them (its X-Request-Id, or a response's `id`); none: all."""

    request_ids: list[str] | None = None


class UpdateWeightsRequest(OpenAIBaseModel):
    path: str


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter (vLLM's body): register the PEFT adapter folder `lora_path` as model
    `lora_name`; `load_inplace` replaces an adapter already registered under that name."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body): the adapter by `lora_name`, or by `lora_int_id`."""

    lora_name: str | None = None
    lora_int_id: int | None = None


class CollectiveRpcRequest(OpenAIBaseModel):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
