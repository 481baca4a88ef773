"""The body of POST /v1/responses (OpenAI's Responses API, as vLLM serves it) and the objects it answers with.

The request shares the sampling fields of the chat endpoint (`protocol.SamplingFields`: `temperature`, `top_p`,
`user`, `stream`, and vLLM's extra fields such as `top_k`, `seed`, `stop` or `structured_outputs`), so the one
sampling-parameter builder, limit checks and structured-output checks of `serving_engine` serve it. Its own fields
are OpenAI's: `input` (a string, or a list of items: messages, `function_call`, `function_call_output` and
`reasoning` items), `instructions`, `max_output_tokens`, `text.format`, `tools` in the Responses' flat shape,
`tool_choice`, `store`, `previous_response_id`, `background`, `metadata`. The fields of OpenAI's schema kvflow does
not implement, and the chat-only fields this endpoint has no place for (`n`, `response_format`, ...), are refused
by `serving_responses` unless "off" (a 400 naming them), as everywhere else in the server.

The answer (`Response`) and its output items are built as plain dicts in OpenAI's shapes (`response_items`), the
same dicts the streamed events carry.
"""

from __future__ import annotations

from typing import Any

from kvflow.entrypoints.openai.protocol import SamplingFields


class ResponsesRequest(SamplingFields):
    """POST /v1/responses. `input` items and `tools` are checked where they are turned into chat messages and
    tool choices (`serving_responses`), which name the field at fault."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    # {"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity": ...}
    text: dict[str, Any] | None = None
    # Responses' function tools: {"type": "function", "name", "description", "parameters", "strict"}.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    # vLLM's chat field: keyword arguments for the chat template (e.g. {"enable_thinking": false} for Qwen3's).
    chat_template_kwargs: dict[str, Any] | None = None
    # Taken: they change nothing kvflow generates (a cache routing hint, an end user's id, the billing tier).
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # Declared, refused unless off (serving_responses.RESPONSES_UNSUPPORTED).
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    # OpenAI's Responses stream options ({"include_obfuscation": bool}); obfuscation pads events with random text
    # against side channels, which kvflow's events do not need: the key is taken either way.
    stream_options: dict[str, Any] | None = None  # type: ignore[assignment]
