"""POST /tokenize and POST /detokenize (vLLM's): the served model's tokenizer and chat template, over HTTP.

`/tokenize` takes a text `prompt` (special tokens added unless `add_special_tokens` is false) or chat `messages`
(rendered like /v1/chat/completions renders them, special tokens not added again unless asked), so a client can
count or inspect exactly the tokens a completion request would use. `/detokenize` decodes ids with special tokens
skipped, as the output text of a completion is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.entrypoints.openai.chat_prompt import ChatPromptRenderer
from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvflow.entrypoints.openai.serving_engine import encode_text

if TYPE_CHECKING:
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.entrypoints.openai.serving_models import OpenAIServingModels
    from kvflow.tokenizer import Tokenizer


class OpenAIServingTokenization:
    """Tokenizes and detokenizes with the engine's tokenizer (400 when the model has none, like the hash model)."""

    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        chat_prompt: ChatPromptRenderer | None = None,
    ) -> None:
        """`chat_prompt`: how `messages` become prompt text, as /v1/chat/completions renders them (default: the
        checkpoint's templates only)."""
        self.tokenizer = engine.get_tokenizer()
        self.vocab_size = engine.model_info.vocab_size
        self.models = models
        self.chat_prompt = (
            chat_prompt if chat_prompt is not None else ChatPromptRenderer(self.tokenizer)
        )

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.models.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIServingError("give either prompt or messages", param="prompt")
        tokenizer = self._tokenizer("prompt" if request.messages is None else "messages")
        if request.messages is not None:
            text = await self.chat_prompt.render(
                request.messages,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=request.tools,
            )
            add_special_tokens = bool(request.add_special_tokens)
        else:
            assert request.prompt is not None
            text = request.prompt
            add_special_tokens = request.add_special_tokens is not False
        token_ids = await encode_text(tokenizer, text, add_special_tokens)
        return TokenizeResponse(
            count=len(token_ids),
            max_model_len=self.models.max_model_len,
            tokens=token_ids,
            token_strs=tokenizer.convert_ids_to_tokens(token_ids)
            if request.return_token_strs
            else None,
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check_model(request.model)
        tokenizer = self._tokenizer("tokens")
        outside = [token for token in request.tokens if not 0 <= token < self.vocab_size]
        if outside:
            raise OpenAIServingError(
                f"tokens holds {outside[:8]}, not token ids in [0, {self.vocab_size})",
                param="tokens",
            )
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    def _tokenizer(self, param: str) -> Tokenizer:
        if self.tokenizer is None:
            raise OpenAIServingError("this model has no tokenizer", param=param)
        return self.tokenizer
