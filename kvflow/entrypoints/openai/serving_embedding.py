"""POST /v1/embeddings (OpenAI's, with vLLM's extras) and POST /pooling (vLLM's raw pooled states).

Each input (a text, or one prompt's token ids) is one engine request with task "embed" (or "encode" for /pooling,
unless the request names another task); `data[i]` answers `input[i]`. With `encoding_format: "base64"` each
result is its float32 values, little-endian, base64-encoded (`serving_pooling.encode_base64`), which the official
`openai` client asks for by default and decodes. `messages` (vLLM's chat form of /v1/embeddings) renders one
prompt with the chat template, as /v1/chat/completions would, without a generation prompt unless asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from kvflow.entrypoints.openai.chat_prompt import ChatPromptRenderer
from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol_pooling import EmbeddingRequest, PoolingRequest
from kvflow.entrypoints.openai.serving_engine import CLIENT_CLOSED_REQUEST
from kvflow.entrypoints.openai.serving_pooling import (
    OpenAIServingPooling,
    encode_base64,
    input_items,
    list_body,
)

if TYPE_CHECKING:
    import torch
    from fastapi import Request

_EMBEDDING_FIELDS = frozenset(EmbeddingRequest.model_fields)
_POOLING_FIELDS = frozenset(PoolingRequest.model_fields)


def result_body(data: torch.Tensor, encoding_format: str) -> list[Any] | str:
    """A result as JSON: its values (nested for a [num_tokens, hidden] result), or base64 of its float32s."""
    if encoding_format == "base64":
        return encode_base64(data)
    return data.tolist()


class OpenAIServingEmbedding(OpenAIServingPooling):
    """Serves /v1/embeddings and /pooling. `chat_prompt` renders `messages` (the server's chat renderer)."""

    def __init__(self, *args: Any, chat_prompt: ChatPromptRenderer | None = None) -> None:
        super().__init__(*args)
        self.chat_prompt = (
            chat_prompt if chat_prompt is not None else ChatPromptRenderer(self.tokenizer)
        )

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_request(request, "embed", raw_request.url.path)
        request_id = self.request_id(raw_request, request.request_id)
        prompts = await self._embedding_prompts(request)
        params = [
            self.pooling_params(
                _EMBEDDING_FIELDS,
                task="embed",
                dimensions=request.dimensions,
                normalize=request.normalize,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
            )
            for _ in prompts
        ]
        outputs = await self.run(
            raw_request, request_id, prompts, params, request.priority, _EMBEDDING_FIELDS
        )
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        data = [
            {
                "index": index,
                "object": "embedding",
                "embedding": result_body(output.outputs.data, request.encoding_format),
            }
            for index, output in enumerate(outputs)
        ]
        return JSONResponse(
            list_body(f"embd-{request_id}", self.models.served_model_name, data, outputs)
        )

    async def _embedding_prompts(self, request: EmbeddingRequest) -> list[dict[str, Any]]:
        truncate = request.truncate_prompt_tokens
        if (request.input is None) == (request.messages is None):
            raise OpenAIServingError("give either input or messages", param="input")
        if request.messages is not None:
            text = await self.chat_prompt.render(
                request.messages,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
            )
            add_special_tokens = bool(request.add_special_tokens)
            return await self.prompts_of([text], add_special_tokens, truncate, "messages")
        items = input_items(request.input)
        self.check_num_inputs(len(items), "input")
        add_special_tokens = request.add_special_tokens is not False
        return await self.prompts_of(items, add_special_tokens, truncate, "input")

    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> Response:
        task = request.task or "encode"
        self.check_request(request, task, raw_request.url.path, "task" if request.task else None)
        request_id = self.request_id(raw_request, request.request_id)
        items = input_items(request.input)
        self.check_num_inputs(len(items), "input")
        truncate = request.truncate_prompt_tokens
        prompts = await self.prompts_of(items, request.add_special_tokens, truncate, "input")
        params = [
            self.pooling_params(
                _POOLING_FIELDS,
                task=task,
                dimensions=request.dimensions,
                normalize=request.normalize,
                truncate_prompt_tokens=truncate,
            )
            for _ in prompts
        ]
        outputs = await self.run(
            raw_request, request_id, prompts, params, request.priority, _POOLING_FIELDS
        )
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        data = [
            {
                "index": index,
                "object": "pooling",
                "data": result_body(output.outputs.data, request.encoding_format),
            }
            for index, output in enumerate(outputs)
        ]
        return JSONResponse(
            list_body(f"pool-{request_id}", self.models.served_model_name, data, outputs)
        )
