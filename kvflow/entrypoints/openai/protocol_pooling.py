"""Request and response bodies of the pooling endpoints (`kvflow serve MODEL --runner pooling`), in vLLM's shapes:
POST /v1/embeddings (OpenAI's, plus vLLM's extras), /pooling, /classify, /v1/score (and /score), /v1/rerank (and
/rerank, /v2/rerank: Jina's and Cohere's shape).

Like `protocol.py`'s requests they keep unknown fields (reported once, then ignored) and check only types; values
(dimensions within the model's size, truncate_prompt_tokens, token ids in the vocabulary) are checked by
`PoolingParams` and the engine, whose errors name the field, and the pairing of score texts by
`serving_score.pair_texts`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictInt, StrictStr

from kvflow.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo

# A text, texts, token ids, or lists of token ids: OpenAI's `input` of /v1/embeddings (and vLLM's /pooling,
# /classify). Token ids are used as given (no special tokens are added).
PoolingInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class PoolingRequestFields(OpenAIBaseModel):
    """The fields every pooling request has: the model, vLLM's prompt cut and priority, an optional request id."""

    model: str | None = None
    truncate_prompt_tokens: int | None = (
        None  # keep the last k tokens (-1: as many as the model takes)
    )
    priority: int = 0
    request_id: str | None = None
    user: str | None = None  # OpenAI's end-user tag: taken, not used


# ---------------------------------------------------------------------------------------------------- embeddings


class EmbeddingRequest(PoolingRequestFields):
    """POST /v1/embeddings: `input` (OpenAI's) or `messages` (vLLM's chat form: one prompt rendered with the chat
    template), exactly one of them. `encoding_format` "base64" sends each embedding as its little-endian float32
    bytes in base64 (what the official `openai` client asks for by default, and decodes). `dimensions`: keep the
    first n values (Matryoshka models); `normalize` (vLLM): L2-normalize, None following the model's pooler."""

    input: PoolingInput | None = None
    messages: list[dict[str, Any]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool | None = (
        None  # default: True for `input`, False for `messages` (vLLM's)
    )
    # The chat form's template fields (as /v1/chat/completions'); no generation prompt by default, as vLLM's.
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingResponseData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


# ---------------------------------------------------------------------------------------------------- pooling


class PoolingRequest(PoolingRequestFields):
    """POST /pooling (vLLM's): the model's raw pooled states for each input, task "encode" unless `task` names
    another task the model supports."""

    input: PoolingInput
    task: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True


class PoolingResponseData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: (
        list[Any] | str
    )  # [hidden], [num_tokens, hidden] (pooling type ALL), or base64 of the flat float32s


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


# ---------------------------------------------------------------------------------------------------- classify


class ClassificationRequest(PoolingRequestFields):
    """POST /classify (vLLM's): class probabilities for each input (`use_activation` false: the raw logits)."""

    input: PoolingInput
    use_activation: bool | None = None
    add_special_tokens: bool = True


class ClassificationData(BaseModel):
    """One input's result: `label` is config.json's `id2label` name of the most probable class."""

    index: int
    object: Literal["classification"] = "classification"
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


# ---------------------------------------------------------------------------------------------------- score


class ScoreRequest(PoolingRequestFields):
    """POST /v1/score and /score (vLLM's): relevance scores of text pairs. The two sides are `text_1` and `text_2`,
    or `queries` and `documents` (the newer names; one naming only). Each side is a text or a list of texts,
    paired 1:1, 1:N (the one first text with each second text) or N:N (pairwise)."""

    text_1: StrictStr | list[StrictStr] | None = None
    text_2: StrictStr | list[StrictStr] | None = None
    queries: StrictStr | list[StrictStr] | None = None
    documents: StrictStr | list[StrictStr] | None = None
    use_activation: bool | None = None


class ScoreResponseData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


# ---------------------------------------------------------------------------------------------------- rerank


class RerankDocumentIn(OpenAIBaseModel):
    """A document given as an object (Jina's and Cohere's form): its `text`."""

    text: StrictStr


class RerankRequest(PoolingRequestFields):
    """POST /v1/rerank, /rerank and /v2/rerank (Jina's and Cohere's shape, as vLLM serves it): `documents` ranked
    by their relevance to `query`, best first; `top_n` > 0 keeps that many (0: all); `return_documents` false leaves
    each result's document out."""

    query: StrictStr
    documents: list[StrictStr | RerankDocumentIn]
    top_n: int = 0
    return_documents: bool = True
    use_activation: bool | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
