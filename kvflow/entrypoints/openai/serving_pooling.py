"""What the pooling endpoints share (/v1/embeddings, /pooling, /classify, /v1/score, /v1/rerank): the runner and
task checks, prompt preparation, and running a request's inputs through `AsyncLLM.encode`.

A request is checked before anything reaches the engine: the model name (404), the runner (a pooling endpoint on
a `--runner generate` server is a 400 naming the runner, as is a generate endpoint on a pooling server:
`require_runner`), the task (an embeddings request to a classifier is a 400 naming the task:
`AsyncLLM.supported_tasks`), the priority, the number of inputs, and each input's length against `max_model_len`
(unless `truncate_prompt_tokens` asks the engine to cut it). Each input is then one engine request (ids
`request_id`, or `request_id-i` for several), all running at once; the engine's own ValueErrors (a `dimensions` the
model does not take, token ids outside the vocabulary) are 400s naming the field. A client that disconnects aborts
every input still running.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from kvflow.engine.input_processor import check_priority
from kvflow.entrypoints.openai.errors import OpenAIServingError, bad_request
from kvflow.entrypoints.openai.middleware import REQUEST_ID_HEADER
from kvflow.entrypoints.openai.protocol import UsageInfo
from kvflow.entrypoints.openai.server_config import ServingLimits
from kvflow.entrypoints.openai.serving_engine import (
    LONG_TEXT_CHARS,
    MANY_PROMPTS,
    merge_async_iterators,
    run_until_disconnected,
)
from kvflow.entrypoints.openai.unsupported import UnknownFields
from kvflow.pooling.frontend import PoolingRequestEndedError
from kvflow.pooling.scoring import pair_prompt
from kvflow.pooling_params import PoolingParams
from kvflow.tracing import current_trace_headers

if TYPE_CHECKING:
    import torch
    from fastapi import Request

    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.entrypoints.openai.protocol_pooling import PoolingInput, PoolingRequestFields
    from kvflow.entrypoints.openai.serving_engine import LiveRequests
    from kvflow.entrypoints.openai.serving_models import OpenAIServingModels
    from kvflow.outputs import PoolingRequestOutput

_T = TypeVar("_T")

# What each task is called in errors (the endpoint that asks for it).
_TASK_ENDPOINTS = {
    "embed": "embeddings (/v1/embeddings)",
    "classify": "classification (/classify)",
    "score": "scoring (/v1/score, /v1/rerank)",
    "encode": "pooling (/pooling)",
}


def engine_runner(engine: AsyncLLM) -> str:
    """The engine's resolved runner: "generate" or "pooling"."""
    return engine.engine_config.model_config.runner


def require_runner(runner: str, needed: str, path: str) -> None:
    """400 unless the server's `runner` is the one `path` needs."""
    if runner != needed:
        raise OpenAIServingError(
            f"this model runs with --runner {runner}; {path} needs --runner {needed}"
        )


def input_items(value: PoolingInput | None, param: str = "input") -> list[str | list[int]]:
    """A request's `input` as a list of prompts: a text, or one prompt's token ids. 400 naming `param` when empty
    (no prompt, an empty text or an empty list of token ids)."""
    if value is None:
        raise OpenAIServingError(f"{param} is required", param=param)
    if isinstance(value, str):
        items: list[str | list[int]] = [value]
    elif not value:
        raise OpenAIServingError(f"{param} must not be empty", param=param)
    elif all(isinstance(item, int) for item in value):
        items = [list(value)]  # type: ignore[arg-type]
    else:
        items = list(value)  # type: ignore[arg-type]
    for index, item in enumerate(items):
        if not item:
            where = param if len(items) == 1 else f"{param}[{index}]"
            raise OpenAIServingError(f"{where} is empty", param=param)
    return items


def encode_base64(data: torch.Tensor) -> str:
    """OpenAI's base64 embedding: the values as little-endian float32 bytes (row after row), base64-encoded."""
    values = data.detach().float().contiguous().cpu().numpy().astype("<f4", copy=False)
    return base64.b64encode(values.tobytes()).decode("ascii")


def usage_of(outputs: Sequence[PoolingRequestOutput]) -> UsageInfo:
    """Prompt tokens of every engine request a response ran (pooling generates none)."""
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens, completion_tokens=0)


async def off_loop_if_heavy(items: Sequence[object], prepare: Callable[[], _T]) -> _T:
    """`prepare()`, on a worker thread when `items` are many or hold a long text (the tokenizer lets the event
    loop run meanwhile), else here."""
    heavy = len(items) > MANY_PROMPTS or any(
        isinstance(item, str) and len(item) >= LONG_TEXT_CHARS for item in items
    )
    return await asyncio.to_thread(prepare) if heavy else prepare()


def list_body(
    response_id: str,
    model: str,
    data: list[dict[str, Any]],
    outputs: Sequence[PoolingRequestOutput],
) -> dict[str, Any]:
    """A `{"id", "object": "list", "created", "model", "data", "usage"}` response (the field order of
    `EmbeddingResponse`, `PoolingResponse`, `ClassificationResponse`, `ScoreResponse`), built as plain data: a
    thousand embeddings are not validated a second time."""
    return {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage_of(outputs).model_dump(),
    }


class OpenAIServingPooling:
    """The part of every pooling endpoint that does not depend on its shape.

    Invariants: `runner` and `supported_tasks` are the engine's, read once; every engine request it starts runs
    while its client's request id is live (`LiveRequests`), and is aborted when the client goes away or another
    input of the same request fails.
    """

    # The engine's names for a request's fields, where they differ (see `errors.param_of`).
    aliases: Mapping[str, str] = {"prompt_token_ids": "input", "prompt": "input"}

    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        live_requests: LiveRequests,
        limits: ServingLimits | None = None,
        unknown_fields: UnknownFields | None = None,
    ) -> None:
        self.engine = engine
        self.models = models
        self.live_requests = live_requests
        self.limits = limits if limits is not None else ServingLimits()
        self.unknown_fields = unknown_fields if unknown_fields is not None else UnknownFields()
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = models.max_model_len
        self.scheduling_policy = engine.engine_config.scheduler_config.policy
        self.runner = engine_runner(engine)
        self.supported_tasks = engine.supported_tasks

    # ------------------------------------------------------------------------------------------------ checks
    def check_request(
        self, request: PoolingRequestFields, task: str, path: str, task_param: str | None = None
    ) -> None:
        """What every pooling request must pass before its inputs are looked at (`task_param`: the request field
        that named the task, if one did)."""
        if self.engine.errored:
            raise OpenAIServingError(
                "the engine has died; restart the server",
                status_code=HTTPStatus.SERVICE_UNAVAILABLE,
            )
        if self.models.resolve(request.model) is not None:
            raise OpenAIServingError(
                f"{path} serves the base model only: LoRA adapters apply to --runner generate",
                param="model",
            )
        self.unknown_fields.report(request.model_extra)
        require_runner(self.runner, "pooling", path)
        self.check_task(task, path, task_param)
        try:
            check_priority(request.priority, self.scheduling_policy)
        except ValueError as error:
            raise OpenAIServingError(str(error), param="priority") from error

    def check_task(self, task: str, path: str, param: str | None = None) -> None:
        """400 naming `task` when the model cannot do it (an embedding request to a classifier, ...)."""
        if task in self.supported_tasks:
            return
        served = [_TASK_ENDPOINTS.get(each, each) for each in self.supported_tasks]
        raise OpenAIServingError(
            f"{path} asks for task {task!r} ({_TASK_ENDPOINTS.get(task, task)}), which this model does not "
            f"support; it supports {', '.join(served) or 'no pooling task'}",
            param=param,
        )

    def check_num_inputs(self, num_inputs: int, param: str) -> None:
        limit = self.limits.max_prompts
        if num_inputs > limit:
            raise OpenAIServingError(
                f"{param} holds {num_inputs} inputs; this server takes at most {limit} "
                "(--max-prompts-per-request)",
                param=param,
            )

    def check_length(self, num_tokens: int, param: str) -> None:
        """400 naming `param` when an input of `num_tokens` tokens does not fit the model."""
        if num_tokens > self.max_model_len:
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {num_tokens} input tokens. Please reduce the length of the input, or set "
                "truncate_prompt_tokens.",
                param=param,
            )

    def request_id(self, raw_request: Request, body_request_id: str | None) -> str:
        """The X-Request-Id header, else the body's `request_id`, else a fresh one; 400 if it is live."""
        header_id = raw_request.headers.get(REQUEST_ID_HEADER)
        if header_id:
            self.live_requests.check_free(header_id)
            return header_id
        if body_request_id:
            self.live_requests.check_free(body_request_id, param="request_id")
            return body_request_id
        return uuid.uuid4().hex

    def pooling_params(self, fields: Collection[str], **options: Any) -> PoolingParams:
        """`PoolingParams(**options)`; a bad value is a 400 naming its field."""
        try:
            return PoolingParams(**options)
        except ValueError as error:
            raise bad_request(error, set(fields), self.aliases) from error

    # ------------------------------------------------------------------------------------------------ prompts
    async def prompts_of(
        self,
        items: Sequence[str | list[int]],
        add_special_tokens: bool,
        truncate_prompt_tokens: int | None,
        param: str,
    ) -> list[dict[str, Any]]:
        """`prompt_of` each input; prepared on a worker thread when there are many or a long text (so that a
        request of a thousand texts does not stall every other request while it is tokenized)."""

        def prepare() -> list[dict[str, Any]]:
            return [
                self.prompt_of(item, add_special_tokens, truncate_prompt_tokens, param)
                for item in items
            ]

        return await off_loop_if_heavy(items, prepare)

    def prompt_of(
        self,
        item: str | list[int],
        add_special_tokens: bool,
        truncate_prompt_tokens: int | None,
        param: str,
    ) -> dict[str, Any]:
        """One input as an engine prompt: a text tokenized as the engine would (`add_special_tokens` as the
        request says), token ids as given. Checked against `max_model_len` unless the engine is to cut it."""
        if isinstance(item, str):
            if self.tokenizer is None:
                raise OpenAIServingError("this model has no tokenizer: send token ids", param=param)
            token_ids = self.tokenizer.encode(item, add_special_tokens=add_special_tokens)
            if not token_ids:
                raise OpenAIServingError(f"{param} holds a text with no tokens", param=param)
            prompt: dict[str, Any] = {"prompt_token_ids": token_ids, "prompt": item}
        else:
            token_ids = item
            prompt = {"prompt_token_ids": token_ids}
        if truncate_prompt_tokens is None:
            self.check_length(len(token_ids), param)
        return prompt

    async def pair_prompts(
        self,
        pairs: Sequence[tuple[str, str]],
        truncate_prompt_tokens: int | None,
        param: str,
    ) -> list[dict[str, Any]]:
        """A cross-encoder's inputs: each pair tokenized as one sequence with its token types, 0 for the first
        text and 1 for the second (`kvflow.pooling.scoring.pair_prompt`, as `LLM.score`); checked against
        `max_model_len` unless the engine is to cut them. Many pairs are prepared on a worker thread."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise OpenAIServingError("this model has no tokenizer", param=param)

        def prepare() -> list[dict[str, Any]]:
            prompts = [pair_prompt(tokenizer, text_1, text_2) for text_1, text_2 in pairs]
            if truncate_prompt_tokens is None:
                for prompt in prompts:
                    self.check_length(len(prompt["prompt_token_ids"]), param)
            return prompts

        return await off_loop_if_heavy([text for pair in pairs for text in pair], prepare)

    # ------------------------------------------------------------------------------------------------ running
    async def run(
        self,
        raw_request: Request,
        request_id: str,
        prompts: Sequence[dict[str, Any]],
        params: Sequence[PoolingParams],
        priority: int,
        fields: Collection[str],
    ) -> list[PoolingRequestOutput] | None:
        """Every prompt's output (with `params[i]`), in order; None when the client disconnected first (every
        engine request is then aborted)."""
        return await run_until_disconnected(
            raw_request, self._encode_all(request_id, prompts, params, priority, fields)
        )

    async def _encode_all(
        self,
        request_id: str,
        prompts: Sequence[dict[str, Any]],
        params: Sequence[PoolingParams],
        priority: int,
        fields: Collection[str],
    ) -> list[PoolingRequestOutput]:
        engine_ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{index}" for index in range(len(prompts))]
        )
        outputs: list[PoolingRequestOutput | None] = [None] * len(prompts)
        with self.live_requests.claim(request_id, engine_ids):
            trace_headers = current_trace_headers()  # with --otlp-traces-endpoint
            streams = [
                self.engine.encode(
                    prompt, each_params, engine_id, priority, trace_headers=trace_headers
                )
                for prompt, each_params, engine_id in zip(prompts, params, engine_ids, strict=True)
            ]
            try:
                async for index, output in merge_async_iterators(streams):
                    outputs[index] = output
            except ValueError as error:
                raise bad_request(error, set(fields), self.aliases) from error
            except (
                PoolingRequestEndedError
            ) as error:  # aborted (an admin's pause), or failed in its step
                raise OpenAIServingError(
                    str(error), status_code=HTTPStatus.INTERNAL_SERVER_ERROR
                ) from error
        missing = [index for index, output in enumerate(outputs) if output is None]
        if missing:
            raise OpenAIServingError(
                f"the engine ended input {missing[0]} without a result",
                status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            )
        return outputs  # type: ignore[return-value]
