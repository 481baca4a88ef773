"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items, and POST /v1/responses/{id}/cancel.

A response is a chat completion in other clothes, and is served by the chat endpoint's parts: its input items
become chat messages (`responses_items`) that the one chat renderer turns into the prompt (with the tools, through
the chat template); the sampling fields, limits, structured-output constraint (`text.format`) and tool choice
(a forced call's constraint, or the `--tool-call-parser` for "auto") are checked and built by the same code as a
chat request's; the reply is split into reasoning, text and calls by the same `chat_reply.ReplyParser`, whole or as
it streams (`responses_stream`). The requests run under their live id (pause, `/abort_requests` and a client's
disconnect abort them as any other).

Status: "completed"; "incomplete" with `incomplete_details.reason` "max_output_tokens" when the reply was cut by
`max_output_tokens` (or the context); "cancelled" when the engine aborted it (a pause, `/abort_requests`, a
shutdown) or a background response was cancelled; "failed" with `error` when it failed in the engine.

Stored responses (`store`, true by default as in OpenAI; `response_store.ResponseStore`, bounded) can be read back,
deleted, and continued: `previous_response_id` prepends that response's conversation (its input, after its own
previous response's, then its output) to the new input; `instructions` are not carried over. `background: true`
returns at once with status "queued"; the response runs on and is read back with GET, or cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from kvflow.entrypoints.openai.chat_reply import ReplyParser
from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol_responses import ResponsesRequest
from kvflow.entrypoints.openai.response_store import ResponseStore, StoredResponse
from kvflow.entrypoints.openai.responses_items import (
    chat_tool_choice,
    chat_tools,
    input_item_list,
    input_messages,
    output_items,
    output_messages,
    response_tools,
    text_response_format,
)
from kvflow.entrypoints.openai.responses_stream import ResponseEvents
from kvflow.entrypoints.openai.serving_chat import OpenAIServingChat
from kvflow.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    PromptInput,
    RequestControls,
    cached_tokens,
    raise_if_failed,
    run_until_disconnected,
)
from kvflow.entrypoints.openai.streaming import sse_response
from kvflow.entrypoints.openai.tool_calls import ToolChoice, resolve_tool_choice
from kvflow.entrypoints.openai.unsupported import UnsupportedField
from kvflow.utils import short_repr

if TYPE_CHECKING:
    from fastapi import Request

    from kvflow.lora.request import LoRARequest
    from kvflow.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

_FIELDS = frozenset(ResponsesRequest.model_fields)
RESPONSE_ID_PREFIX = "resp_"
# OpenAI's bounds on `metadata`.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_INPUT_ITEMS_PAGE = 100


def _off(*values: object) -> Any:
    return lambda value, _: value is None or value in values


# The fields /v1/responses declares (its own, or shared with chat) that do nothing here yet: a 400 naming each
# unless off (unsupported.py's rule).
RESPONSES_UNSUPPORTED: tuple[UnsupportedField, ...] = (
    UnsupportedField("n", _off(1), "a response has one output; send several requests"),
    UnsupportedField(
        "response_format",
        _off(),
        "on /v1/responses the output format is text.format ({'format': {'type': 'json_schema', ...}})",
    ),
    UnsupportedField("use_beam_search", _off(False), "beam search is served on /v1/completions"),
    UnsupportedField("prompt_logprobs", _off(), "a response has no place for prompt logprobs"),
    UnsupportedField("return_token_ids", _off(False), "a response has no place for token ids"),
    UnsupportedField(
        "return_tokens_as_token_ids", _off(False), "a response carries no logprobs yet"
    ),
    UnsupportedField(
        "include",
        lambda value, _: set(value or ()) <= {"reasoning.encrypted_content"},
        "kvflow returns no logprobs, images or tool sources in responses yet (it takes "
        "'reasoning.encrypted_content': its reasoning items carry their text in content, which it reads back)",
    ),
    UnsupportedField(
        "reasoning",
        lambda value, _: not value or all(v is None for v in value.values()),
        "kvflow sets no reasoning effort and writes no summaries; with --reasoning-parser the model's own "
        "reasoning comes back as reasoning items",
    ),
    UnsupportedField(
        "truncation", _off("disabled"), "a prompt too long for the context is a 400, never cut"
    ),
    UnsupportedField("top_logprobs", _off(0), "a response carries no logprobs yet"),
    UnsupportedField("max_tool_calls", _off(), "the number of calls is not bounded"),
    UnsupportedField("prompt", _off(), "kvflow keeps no prompt templates; send the input"),
    UnsupportedField(
        "conversation", _off(), "kvflow keeps no conversations; use previous_response_id"
    ),
    UnsupportedField(
        "context_management", lambda value, _: not value, "kvflow does not compact context"
    ),
    UnsupportedField(
        "service_tier", _off("auto", "default"), "kvflow serves every request the same way"
    ),
    UnsupportedField(
        "stream_options",
        lambda value, _: value is None or set(value) <= {"include_obfuscation"},
        "on /v1/responses stream_options takes include_obfuscation only (and usage always comes with "
        "response.completed)",
    ),
)


class OpenAIServingResponses(OpenAIServingChat):
    """Serves /v1/responses with the chat endpoint's renderer, parsers and checks (it is one, with another
    request and answer shape).

    Invariants: every response this server answered with `store` true (or `background`) is in `store` until
    evicted or deleted, its body as last sent; a background response's body moves from "queued" through
    "in_progress" to a final status exactly once, and its task is the only writer of that body until then.
    """

    aliases = {"prompt_token_ids": "input", "prompt": "input", "max_tokens": "max_output_tokens"}

    def __init__(self, *args: Any, store: ResponseStore | None = None, **kwargs: Any) -> None:
        """`OpenAIServingChat`'s arguments, and `store`: where responses are kept (default: a store of its own
        with the default bound)."""
        super().__init__(*args, **kwargs)
        self.store = store if store is not None else ResponseStore()

    # ------------------------------------------------------------------------------------------------ create
    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        lora_request = self.check_request(request)
        _check_responses_fields(request)
        conversation = self._conversation(request)
        tools = chat_tools(request.tools)
        tool_choice = resolve_tool_choice(
            tools,
            chat_tool_choice(request.tool_choice),
            request.parallel_tool_calls,
            self.auto_tool_choice,
        )
        # text.format, as the response_format the shared constraint checks read (the request's own one is refused)
        request.response_format = text_response_format(request.text)
        controls = self._with_tool_constraint(request, self._controls(request), tool_choice)
        request_id = self.request_id(raw_request, request.request_id)
        system = (
            [{"role": "system", "content": request.instructions}] if request.instructions else []
        )
        prompt = await self._render(request, [*system, *conversation], tools, controls, tool_choice)
        reply = self._reply_parser(tool_choice, prompt)
        model_name = self.models.model_name(lora_request)
        body = self._response_body(request, RESPONSE_ID_PREFIX + request_id, prompt, model_name)
        run = _Run(request, request_id, prompt, reply, conversation, lora_request)
        if request.background:
            return JSONResponse(self._start_background(run, body))
        if request.stream:
            return sse_response(
                self._stream(run, body), self.limits.max_stream_buffer_bytes, request_id
            )
        finished = await run_until_disconnected(raw_request, self._complete(run, body))
        if finished is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        self._keep(run, finished)
        return JSONResponse(finished)

    def _conversation(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        """The messages before the instructions: the previous response's conversation, then the input."""
        messages: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id, param="previous_response_id")
            if not previous.messages:
                raise OpenAIServingError(
                    f"previous_response_id {request.previous_response_id!r} has status "
                    f"{previous.body.get('status')!r}: only a completed or incomplete response can be "
                    "continued",
                    param="previous_response_id",
                )
            messages = list(previous.messages)
        return messages + input_messages(request.input)

    def _controls(self, request: ResponsesRequest) -> RequestControls:
        """The request's controls; a constraint error about `response_format` is about `text.format` (the
        request's own spelling of it)."""
        try:
            return self.request_controls(request)
        except OpenAIServingError as error:
            if error.param != "response_format":
                raise
            message = error.message.replace(
                "response_format.json_schema.schema", "text.format.schema"
            )
            raise OpenAIServingError(
                message.replace("response_format", "text.format"), param="text"
            ) from error

    async def _render(
        self,
        request: ResponsesRequest,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        controls: RequestControls,
        tool_choice: ToolChoice,
    ) -> PromptInput:
        """The prompt (the chat template over `messages` and `tools`) and its sampling params."""
        try:
            text = await self.chat_prompt.render(
                messages, chat_template_kwargs=request.chat_template_kwargs, tools=tools
            )
        except OpenAIServingError as error:
            if error.param == "messages":
                error.param = "input"
            raise
        controls = self._thought_first(controls, tool_choice, text)
        token_ids = await self.encode(text, add_special_tokens=False)
        prompt_text, token_ids = self.truncate_prompt(text, token_ids, controls)
        params = self.sampling_params(
            request,
            max_tokens=self.max_tokens(
                request.max_output_tokens, len(token_ids), "max_output_tokens", "input"
            ),
            logprobs=None,
            prompt_logprobs=None,
            fields=_FIELDS,
            aliases=self.aliases,
            controls=controls,
        )
        parser = tool_choice.reply_parser(self.tool_parser)
        if parser is not None and parser.keeps_special_tokens:
            params.skip_special_tokens = False
        return self.process(prompt_text, token_ids, params, _FIELDS, self.aliases)

    def _response_body(
        self, request: ResponsesRequest, response_id: str, prompt: PromptInput, model_name: str
    ) -> dict[str, Any]:
        """The response as it starts (status "in_progress", no output), in OpenAI's `Response` shape; the
        sampling values are the ones the request runs with (the model's defaults where it set none)."""
        params = prompt.sampling_params
        text_format = (request.text or {}).get("format") or {"type": "text"}
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": request.background,
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": model_name,
            "output": [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "prompt_cache_key": request.prompt_cache_key,
            "reasoning": None,
            "safety_identifier": request.safety_identifier,
            "service_tier": request.service_tier or "default",
            "store": request.store,
            "temperature": params.temperature,
            "text": {"format": text_format},
            "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
            "tools": response_tools(request.tools),
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": request.user,
        }

    # ------------------------------------------------------------------------------------------------ whole
    async def _complete(self, run: _Run, body: dict[str, Any]) -> dict[str, Any]:
        final = await self._final_output(run)
        output = final.outputs[0]
        message = run.reply.parse(output.text)
        status = _status(output.finish_reason)
        items = output_items(message, "completed" if status == "completed" else "incomplete")
        if status in ("cancelled", "failed"):
            items = [
                item for item in items if item["type"] != "message" or item["content"][0]["text"]
            ]
        return self._finished(run, body, status, items, final, output.token_ids, output.text)

    async def _final_output(self, run: _Run) -> RequestOutput:
        final = None
        results = self.generate(
            run.request_id, [run.prompt], run.request.priority, run.lora_request
        )
        async with contextlib.aclosing(results):  # type: ignore[type-var]
            async for _, output in results:
                raise_if_failed(output)
                final = output  # "final_only": the one output
        assert final is not None
        return final

    def _finished(
        self,
        run: _Run,
        body: dict[str, Any],
        status: str,
        items: list[dict[str, Any]],
        final: RequestOutput | None,
        token_ids: Sequence[int],
        text: str,
    ) -> dict[str, Any]:
        """`body` finished with `status`, its output `items` and usage."""
        finished = {**body, "status": status, "output": items}
        if status == "incomplete":
            finished["incomplete_details"] = {"reason": "max_output_tokens"}
        finished["completed_at"] = int(time.time()) if status == "completed" else None
        num_output_tokens = len(token_ids)
        num_input_tokens = len(run.prompt.token_ids)
        finished["usage"] = {
            "input_tokens": num_input_tokens,
            "input_tokens_details": {
                "cached_tokens": cached_tokens(final) if final is not None else 0
            },
            "output_tokens": num_output_tokens,
            "output_tokens_details": {
                "reasoning_tokens": self._reasoning_tokens(run, token_ids, text)
            },
            "total_tokens": num_input_tokens + num_output_tokens,
        }
        return finished

    def _reasoning_tokens(self, run: _Run, token_ids: Sequence[int], text: str) -> int:
        """How many of the output's tokens are its reasoning (its end marker included): the shortest prefix whose
        text holds the end marker (found by bisection), all of them for a thought cut short, 0 without one."""
        parser = run.reply.reasoning
        if parser is None or self.tokenizer is None:
            return 0
        if not (run.reply.starts_in_reasoning or text.lstrip().startswith(parser.start_marker)):
            return 0
        if parser.end_marker not in text:
            return len(token_ids)
        skip = run.prompt.sampling_params.skip_special_tokens
        low, high = 1, len(token_ids)
        while low < high:
            middle = (low + high) // 2
            prefix = self.tokenizer.decode(token_ids[:middle], skip_special_tokens=skip)
            if parser.end_marker in prefix:
                high = middle
            else:
                low = middle + 1
        return low

    def _keep(self, run: _Run, finished: dict[str, Any]) -> None:
        """Store a finished response (if its request asked to), with the conversation it ended."""
        if run.request.store:
            stored = StoredResponse(finished, _messages_after(run, finished), _input_items(run))
            self.store.put(finished["id"], stored)

    # ------------------------------------------------------------------------------------------------ stream
    async def _stream(self, run: _Run, body: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        """The typed events of the response (`responses_stream`); a failure after the start ends the stream with
        response.failed. Closing the generator (a client gone) aborts the request."""
        events = ResponseEvents()
        for event in events.start(body):
            yield event
        stream = run.reply.stream()
        token_ids: list[int] = []
        text = ""
        final: RequestOutput | None = None
        finish_reason: str | None = None
        results = self.generate(
            run.request_id, [run.prompt], run.request.priority, run.lora_request
        )
        try:
            async with contextlib.aclosing(results):  # type: ignore[type-var]
                async for _, result in results:
                    raise_if_failed(result)
                    final = result
                    output: CompletionOutput = result.outputs[0]
                    token_ids += output.token_ids
                    text += output.text
                    released = stream.push(output.text)
                    if output.finish_reason is not None:
                        finish_reason = output.finish_reason
                        released = released.merge(stream.finish())
                    for event in events.push(released):
                        yield event
        except Exception as error:  # the stream has started: the error goes into response.failed
            failed = self._finished(run, body, "failed", [], final, token_ids, text)
            failed["error"] = _error_of(error, run.request_id)
            for event in events.finish(failed):
                yield event
            return
        finished = self._finished(run, body, _status(finish_reason), [], final, token_ids, text)
        last_events = events.finish(finished)  # sets the output
        self._keep(run, finished)  # before the client can read the end and ask for a follow-up
        for event in last_events:
            yield event

    # ------------------------------------------------------------------------------------------------ background
    def _start_background(self, run: _Run, body: dict[str, Any]) -> dict[str, Any]:
        """Store the response as "queued" and run it on its own task; returns the queued body."""
        if not run.request.store:
            raise OpenAIServingError(
                "background responses must be stored (they are read back with GET /v1/responses/{id}): "
                "drop store: false",
                param="background",
            )
        if run.request.stream:
            raise OpenAIServingError(
                "kvflow does not stream background responses: send stream: false and read the response "
                "back with GET /v1/responses/{id}",
                param="background",
            )
        queued = {**body, "status": "queued"}
        stored = StoredResponse(queued, input_items=_input_items(run))
        self.store.put(queued["id"], stored)
        stored.task = asyncio.ensure_future(self._run_background(run, stored))
        return queued

    async def _run_background(self, run: _Run, stored: StoredResponse) -> None:
        stored.body = {**stored.body, "status": "in_progress"}
        try:
            finished = await self._complete(run, stored.body)
        except asyncio.CancelledError:
            stored.body = {**stored.body, "status": "cancelled"}
            raise
        except Exception as error:
            failed = self._finished(run, stored.body, "failed", [], None, [], "")
            failed["error"] = _error_of(error, run.request_id)
            stored.body = failed
            return
        stored.body, stored.messages = finished, _messages_after(run, finished)

    # ------------------------------------------------------------------------------------------------ by id
    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).body

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancel a background response that is queued or running (its request is aborted); one already
        cancelled is returned as it is. 400 for a response that was not created with `background: true`, or
        that has finished otherwise."""
        stored = self.store.get(response_id)
        if stored.task is None:
            raise OpenAIServingError(
                f"response {response_id!r} was not created with background: true, and only background "
                "responses can be cancelled"
            )
        if stored.running:
            stored.task.cancel()
            await asyncio.gather(stored.task, return_exceptions=True)
        elif stored.body.get("status") != "cancelled":
            raise OpenAIServingError(
                f"response {response_id!r} has already finished (status {stored.body.get('status')!r}); only "
                "a queued or in-progress response can be cancelled"
            )
        return stored.body

    def input_items(self, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        """One page of a stored response's input items (OpenAI's list: `after` an item id, `limit` 1 to 100,
        default 20, `order` "desc" (the default) or "asc"); any other query parameter is a 400 naming it."""
        unknown = sorted(set(query) - {"after", "limit", "order"})
        if unknown:
            raise OpenAIServingError(
                f"{unknown[0]} is not supported by kvflow on input_items (it takes after, limit and order)",
                param=unknown[0],
            )
        order, after = query.get("order", "desc"), query.get("after")
        if order not in ("asc", "desc"):
            raise OpenAIServingError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_INPUT_ITEMS_PAGE:
            raise OpenAIServingError(
                f"limit must be an integer from 1 to {MAX_INPUT_ITEMS_PAGE}, got {query.get('limit')!r}",
                param="limit",
            )
        items = self.store.get(response_id).input_items
        items = items if order == "asc" else items[::-1]
        start = 0
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise OpenAIServingError(
                    f"after={after!r} is not an input item of response {response_id!r}",
                    param="after",
                )
            start = ids.index(after) + 1
        page = items[start : start + limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(items),
        }

    async def delete(self, response_id: str) -> dict[str, Any]:
        """Forget a stored response (cancelling it first if it runs in the background)."""
        stored = self.store.delete(response_id)
        if stored.task is not None and not stored.task.done():
            stored.task.cancel()
            await asyncio.gather(stored.task, return_exceptions=True)
        return {"id": response_id, "object": "response", "deleted": True}


@dataclass(frozen=True)
class _Run:
    """What one response runs with: its request, live request id, prompt, reply parser, the conversation before
    its instructions (previous response and input), and its adapter."""

    request: ResponsesRequest
    request_id: str
    prompt: PromptInput
    reply: ReplyParser
    conversation: list[dict[str, Any]]
    lora_request: LoRARequest | None


def _check_responses_fields(request: ResponsesRequest) -> None:
    """400 naming the first field of `RESPONSES_UNSUPPORTED` sent on, or `metadata` past OpenAI's bounds."""
    for field in RESPONSES_UNSUPPORTED:
        value = getattr(request, field.name)
        if not field.is_off(value, request):
            raise OpenAIServingError(
                f"{field.name} is not supported on /v1/responses by kvflow: {field.why}",
                param=field.name,
            )
    _check_metadata(request.metadata)


def _check_metadata(metadata: Mapping[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise OpenAIServingError(
            f"metadata holds {len(metadata)} keys; at most {MAX_METADATA_KEYS}", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise OpenAIServingError(
                f"metadata key {short_repr(key)}: keys take at most {MAX_METADATA_KEY_CHARS} characters, "
                f"values {MAX_METADATA_VALUE_CHARS}",
                param="metadata",
            )


def _input_items(run: _Run) -> list[dict[str, Any]]:
    return input_item_list(run.request.input)


def _messages_after(run: _Run, finished: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation a finished response leaves for a follow-up (none for one that was cancelled or failed:
    it cannot be continued)."""
    if finished["status"] not in ("completed", "incomplete"):
        return []
    return [*run.conversation, *output_messages(finished["output"])]


def _status(finish_reason: str | None) -> str:
    """A response's status from its output's finish reason."""
    if finish_reason == "length":
        return "incomplete"
    if finish_reason == "abort":
        return "cancelled"
    return "completed"


def _error_of(error: BaseException, request_id: str) -> dict[str, Any]:
    """A failed response's `error` (OpenAI's `ResponseError`): the client's fault or the server's."""
    if (
        isinstance(error, OpenAIServingError)
        and error.status_code < HTTPStatus.INTERNAL_SERVER_ERROR
    ):
        return {"code": "invalid_prompt", "message": error.message, "param": error.param}
    logger.error("response of request %s failed", request_id, exc_info=error)
    return {"code": "server_error", "message": f"{type(error).__name__}: {error}"}
