"""POST /v1/chat/completions: the conversation is rendered by the one chat renderer (`chat_prompt.py` over
`kvflow.tokenizer.chat`: the request's `chat_template`, the server's `--chat-template`, or the checkpoint's),
tokenized without adding special tokens again (the template places them), and generated from.

Content given as a list of parts must be text parts; they are joined with newlines, as vLLM does for templates that
expect string content. `continue_final_message` continues the last message instead of starting a new one.

Tool calling (`tool_calls.py`) and reasoning output (`--reasoning-parser`): the request's tool choice may set a
structured-output constraint (a forced call), and its reply is split into reasoning, content and tool calls by one
`chat_reply.ReplyParser`, whole or as it streams; a reply that made calls and ended by itself finishes with
"tool_calls".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from kvflow.entrypoints.openai.chat_prompt import ChatPromptRenderer
from kvflow.entrypoints.openai.chat_reply import ReplyParser, ReplyStream, finish_reason
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
    ChatMessage,
    DeltaMessage,
)
from kvflow.entrypoints.openai.serving_beam_search import beam_search_results
from kvflow.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    OpenAIServing,
    PromptInput,
    RequestControls,
    cached_tokens,
    make_usage,
    raise_if_failed,
    run_until_disconnected,
)
from kvflow.entrypoints.openai.streaming import (
    StreamChunk,
    StreamUsage,
    chunk_body,
    sse_response,
    sse_stream,
)
from kvflow.entrypoints.openai.thought_first import thought_then_call
from kvflow.entrypoints.openai.tool_calls import ToolChoice, resolve_tool_choice
from kvflow.structured_output.validation import validate_structured_outputs

if TYPE_CHECKING:
    from fastapi import Request

    from kvflow.entrypoints.openai.tool_parsers import ToolParser
    from kvflow.lora.request import LoRARequest
    from kvflow.outputs import CompletionOutput, RequestOutput
    from kvflow.reasoning import ReasoningParser

_FIELDS = frozenset(ChatCompletionRequest.model_fields)
ASSISTANT = "assistant"
CHUNK_OBJECT = "chat.completion.chunk"


class OpenAIServingChat(OpenAIServing):
    """Serves /v1/chat/completions (streamed as server-sent events, or whole)."""

    aliases = {"prompt_token_ids": "messages", "prompt": "messages", "logprobs": "top_logprobs"}

    def __init__(
        self,
        *args: Any,
        chat_prompt: ChatPromptRenderer | None = None,
        tool_parser: ToolParser | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: ReasoningParser | None = None,
        **kwargs: Any,
    ) -> None:
        """`OpenAIServing`'s arguments, and `chat_prompt`: how conversations become prompt text (default: the
        checkpoint's templates only, request templates refused); `tool_parser` (`--tool-call-parser`) and
        `enable_auto_tool_choice` (both needed for tool_choice "auto"); `reasoning_parser`
        (`--reasoning-parser`)."""
        super().__init__(*args, **kwargs)
        self.chat_prompt = (
            chat_prompt if chat_prompt is not None else ChatPromptRenderer(self.tokenizer)
        )
        self.tool_parser = tool_parser
        self.auto_tool_choice = enable_auto_tool_choice and tool_parser is not None
        self.reasoning_parser = reasoning_parser

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        lora_request = self.check_request(request)
        _check_chat_fields(request)
        tool_choice = resolve_tool_choice(
            request.tools, request.tool_choice, request.parallel_tool_calls, self.auto_tool_choice
        )
        controls = self._with_tool_constraint(request, self.request_controls(request), tool_choice)
        request_id = self.request_id(raw_request, request.request_id)
        prompt = await self._prompt(request, controls, tool_choice)
        reply = self._reply_parser(tool_choice, prompt, request.include_reasoning)
        response_id = f"chatcmpl-{request_id}"
        echo = _echo_text(request)
        if request.stream:
            return sse_response(
                self._stream(request, request_id, response_id, prompt, echo, reply, lora_request),
                self.limits.max_stream_buffer_bytes,
                request_id,
            )
        if request.use_beam_search:  # never streamed (unsupported.BEAM_SEARCH_FIELDS)
            results = beam_search_results(self, request, request_id, [prompt], lora_request)
        else:
            results = self.generate(request_id, [prompt], request.priority, lora_request)
        model_name = self.models.model_name(lora_request)
        response = await run_until_disconnected(
            raw_request,
            self._complete(request, response_id, prompt, echo, reply, results, model_name),
        )
        if response is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(response.model_dump())

    # ------------------------------------------------------------------------------------------------ tools
    def _with_tool_constraint(
        self, request: ChatCompletionRequest, controls: RequestControls, tool_choice: ToolChoice
    ) -> RequestControls:
        """The request's controls with a forced call's constraint ("required" or a named function), which
        excludes any other constraint (a 400 naming both)."""
        constraint = tool_choice.constraint()
        if constraint is None:
            return controls
        if controls.structured_outputs is not None:
            raise OpenAIServingError(
                f"tool_choice {tool_choice.mode!r} constrains the reply to a tool call, and the request sets "
                "another structured-output constraint (response_format, structured_outputs or guided_*): "
                "send one of them",
                param="tool_choice",
            )
        if not self.engine.input_processor.limits.has_logits:
            raise OpenAIServingError(
                f"tool_choice {tool_choice.mode!r} constrains decoding, which needs the model's logits, and "
                "this model has none (the hash model samples its own tokens)",
                param="tool_choice",
            )
        try:
            validate_structured_outputs(constraint, self.structured_outputs_config)
        except ValueError as error:
            raise OpenAIServingError(
                f"the tools' parameters schemas cannot constrain a forced call: {error}",
                param="tools",
            ) from error
        return dataclasses.replace(controls, structured_outputs=constraint)

    def _thought_first(
        self, controls: RequestControls, tool_choice: ToolChoice, prompt_text: str
    ) -> RequestControls:
        """A forced call's constraint for a prompt that does not open the thought, under a reasoning parser whose
        constraints start after the reasoning: an optional thought, then the call (`thought_first`). Kept as it
        is elsewhere, and where the backend cannot compile that (guidance takes no structural tag)."""
        reasoning, constraint = self.reasoning_parser, tool_choice.constraint()
        if (
            reasoning is None
            or constraint is None
            or not self.structured_outputs_config.constrains_after_reasoning
            or reasoning.starts_in_reasoning(prompt_text)
        ):
            return controls
        thinking = thought_then_call(constraint, reasoning.start_marker, reasoning.end_marker)
        try:
            validate_structured_outputs(thinking, self.structured_outputs_config)
        except ValueError:
            return controls
        return dataclasses.replace(controls, structured_outputs=thinking)

    def _reply_parser(
        self, tool_choice: ToolChoice, prompt: PromptInput, include_reasoning: bool = True
    ) -> ReplyParser:
        """How the reply is read back: reasoning (from where the prompt leaves the model), content and tool
        calls, with the forced call `unmet_tool_choice` names (chat completions and responses alike)."""
        reasoning = self.reasoning_parser
        starts_in_reasoning = (
            reasoning is not None
            and prompt.text is not None
            and reasoning.starts_in_reasoning(prompt.text)
        )
        return ReplyParser(
            reasoning,
            starts_in_reasoning,
            tool_choice.reply_parser(self.tool_parser),
            parallel=tool_choice.parallel,
            include_reasoning=include_reasoning,
            forced_call=tool_choice.forced_call(),
        )

    # ------------------------------------------------------------------------------------------------ prompt
    async def _prompt(
        self, request: ChatCompletionRequest, controls: RequestControls, tool_choice: ToolChoice
    ) -> PromptInput:
        text = await self.chat_prompt.render(
            request.messages,
            chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tools=request.tools,
        )
        controls = self._thought_first(controls, tool_choice, text)
        token_ids = await self.encode(text, request.add_special_tokens)
        prompt_text, token_ids = self.truncate_prompt(text, token_ids, controls)
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
            controls=controls,
        )
        parser = tool_choice.reply_parser(self.tool_parser)
        if parser is not None and parser.keeps_special_tokens:
            params.skip_special_tokens = (
                False  # the call markers are special tokens (mistral's [TOOL_CALLS])
            )
        return self.process(prompt_text, token_ids, params, _FIELDS, aliases)

    # ------------------------------------------------------------------------------------------------ whole
    async def _complete(
        self,
        request: ChatCompletionRequest,
        response_id: str,
        prompt: PromptInput,
        echo: str,
        reply: ReplyParser,
        results: AsyncIterator[tuple[int, RequestOutput]],
        model_name: str,
    ) -> ChatCompletionResponse:
        """The whole response from `results`, naming `model_name` (the adapter's name for a request that ran with
        one)."""
        final = None
        async for _, output in results:
            raise_if_failed(output)
            final = output  # "final_only": the one output
        assert final is not None
        choices = []
        for output in sorted(final.outputs, key=lambda output: output.index):
            message = (
                ChatMessage(role=ASSISTANT, content=echo + output.text)
                if reply.is_plain
                else reply.parse(output.text, echo)
            )
            unmet = reply.unmet_tool_choice(
                output.text, bool(message.tool_calls), output.finish_reason
            )
            choices.append(
                ChatCompletionResponseChoice(
                    **({"unmet_tool_choice": unmet} if unmet else {}),
                    index=output.index,
                    message=message,
                    logprobs=self.logprobs(request, output),
                    finish_reason=finish_reason(output.finish_reason, bool(message.tool_calls)),
                    stop_reason=output.stop_reason,
                    token_ids=list(output.token_ids) if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=response_id,
            model=model_name,
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

    def logprobs(self, request: ChatCompletionRequest, output: CompletionOutput) -> Any:
        if not request.logprobs:
            return None
        return chat_logprobs(
            output.token_ids,
            output_positions(output),
            request.top_logprobs or 0,
            self.token_texts(request),
        )

    # ------------------------------------------------------------------------------------------------ stream
    def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        response_id: str,
        prompt: PromptInput,
        echo: str,
        reply: ReplyParser,
        lora_request: LoRARequest | None,
    ) -> AsyncGenerator[bytes, None]:
        """Server-sent events (`sse_stream`): per choice a first chunk with the role (and one with the echoed
        text), then one chunk per new piece, the last carrying `finish_reason`."""
        created = int(time.time())
        model_name = self.models.model_name(lora_request)
        return sse_stream(
            self.generate(request_id, [prompt], request.priority, lora_request),
            request_id=request_id,
            stream_options=request.stream_options,
            usage=StreamUsage([len(prompt.token_ids)], request.n),
            build_chunks=_ChatChunks(
                self, request, response_id, created, prompt, echo, reply, model_name
            ),
            usage_chunk=lambda: chunk_body(response_id, CHUNK_OBJECT, created, model_name, []),
        )

    def stream_chunk(
        self,
        response_id: str,
        created: int,
        model_name: str,
        index: int,
        delta: dict[str, Any] | DeltaMessage,
        logprobs: Any = None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        """A `ChatCompletionStreamResponse` with one choice, as the dict `sse_event` sends (the choice's keys in
        `ChatCompletionResponseStreamChoice`'s order; `delta` a `DeltaMessage` or its dict)."""
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        return chunk_body(response_id, CHUNK_OBJECT, created, model_name, [choice])


def _check_chat_fields(request: ChatCompletionRequest) -> None:
    """The chat-only field combinations that are errors (the unimplemented fields: `unsupported.py`)."""
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIServingError(
            "when using top_logprobs, logprobs must be set to true", param="top_logprobs"
        )


class _ChatChunks:
    """The chunk builder of one streamed chat completion (`sse_stream`'s `build_chunks`).

    Invariant: the first output of the request opens every choice, each with a chunk holding the role (and, with
    `echo`, one holding the echoed text) before any of its content.
    """

    def __init__(
        self,
        serving: OpenAIServingChat,
        request: ChatCompletionRequest,
        response_id: str,
        created: int,
        prompt: PromptInput,
        echo: str,
        reply: ReplyParser,
        model_name: str,
    ) -> None:
        self.serving = serving
        self.model_name = model_name
        self.request = request
        self.response_id = response_id
        self.created = created
        self.prompt = prompt
        self.echo = echo
        self.reply = reply
        self.streams: dict[int, ReplyStream] = {}
        self.started = False

    def __call__(self, _: int, result: RequestOutput) -> Iterator[StreamChunk]:
        if not self.started:
            self.started = True
            yield from self._openings()
        for output in result.outputs:
            if not output.text and not output.token_ids and output.finish_reason is None:
                continue
            delta, finish = self._delta(output)
            chunk = self._chunk(
                output.index,
                delta,
                logprobs=self.serving.logprobs(self.request, output),
                finish_reason=finish,
                stop_reason=output.stop_reason,
            )
            if self.request.return_token_ids:
                chunk["choices"][0]["token_ids"] = list(output.token_ids)
            stream = self.streams.get(output.index)
            unmet = stream.unmet_tool_choice(output.finish_reason) if stream else None
            if unmet:
                chunk["choices"][0]["unmet_tool_choice"] = unmet
            yield StreamChunk(chunk, output.index, len(output.token_ids))

    def _delta(self, output: CompletionOutput) -> tuple[dict[str, Any] | DeltaMessage, str | None]:
        """The output's delta and finish_reason, through the reply parser when there is one to run."""
        if self.reply.is_plain:
            return {"content": output.text}, output.finish_reason
        stream = self.streams.get(output.index)
        if stream is None:
            stream = self.streams[output.index] = self.reply.stream()
        released = stream.push(output.text)
        if output.finish_reason is not None:
            released = released.merge(stream.finish())
        finish = finish_reason(output.finish_reason, stream.made_calls)
        return released.message(self.reply.include_reasoning), finish

    def _openings(self) -> Iterator[StreamChunk]:
        for index in range(self.request.n):
            chunk = self._chunk(index, {"role": ASSISTANT, "content": ""})
            if self.request.return_token_ids:
                chunk["prompt_token_ids"] = self.prompt.token_ids
            yield StreamChunk(chunk, index)
            if self.echo:  # no usage on this one, as before the skeleton was shared
                yield StreamChunk(self._chunk(index, {"content": self.echo}), None)

    def _chunk(
        self, index: int, delta: dict[str, Any] | DeltaMessage, **fields: Any
    ) -> dict[str, Any]:
        return self.serving.stream_chunk(
            self.response_id, self.created, self.model_name, index, delta, **fields
        )


def _echo_text(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's content, when that message is the assistant's (being continued)."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    content = last.get("content") if isinstance(last, dict) else None
    return content if last.get("role") == ASSISTANT and isinstance(content, str) else ""
