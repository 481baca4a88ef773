"""POST /v1/completions: OpenAI's legacy completions, with vLLM's extras.

A prompt is a string, a list of strings, a list of token ids, or a list of such lists (token ids are used as given:
no BOS is added). Each prompt runs as one engine request with `n` samples; choice `i` of prompt `p` has index
`p * n + i`. With `echo`, each choice starts with its prompt (text, token ids and, with `logprobs`, the prompt's
logprobs: None for the first token, then one entry per prompt token), which is how evaluation harnesses score
likelihoods (`echo: true, logprobs: 1, max_tokens: 1`). With `use_beam_search`, each prompt runs a beam search
instead (`serving_beam_search.py`): its `n` best beams are its choices, best first, built by the same code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.logprobs import (
    completion_logprobs,
    output_positions,
    prompt_logprobs_body,
    prompt_positions,
)
from kvflow.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from kvflow.entrypoints.openai.serving_beam_search import beam_search_results
from kvflow.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    LONG_TEXT_CHARS,
    MANY_PROMPTS,
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

if TYPE_CHECKING:
    from fastapi import Request

    from kvflow.lora.request import LoRARequest
    from kvflow.outputs import CompletionOutput, Logprob, RequestOutput

_FIELDS = frozenset(CompletionRequest.model_fields)


class OpenAIServingCompletion(OpenAIServing):
    """Serves /v1/completions (streamed as server-sent events, or whole)."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        lora_request = self.check_request(request)
        if request.suffix is not None:
            raise OpenAIServingError("suffix is not supported by kvflow", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIServingError("best_of must equal n in kvflow", param="best_of")
        controls = self.request_controls(request)
        request_id = self.request_id(raw_request, request.request_id)
        if _is_heavy(request.prompt):  # many prompts or long texts: prepared off the event loop
            prompts = await asyncio.to_thread(self._prompts, request, controls)
        else:
            prompts = self._prompts(request, controls)
        response_id = f"cmpl-{request_id}"
        if request.stream:  # never with use_beam_search (unsupported.BEAM_SEARCH_FIELDS)
            return sse_response(
                self._stream(request, request_id, response_id, prompts, lora_request),
                self.limits.max_stream_buffer_bytes,
                request_id,
            )
        if request.use_beam_search:
            results = beam_search_results(self, request, request_id, prompts, lora_request)
        else:
            results = self.generate(request_id, prompts, request.priority, lora_request)
        model_name = self.models.model_name(lora_request)
        response = await run_until_disconnected(
            raw_request, self._complete(request, response_id, prompts, results, model_name)
        )
        if response is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(response.model_dump())

    # ------------------------------------------------------------------------------------------------ prompts
    def _prompts(self, request: CompletionRequest, controls: RequestControls) -> list[PromptInput]:
        """Every prompt of the request, checked, tokenized and truncated as the request asks (400 naming the field
        otherwise)."""
        raw = request.prompt
        if isinstance(raw, str):
            items: Sequence[str | list[int]] = [raw]
        elif not raw:
            raise OpenAIServingError("prompt must not be empty", param="prompt")
        elif all(isinstance(item, int) for item in raw):
            items = [raw]  # type: ignore[list-item]
        else:
            items = raw  # type: ignore[assignment]
        self.check_num_prompts(len(items))
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = request.logprobs
        prompts = []
        for item in items:
            if isinstance(item, str):
                if self.tokenizer is None:
                    raise OpenAIServingError(
                        "this model has no tokenizer: send the prompt as token ids", param="prompt"
                    )
                text: str | None = item
                token_ids = self.tokenizer.encode(
                    item, add_special_tokens=request.add_special_tokens
                )
            else:
                text, token_ids = None, list(item)
            text, token_ids = self.truncate_prompt(text, token_ids, controls)
            max_tokens = self.max_tokens(request.max_tokens, len(token_ids), "max_tokens", "prompt")
            params = self.sampling_params(
                request,
                max_tokens=max_tokens,
                logprobs=request.logprobs,
                prompt_logprobs=prompt_logprobs,
                fields=_FIELDS,
                aliases=self.aliases,
                controls=controls,
            )
            prompts.append(self.process(text, token_ids, params, _FIELDS, self.aliases))
        return prompts

    def _prompt_text(self, prompt: PromptInput) -> str:
        """What `echo` shows: the prompt as sent, or token ids decoded (special tokens kept)."""
        if prompt.text is not None:
            return prompt.text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def echoed(
        self,
        echo: bool,
        prompt: PromptInput,
        prompt_logprobs: Sequence[dict[int, Logprob] | None] | None,
        output: CompletionOutput,
    ) -> tuple[str, list[int], list[dict[int, Logprob] | None]]:
        """A choice's text, token ids and per-token distributions, preceded by the prompt's when `echo`."""
        text, token_ids, positions = output.text, list(output.token_ids), output_positions(output)
        if not echo:
            return text, token_ids, positions
        return (
            self._prompt_text(prompt) + text,
            prompt.token_ids + token_ids,
            prompt_positions(prompt.token_ids, prompt_logprobs) + positions,
        )

    # ------------------------------------------------------------------------------------------------ whole
    async def _complete(
        self,
        request: CompletionRequest,
        response_id: str,
        prompts: list[PromptInput],
        results: AsyncIterator[tuple[int, RequestOutput]],
        model_name: str,
    ) -> CompletionResponse:
        """The whole response from `results`: each prompt's final output (its samples, or its beams), naming
        `model_name` (the adapter's name for a request that ran with one)."""
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async for index, output in results:
            raise_if_failed(output)
            finals[index] = output  # "final_only": each prompt's one output
        choices = []
        num_completion_tokens = 0
        for prompt_index, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            assert final is not None
            prompt_logprobs = getattr(final, "prompt_logprobs", None)
            for output in final.outputs:
                num_completion_tokens += len(output.token_ids)
                choices.append(self._choice(request, prompt_index, prompt, prompt_logprobs, output))
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(
            id=response_id,
            model=model_name,
            choices=choices,
            usage=make_usage(
                sum(len(prompt.token_ids) for prompt in prompts),
                num_completion_tokens,
                sum(cached_tokens(final) for final in finals if final is not None),
            ),
        )

    def _choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        prompt: PromptInput,
        prompt_logprobs: Sequence[dict[int, Logprob] | None] | None,
        output: CompletionOutput,
    ) -> CompletionResponseChoice:
        text, token_ids, positions = self.echoed(request.echo, prompt, prompt_logprobs, output)
        return CompletionResponseChoice(
            index=prompt_index * request.n + output.index,
            text=text,
            logprobs=None
            if request.logprobs is None
            else completion_logprobs(
                token_ids, positions, request.logprobs, self.token_texts(request)
            ),
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            prompt_logprobs=prompt_logprobs_body(prompt_logprobs)
            if request.prompt_logprobs is not None
            else None,
            prompt_token_ids=prompt.token_ids if request.return_token_ids else None,
            token_ids=token_ids if request.return_token_ids else None,
        )

    # ------------------------------------------------------------------------------------------------ stream
    def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        response_id: str,
        prompts: list[PromptInput],
        lora_request: LoRARequest | None,
    ) -> AsyncGenerator[bytes, None]:
        """Server-sent events (`sse_stream`): one chunk per new piece of a choice, never an empty one."""
        created = int(time.time())
        model_name = self.models.model_name(lora_request)
        return sse_stream(
            self.generate(request_id, prompts, request.priority, lora_request),
            request_id=request_id,
            stream_options=request.stream_options,
            usage=StreamUsage([len(prompt.token_ids) for prompt in prompts], request.n),
            build_chunks=_CompletionChunks(
                self, request, response_id, created, prompts, model_name
            ),
            usage_chunk=lambda: self.stream_chunk(response_id, created, [], model_name),
        )

    def stream_chunk(
        self, response_id: str, created: int, choices: list[dict[str, Any]], model_name: str
    ) -> dict[str, Any]:
        """A `CompletionStreamResponse` as the dict `sse_event` sends."""
        return chunk_body(response_id, "text_completion", created, model_name, choices)


class _CompletionChunks:
    """The chunk builder of one streamed completion (`sse_stream`'s `build_chunks`).

    Invariants: a choice's first chunk carries what `echo` prepends and, when asked for, its prompt's token ids and
    logprobs; `streamed_text_len[i]` is how much text choice `i` has sent (its logprobs' text offsets start there).
    """

    def __init__(
        self,
        serving: OpenAIServingCompletion,
        request: CompletionRequest,
        response_id: str,
        created: int,
        prompts: list[PromptInput],
        model_name: str,
    ) -> None:
        self.serving = serving
        self.model_name = model_name
        self.request = request
        self.response_id = response_id
        self.created = created
        self.prompts = prompts
        num_choices = len(prompts) * request.n
        self.streamed_text_len = [0] * num_choices
        self.started = [False] * num_choices
        # Each prompt's logprobs, from whichever output carried them first (its samples share them).
        self.prompt_logprobs: list[Sequence[dict[int, Logprob] | None] | None] = [None] * len(
            prompts
        )
        self.texts = serving.token_texts(request)

    def __call__(self, prompt_index: int, result: RequestOutput) -> Iterator[StreamChunk]:
        request, prompt = self.request, self.prompts[prompt_index]
        if self.prompt_logprobs[prompt_index] is None:
            self.prompt_logprobs[prompt_index] = getattr(result, "prompt_logprobs", None)
        prompt_logprobs = self.prompt_logprobs[prompt_index]
        for output in result.outputs:
            index = prompt_index * request.n + output.index
            first = not self.started[index]
            text, token_ids, positions = self.serving.echoed(
                first and request.echo, prompt, prompt_logprobs, output
            )
            if not text and not token_ids and output.finish_reason is None:
                continue
            self.started[index] = True
            # `CompletionResponseStreamChoice`'s fields, in its order, where the model would have them set.
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": None
                if request.logprobs is None
                else completion_logprobs(
                    token_ids,
                    positions,
                    request.logprobs,
                    self.texts,
                    self.streamed_text_len[index],
                ),
                "finish_reason": output.finish_reason,
                "stop_reason": output.stop_reason,
            }
            if first and request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(prompt_logprobs)
            if request.return_token_ids:
                if first:
                    choice["prompt_token_ids"] = prompt.token_ids
                choice["token_ids"] = token_ids
            self.streamed_text_len[index] += len(text)
            chunk = self.serving.stream_chunk(
                self.response_id, self.created, [choice], self.model_name
            )
            yield StreamChunk(chunk, index, len(output.token_ids))


def _is_heavy(prompt: str | list[str] | list[int] | list[list[int]]) -> bool:
    """Whether preparing this `prompt` may take long enough to stall the event loop: many prompts, or long text."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items: list = [prompt]  # one prompt (text, or token ids)
    else:
        items = prompt
    if len(items) > MANY_PROMPTS:
        return True
    return any(isinstance(item, str) and len(item) >= LONG_TEXT_CHARS for item in items)
