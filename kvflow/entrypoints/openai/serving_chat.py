"""POST /v1/chat/completions: the conversation is rendered by the one chat renderer (`chat_prompt.py` over
`kvflow.tokenizer.chat`: the request's `chat_template`, the server's `--chat-template`, or the checkpoint's),
tokenized without adding special tokens again (the template places them), and generated from.

Content given as a list of parts must be text parts; they are joined with newlines, as vLLM does for templates that
expect string content. `continue_final_message` continues the last message instead of starting a new one. Tool calls
are not parsed: `tools` reach the template, `tool_choice` must be "none".
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvflow.entrypoints.openai.chat_prompt import ChatPromptRenderer
from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.logprobs import (
    chat_logprobs,
    output_positions,
    prompt_logprobs_body,
)
from kvflow.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from kvflow.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    SSE_DONE,
    OpenAIServing,
    PromptInput,
    bounded_stream,
    cached_tokens,
    make_usage,
    raise_if_failed,
    run_until_disconnected,
    sse_event,
    stream_error_event,
)

if TYPE_CHECKING:
    from fastapi import Request

    from kvflow.outputs import CompletionOutput

_FIELDS = frozenset(ChatCompletionRequest.model_fields)
ASSISTANT = "assistant"


class OpenAIServingChat(OpenAIServing):
    """Serves /v1/chat/completions (streamed as server-sent events, or whole)."""

    aliases = {"prompt_token_ids": "messages", "prompt": "messages", "logprobs": "top_logprobs"}

    def __init__(
        self, *args: Any, chat_prompt: ChatPromptRenderer | None = None, **kwargs: Any
    ) -> None:
        """`OpenAIServing`'s arguments, and `chat_prompt`: how conversations become prompt text (default: the
        checkpoint's templates only, request templates refused)."""
        super().__init__(*args, **kwargs)
        self.chat_prompt = (
            chat_prompt if chat_prompt is not None else ChatPromptRenderer(self.tokenizer)
        )

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        self.check_request(request)
        _check_chat_fields(request)
        request_id = self.request_id(raw_request, request.request_id)
        prompt = await self._prompt(request)
        response_id = f"chatcmpl-{request_id}"
        echo = _echo_text(request)
        if request.stream:
            return StreamingResponse(
                bounded_stream(
                    self._stream(request, request_id, response_id, prompt, echo),
                    self.limits.max_stream_buffer_bytes,
                    request_id,
                ),
                media_type="text/event-stream",
            )
        response = await run_until_disconnected(
            raw_request, self._complete(request, request_id, response_id, prompt, echo)
        )
        if response is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(response.model_dump())

    # ------------------------------------------------------------------------------------------------ prompt
    async def _prompt(self, request: ChatCompletionRequest) -> PromptInput:
        text = await self.chat_prompt.render(
            request.messages,
            chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tools=request.tools,
        )
        token_ids = await self.encode(text, request.add_special_tokens)
        if request.max_completion_tokens is not None:
            max_tokens_param, requested = "max_completion_tokens", request.max_completion_tokens
        else:
            max_tokens_param, requested = "max_tokens", request.max_tokens
        aliases = {**self.aliases, "max_tokens": max_tokens_param}
        params = self.sampling_params(
            request,
            max_tokens=self.max_tokens(requested, len(token_ids), max_tokens_param, "messages"),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
            fields=_FIELDS,
            aliases=aliases,
        )
        return self.process(text, token_ids, params, _FIELDS, aliases)

    # ------------------------------------------------------------------------------------------------ whole
    async def _complete(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        response_id: str,
        prompt: PromptInput,
        echo: str,
    ) -> ChatCompletionResponse:
        final = None
        async for _, output in self.generate(request_id, [prompt], request.priority):
            raise_if_failed(output)
            final = output  # "final_only": the one output
        assert final is not None
        choices = [
            ChatCompletionResponseChoice(
                index=output.index,
                message=ChatMessage(role=ASSISTANT, content=echo + output.text),
                logprobs=self._logprobs(request, output),
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
                token_ids=list(output.token_ids) if request.return_token_ids else None,
            )
            for output in sorted(final.outputs, key=lambda output: output.index)
        ]
        return ChatCompletionResponse(
            id=response_id,
            model=self.models.served_model_name,
            choices=choices,
            usage=make_usage(
                len(prompt.token_ids),
                sum(len(output.token_ids) for output in final.outputs),
                cached_tokens(final),
            ),
            prompt_logprobs=prompt_logprobs_body(getattr(final, "prompt_logprobs", None))
            if request.prompt_logprobs is not None
            else None,
            prompt_token_ids=prompt.token_ids if request.return_token_ids else None,
        )

    def _logprobs(self, request: ChatCompletionRequest, output: CompletionOutput) -> Any:
        if not request.logprobs:
            return None
        return chat_logprobs(
            output.token_ids,
            output_positions(output),
            request.top_logprobs or 0,
            self.token_texts(request),
        )

    # ------------------------------------------------------------------------------------------------ stream
    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        response_id: str,
        prompt: PromptInput,
        echo: str,
    ) -> AsyncGenerator[str, None]:
        """Server-sent events: per choice a first chunk with the role (and the echoed text), then one chunk per new
        piece, the last carrying `finish_reason`; the usage chunk if asked for; `[DONE]`."""
        created = int(time.time())
        num_tokens = [0] * request.n
        num_prompt_tokens = len(prompt.token_ids)
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
        num_cached = 0
        started = False
        try:
            async for _, result in self.generate(request_id, [prompt], request.priority):
                raise_if_failed(result)
                num_cached = cached_tokens(result)
                if not started:
                    started = True
                    for index in range(request.n):
                        chunk = self._chunk(
                            response_id, created, index, DeltaMessage(role=ASSISTANT, content="")
                        )
                        if request.return_token_ids:
                            chunk.prompt_token_ids = prompt.token_ids
                        if continuous_usage:
                            chunk.usage = make_usage(num_prompt_tokens, 0, num_cached)
                        yield sse_event(chunk)
                        if echo:
                            yield sse_event(
                                self._chunk(response_id, created, index, DeltaMessage(content=echo))
                            )
                for output in result.outputs:
                    if not output.text and not output.token_ids and output.finish_reason is None:
                        continue
                    num_tokens[output.index] += len(output.token_ids)
                    chunk = self._chunk(
                        response_id,
                        created,
                        output.index,
                        DeltaMessage(content=output.text),
                        logprobs=self._logprobs(request, output),
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                    )
                    if request.return_token_ids:
                        chunk.choices[0].token_ids = list(output.token_ids)
                    if continuous_usage:
                        chunk.usage = make_usage(
                            num_prompt_tokens, num_tokens[output.index], num_cached
                        )
                    yield sse_event(chunk)
            if include_usage:
                chunk = ChatCompletionStreamResponse(
                    id=response_id,
                    object="chat.completion.chunk",
                    created=created,
                    model=self.models.served_model_name,
                    choices=[],
                    usage=make_usage(num_prompt_tokens, sum(num_tokens), num_cached),
                )
                yield sse_event(chunk)
        except Exception as error:
            yield stream_error_event(error, request_id)
        yield SSE_DONE

    def _chunk(
        self,
        response_id: str,
        created: int,
        index: int,
        delta: DeltaMessage,
        logprobs: Any = None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=response_id,
            object="chat.completion.chunk",
            created=created,
            model=self.models.served_model_name,
            choices=[
                ChatCompletionResponseStreamChoice(
                    index=index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                )
            ],
        )


def _check_chat_fields(request: ChatCompletionRequest) -> None:
    """Refuse what kvflow cannot honour rather than ignore it."""
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise OpenAIServingError(
            "response_format other than {'type': 'text'} is not supported by kvflow",
            param="response_format",
        )
    if request.tools and request.tool_choice not in (None, "none"):
        raise OpenAIServingError(
            "kvflow does not parse tool calls: tool_choice must be 'none'", param="tool_choice"
        )
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIServingError(
            "when using top_logprobs, logprobs must be set to true", param="top_logprobs"
        )


def _echo_text(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's content, when that message is the assistant's (being continued)."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    content = last.get("content") if isinstance(last, dict) else None
    return content if last.get("role") == ASSISTANT and isinstance(content, str) else ""
