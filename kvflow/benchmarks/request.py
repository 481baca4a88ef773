"""One request to an OpenAI-compatible server, timed the way vLLM's `bench serve` times it: a streamed completion
or chat request, or an embedding request (vLLM's `openai-embeddings` backend: one whole response, whose latency is
all there is to time)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import aiohttp

    from kvflow.benchmarks.datasets import SampleRequest


@dataclass
class RequestResult:
    """What one request measured; times in seconds.

    `ttft` is from sending the request to the first chunk that carries text or tokens; `itl` has one gap per later
    such chunk; `latency` runs to the end of the stream. `output_tokens` is the server's `usage.completion_tokens`
    when it reports usage, else the number of content chunks. `prompt_len` is the server's `usage.prompt_tokens`
    when it reports it (what it really processed: a chat request's count includes its chat template), else the
    sample's length. An embedding request has one latency (`ttft` equals it) and no output tokens.
    """

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0  # time.perf_counter() when the request was sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, or None for fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def request_body(
    endpoint: str, model: str, sample: SampleRequest, ignore_eos: bool, stream: bool = True
) -> dict[str, Any]:
    """The JSON body for `sample`: a completions prompt (text or token ids) or a one-message chat, streamed (with
    usage on the last chunk) or not."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": sample.expected_output_len,
        "temperature": 0.0,
        "stream": stream,
        "ignore_eos": ignore_eos,  # vLLM's extra field: every request generates exactly max_tokens
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint.endswith("/chat/completions"):
        if not isinstance(sample.prompt, str):
            raise ValueError(
                "the chat endpoint needs text prompts: pass --tokenizer (or use /v1/completions)"
            )
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if not isinstance(sample.prompt, str):
        # vLLM's extra field: a server without a tokenizer streams token ids and no text.
        body["return_token_ids"] = True
    return body


def is_embedding_endpoint(endpoint: str) -> bool:
    """Whether `endpoint` takes embedding requests (`/v1/embeddings`) rather than generation ones."""
    return endpoint.rstrip("/").endswith("/embeddings")


def embedding_request_body(model: str, sample: SampleRequest) -> dict[str, Any]:
    """An OpenAI embeddings body for `sample`: its text or token ids as the one `input`, float results."""
    return {"model": model, "input": sample.prompt, "encoding_format": "float"}


async def send_embedding_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], sample: SampleRequest
) -> RequestResult:
    """POST an embeddings `body` and read the whole response; success means one embedding per input came back.
    Never raises for a failed request."""
    result = RequestResult(prompt_len=sample.prompt_len)
    result.start_time = start = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            payload = await response.read()
            if response.status != 200:
                result.error = f"HTTP {response.status}: {payload.decode(errors='replace')[:200]}"
                return result
            whole = _DECODER.decode(payload)
    except Exception as error:  # a benchmark reports failures, it does not stop at the first one
        result.error = f"{type(error).__name__}: {error}"[:200]
        return result
    result.latency = result.ttft = time.perf_counter() - start
    num_inputs = len(body["input"]) if _is_batch(body["input"]) else 1
    data = whole.get("data") or []
    if len(data) != num_inputs or not all(item.get("embedding") for item in data):
        result.error = f"{len(data)} embeddings came back for {num_inputs} inputs"
        return result
    _read_prompt_tokens(result, whole.get("usage") or {})
    result.success = True
    return result


def _read_prompt_tokens(result: RequestResult, usage: dict[str, Any]) -> None:
    """The server's count of the prompt's tokens, when its usage has one, replaces the sample's."""
    prompt_tokens = usage.get("prompt_tokens")
    if prompt_tokens:
        result.prompt_len = int(prompt_tokens)


def _is_batch(value: Any) -> bool:
    """An embeddings `input` of several inputs: a list of texts or of token-id lists (one token-id list is one)."""
    return isinstance(value, list) and bool(value) and not isinstance(value[0], int)


async def send_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], sample: SampleRequest
) -> RequestResult:
    """POST `body` and read the server-sent events until `data: [DONE]` (or, for a body that does not stream, the
    whole response: its time to first token is its latency); never raises for a failed request.

    The client is aiohttp (vLLM's benchmark client too), reading the body as it comes and splitting it into
    events itself: on a small machine the client shares the cores with the server it measures, so it must cost
    little per chunk."""
    result = RequestResult(prompt_len=sample.prompt_len)
    result.start_time = start = time.perf_counter()
    last_chunk_time = start
    num_content_chunks = 0
    pending = b""
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read()).decode()[:200]}"
                return result
            if not body.get("stream"):
                whole = _DECODER.decode(await response.read())
                result.latency = result.ttft = time.perf_counter() - start
                result.output_tokens = int(whole["usage"]["completion_tokens"])
                _read_prompt_tokens(result, whole["usage"])
                result.success = result.output_tokens > 0
                if not result.success:
                    result.error = "the response carried no output"
                return result
            async for data in response.content.iter_any():
                events = (pending + data).split(b"\n\n")
                pending = events.pop()  # an event not complete yet
                now = time.perf_counter()
                for event in events:
                    payload = (
                        event.removeprefix(b"data:").strip() if event.startswith(b"data:") else b""
                    )
                    if not payload or payload == b"[DONE]":
                        continue
                    chunk = _DECODER.decode(payload)
                    if "error" in chunk:
                        result.error = str(chunk["error"])[:200]
                        return result
                    if _has_content(chunk):
                        if num_content_chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last_chunk_time)
                        num_content_chunks += 1
                        last_chunk_time = now
                    usage = chunk.get("usage")
                    if usage:
                        result.output_tokens = int(usage.get("completion_tokens", 0))
                        _read_prompt_tokens(result, usage)
    except Exception as error:  # a benchmark reports failures, it does not stop at the first one
        result.error = f"{type(error).__name__}: {error}"[:200]
        return result
    result.latency = time.perf_counter() - start
    if not result.output_tokens:
        result.output_tokens = num_content_chunks
    result.success = num_content_chunks > 0
    if not result.success:
        result.error = "the stream carried no output"
    return result


_DECODER = msgspec.json.Decoder()


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
        if choice.get("token_ids"):
            return True
    return False
