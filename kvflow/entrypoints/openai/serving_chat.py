"""POST /v1/chat/completions: the conversation is rendered with the checkpoint's chat template (or the request's
`chat_template`), tokenized without adding special tokens again (the template places them), and generated from.

Content given as a list of parts must be text parts; they are joined with newlines, as vLLM does for templates that
expect string content. Tool calls are not parsed: `tools` reach the template, `tool_choice` must be "none".
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

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
from kvflow.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from fastapi import Request

    from kvflow.entrypoints.openai.template_sandbox import TemplateSandbox
    from kvflow.outputs import CompletionOutput
    from kvflow.tokenizer import Tokenizer

_FIELDS = frozenset(ChatCompletionRequest.model_fields)
ASSISTANT = "assistant"
# Template variables the request sets through its own fields.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "chat_template"}
)


class OpenAIServingChat(OpenAIServing):
    """Serves /v1/chat/completions (streamed as server-sent events, or whole)."""

    aliases = {"prompt_token_ids": "messages", "prompt": "messages", "logprobs": "top_logprobs"}

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
        if self.tokenizer is None:
            raise OpenAIServingError(
                "this model has no tokenizer, so no chat template: use /v1/completions with token ids",
                param="messages",
            )
        text = await render_chat(
            self.tokenizer,
            request.messages,
            add_generation_prompt=request.add_generation_prompt,
            chat_template=request.chat_template,
            tools=request.tools,
            template_kwargs=request.chat_template_kwargs,
            template_sandbox=self.template_sandbox,
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
    if request.continue_final_message:
        raise OpenAIServingError(
            "continue_final_message is not supported by kvflow", param="continue_final_message"
        )
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIServingError(
            "when using top_logprobs, logprobs must be set to true", param="top_logprobs"
        )


async def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    template_sandbox: TemplateSandbox | None,
) -> str:
    """The prompt text of a conversation (what /v1/chat/completions and /tokenize both render); 400 naming
    `messages`, `chat_template`, `chat_template_kwargs` or `tools` when it cannot be rendered.

    The checkpoint's own templates (its default, or one of its named ones) render here. A template source sent by
    the client renders in `template_sandbox` (time, memory and output limits), and is refused without one, as
    vLLM refuses it without `--trust-request-chat-template`."""
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if reserved:
        raise OpenAIServingError(
            f"chat_template_kwargs may not set {reserved}: use the request's own fields",
            param="chat_template_kwargs",
        )
    trusted = tokenizer.is_named_chat_template(chat_template)
    if not trusted and template_sandbox is None:
        raise OpenAIServingError(
            "chat_template was passed with the request, but this server does not render request chat "
            "templates: start it with --trust-request-chat-template, or pass the name of one of the "
            "checkpoint's templates",
            param="chat_template",
        )
    try:
        if trusted:
            return tokenizer.apply_chat_template(
                text_messages(messages),
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                **(template_kwargs or {}),
            )
        source, variables = tokenizer.chat_template_inputs(
            text_messages(messages),
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            **(template_kwargs or {}),
        )
        assert template_sandbox is not None
        return await template_sandbox.render(source, variables)
    except ChatTemplateError as error:
        param = "chat_template" if chat_template is not None else "messages"
        raise OpenAIServingError(str(error), param=param) from error
    except ValueError as error:
        raise OpenAIServingError(str(error), param="messages") from error
    except TypeError as error:
        raise OpenAIServingError(str(error), param="tools") from error


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose content is a list of text parts get those texts joined by newlines (other part types are a
    400: kvflow serves text models); everything else passes through to the template's own checks."""
    result = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIServingError(
                        f"messages[{index}]: content parts of type {kind!r} are not supported "
                        "(text only)",
                        param="messages",
                    )
                texts.append(part.get("text"))
            if all(isinstance(text, str) for text in texts):
                message = {**message, "content": "\n".join(texts)}
        result.append(message)
    return result


def _echo_text(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's content, when that message is the assistant's (being continued)."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    content = last.get("content") if isinstance(last, dict) else None
    return content if last.get("role") == ASSISTANT and isinstance(content, str) else ""
