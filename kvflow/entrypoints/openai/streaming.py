"""The server-sent-event skeleton both streaming endpoints share (/v1/completions, /v1/chat/completions).

`sse_stream` owns everything about a stream except its chunks: running the engine requests, failing on an output
the engine ended with an error, the token counts behind `usage` (`StreamUsage`), `stream_options` (`usage` on every
chunk with `continuous_usage_stats`, a last chunk with only `usage` with `include_usage`), the error event that
ends a stream that fails after it started, and `data: [DONE]`. An endpoint supplies only its chunk builder: for each
engine output, the chunks to send (`StreamChunk`). `bounded_stream` then carries the events to the client through
a bounded buffer.

Chunks are plain dicts serialised by msgspec, not pydantic models: per streamed token that is the API process's
main cost. Their keys are set in the order of the response models' fields (`protocol.py`) and only where the models'
fields would be set, so the JSON is what `model_dump_json(exclude_unset=True)` of those models gives (floats of
magnitude 1e16 and above aside, which msgspec writes as `1e16` and pydantic as `1e+16`). Parts that are rare on the
hot path (logprobs, tool-call deltas) may stay pydantic models inside the dict: they are dumped the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kvflow.engine.async_llm import EngineDeadError
from kvflow.entrypoints.openai.errors import OpenAIServingError, error_body
from kvflow.entrypoints.openai.serving_engine import cached_tokens, raise_if_failed, usage_body

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.protocol import StreamOptions
    from kvflow.outputs import RequestOutput

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class StreamChunk:
    """One chunk to send: `payload` (a response chunk as a dict, `chunk_body`), the choice whose token counts
    `continuous_usage_stats` attaches to it (None: no usage on this chunk), and how many new tokens of that
    choice it carries."""

    payload: dict[str, Any]
    choice_index: int | None
    num_new_tokens: int = 0


# (prompt index, engine output) -> the chunks that output makes, in order.
ChunkBuilder = Callable[[int, "RequestOutput"], Iterable[StreamChunk]]


@dataclass
class StreamUsage:
    """The token counts of one streamed response, for its `usage`.

    Invariants: choice `i` belongs to prompt `i // n`; each prompt's tokens count once (not once per sample);
    `cached_tokens[p]` is prompt `p`'s prefix-cache hits as last reported.
    """

    prompt_tokens: list[int]
    n: int
    completion_tokens: list[int] = field(init=False)
    cached_tokens: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.completion_tokens = [0] * (len(self.prompt_tokens) * self.n)
        self.cached_tokens = [0] * len(self.prompt_tokens)

    def of_choice(self, choice_index: int) -> dict[str, Any]:
        prompt_index = choice_index // self.n
        return usage_body(
            self.prompt_tokens[prompt_index],
            self.completion_tokens[choice_index],
            self.cached_tokens[prompt_index],
        )

    def total(self) -> dict[str, Any]:
        return usage_body(
            sum(self.prompt_tokens), sum(self.completion_tokens), sum(self.cached_tokens)
        )


def chunk_body(
    response_id: str, object_name: str, created: int, model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    """A stream chunk (`CompletionStreamResponse` / `ChatCompletionStreamResponse`) with the fields every chunk
    sets; `usage` and (chat) `prompt_token_ids` are added to it as the models order them (`with_usage`)."""
    return {
        "id": response_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": choices,
    }


def with_usage(payload: dict[str, Any], usage: dict[str, Any]) -> None:
    """Set a chunk's `usage`, which the chat chunk model declares before `prompt_token_ids`."""
    prompt_token_ids = payload.pop("prompt_token_ids", None)
    payload["usage"] = usage
    if prompt_token_ids is not None:
        payload["prompt_token_ids"] = prompt_token_ids


async def sse_stream(
    results: AsyncIterator[tuple[int, RequestOutput]],
    *,
    request_id: str,
    stream_options: StreamOptions | None,
    usage: StreamUsage,
    build_chunks: ChunkBuilder,
    usage_chunk: Callable[[], dict[str, Any]],
) -> AsyncGenerator[bytes, None]:
    """The events of one streamed response: `build_chunks`'s chunks for each `(prompt index, output)` of
    `results`, with `usage` per `stream_options`; then, with `include_usage`, `usage_chunk()` (a chunk without
    choices) carrying the totals; an error event if anything fails after the start; always `[DONE]` last.
    Closing this generator closes `results` (aborting the engine requests that still run)."""
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous_usage = include_usage and bool(
        stream_options and stream_options.continuous_usage_stats
    )
    try:
        async with contextlib.aclosing(results):  # type: ignore[type-var]
            async for prompt_index, result in results:
                raise_if_failed(result)
                usage.cached_tokens[prompt_index] = cached_tokens(result)
                for chunk in build_chunks(prompt_index, result):
                    if chunk.choice_index is not None:
                        usage.completion_tokens[chunk.choice_index] += chunk.num_new_tokens
                        if continuous_usage:
                            with_usage(chunk.payload, usage.of_choice(chunk.choice_index))
                    yield sse_event(chunk.payload)
        if include_usage:
            final = usage_chunk()
            with_usage(final, usage.total())
            yield sse_event(final)
    except Exception as error:
        yield stream_error_event(error, request_id)
    yield SSE_DONE


def sse_response(
    events: AsyncGenerator[bytes, None], max_buffered_bytes: int, request_id: str
) -> StreamingResponse:
    """The HTTP response that sends `events` (through `bounded_stream`)."""
    return StreamingResponse(
        bounded_stream(events, max_buffered_bytes, request_id), media_type="text/event-stream"
    )


def _dump_model(value: Any) -> Any:
    """msgspec's hook for what it cannot encode itself: a pydantic model inside a chunk, dumped as the chunk's
    model would dump it (fields never set left out)."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    raise NotImplementedError(f"a stream chunk cannot hold a {type(value).__name__}")


_ENCODER = msgspec.json.Encoder(enc_hook=_dump_model)


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event; chunks leave out fields never set, as vLLM's do."""
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


async def bounded_stream(
    events: AsyncGenerator[bytes, None], max_buffered_bytes: int, request_id: str
) -> AsyncIterator[bytes]:
    """`events` as the response body, through a buffer of at most `max_buffered_bytes` between the task that
    produces them and the writes to the client. Events that wait in the buffer together go out in one write.

    The writes wait for a client that does not read (TCP backpressure); the producer does not, so an unread stream
    shows as a full buffer. Past the bound the request is aborted (closing `events` aborts its engine requests,
    freeing their KV blocks and slots) and the stream ends with an error event and `[DONE]`, delivered if the
    client ever reads again. A consumer that is merely slow (a busy event loop) keeps draining the buffer and is
    never cut off: only writes that stall fill it.
    """
    buffer: deque[bytes] = deque()
    num_buffered = 0
    produced = asyncio.Event()
    finished = False

    async def produce() -> None:
        nonlocal num_buffered, finished
        try:
            async for event in events:
                buffer.append(event)
                num_buffered += len(event)
                produced.set()
                if num_buffered > max_buffered_bytes:
                    logger.warning(
                        "request %s: its client has not read %d bytes of its stream; aborting it",
                        request_id,
                        num_buffered,
                    )
                    buffer.append(
                        stream_error_event(StreamBufferFullError(max_buffered_bytes), request_id)
                    )
                    buffer.append(SSE_DONE)
                    return
        finally:
            await events.aclose()  # aborts what still runs
            finished = True
            produced.set()

    producer = asyncio.ensure_future(produce())
    try:
        while True:
            await produced.wait()
            produced.clear()
            if buffer:
                events_now = b"".join(buffer) if len(buffer) > 1 else buffer[0]
                buffer.clear()
                num_buffered = 0
                yield events_now
            if finished and not buffer:
                break
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


class StreamBufferFullError(OpenAIServingError):
    """A stream's client stopped reading and its buffer filled up: the request was aborted."""

    def __init__(self, max_buffered_bytes: int) -> None:
        super().__init__(
            f"the client did not read its stream: more than {max_buffered_bytes} bytes waited to be sent "
            "(--max-stream-buffer-bytes), so the request was aborted",
            status_code=HTTPStatus.REQUEST_TIMEOUT,
        )


def stream_error_event(error: BaseException, request_id: str) -> bytes:
    """The event that ends a stream that failed after it started: OpenAI's error body, then `[DONE]` follows. An
    unexpected error (a 500) is logged once, with the request id and traceback."""
    if isinstance(error, OpenAIServingError):
        body = error_body(error.status_code, error.message, error.param)
    elif isinstance(error, EngineDeadError):
        body = error_body(HTTPStatus.SERVICE_UNAVAILABLE, f"the engine has died: {error}")
    elif isinstance(error, ValueError):
        body = error_body(HTTPStatus.BAD_REQUEST, str(error))
    else:
        logger.error("the stream of request %s failed", request_id, exc_info=error)
        body = error_body(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(error).__name__}: {error}")
    return f"data: {json.dumps(body.model_dump())}\n\n".encode()
