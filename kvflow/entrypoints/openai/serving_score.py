"""POST /v1/score and /score (vLLM's), and POST /v1/rerank, /rerank and /v2/rerank (Jina's and Cohere's shape).

Both score text pairs. The sides pair 1:1, 1:N (the one first text against each second text) or N:N (pairwise),
as vLLM pairs them (`pair_texts`). How a pair is scored depends on the model (`AsyncLLM.supported_tasks`):
  * a cross-encoder (a classifier that supports "score"): one engine request with task "score" per pair, on the
    pair tokenized as one sequence with its token types (`Tokenizer.encode_pair`);
  * an embedding model: each text is embedded once (task "embed"), and a pair's score is the cosine similarity of
    its two embeddings (`kvflow.pooling.scoring.cosine_similarity`, as `LLM.score`).
Rerank scores `query` against every document and answers the documents best first (ties in input order), cut to
`top_n` when it is > 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol_pooling import RerankRequest, ScoreRequest
from kvflow.entrypoints.openai.serving_engine import CLIENT_CLOSED_REQUEST
from kvflow.entrypoints.openai.serving_pooling import OpenAIServingPooling, list_body
from kvflow.pooling.scoring import cosine_similarity
from kvflow.utils import short_repr

if TYPE_CHECKING:
    from collections.abc import Collection, Sequence

    from fastapi import Request

    from kvflow.outputs import PoolingRequestOutput

_SCORE_FIELDS = frozenset(ScoreRequest.model_fields)
_RERANK_FIELDS = frozenset(RerankRequest.model_fields)


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def score_sides(request: ScoreRequest) -> tuple[list[str], list[str], tuple[str, str]]:
    """The request's two sides as lists, with the names the request gave them (`text_1`/`text_2`, or
    `queries`/`documents`). 400 naming the field: a side missing, or both namings mixed."""
    legacy = request.text_1 is not None or request.text_2 is not None
    newer = request.queries is not None or request.documents is not None
    if legacy and newer:
        raise OpenAIServingError(
            "give text_1 and text_2, or queries and documents, not both namings",
            param="queries" if request.text_1 is not None else "documents",
        )
    names = ("queries", "documents") if newer else ("text_1", "text_2")
    first, second = (
        (request.queries, request.documents) if newer else (request.text_1, request.text_2)
    )
    for name, side in zip(names, (first, second), strict=True):
        if side is None:
            raise OpenAIServingError(f"{name} is required", param=name)
    assert first is not None and second is not None
    return _as_list(first), _as_list(second), names


def pair_texts(
    texts_1: Sequence[str], texts_2: Sequence[str], names: tuple[str, str] = ("text_1", "text_2")
) -> list[tuple[int, int]]:
    """The pairs to score, as (index in `texts_1`, index in `texts_2`), in response order: 1:1 and N:N pair
    text i with text i, 1:N pairs the one first text with each second text. 400 naming the field otherwise (an
    empty side, or N:M with N != M and N > 1)."""
    for name, texts in zip(names, (texts_1, texts_2), strict=True):
        if not texts:
            raise OpenAIServingError(f"{name} must hold at least one text", param=name)
    if len(texts_1) == 1:
        return [(0, index) for index in range(len(texts_2))]
    if len(texts_1) != len(texts_2):
        raise OpenAIServingError(
            f"{names[0]} holds {len(texts_1)} texts and {names[1]} {len(texts_2)}: pair them 1:1, 1:N "
            f"(one text in {names[0]}) or N:N (as many in each)",
            param=names[1],
        )
    return [(index, index) for index in range(len(texts_1))]


def rank(scores: Sequence[float], top_n: int) -> list[int]:
    """Document indices best first (ties in input order), the first `top_n` of them (every one for 0)."""
    if top_n < 0:
        raise OpenAIServingError(
            f"top_n must be >= 0 (0: every document), got {short_repr(top_n)}", param="top_n"
        )
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    return order[:top_n] if top_n > 0 else order


class OpenAIServingScores(OpenAIServingPooling):
    """Serves /v1/score and /v1/rerank (and their other paths). Invariant: `cross_encoder` says how pairs are
    scored, fixed by the model's tasks: one pair request each when it classifies, embeddings' cosines otherwise."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.cross_encoder = "classify" in self.supported_tasks

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        self.check_request(request, "score", raw_request.url.path)
        texts_1, texts_2, names = score_sides(request)
        request_id = self.request_id(raw_request, request.request_id)
        result = await self._score(
            raw_request, request_id, texts_1, texts_2, names, request, _SCORE_FIELDS
        )
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        scores, outputs = result
        data = [
            {"index": index, "object": "score", "score": score}
            for index, score in enumerate(scores)
        ]
        return JSONResponse(
            list_body(f"score-{request_id}", self.models.served_model_name, data, outputs)
        )

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        self.check_request(request, "score", raw_request.url.path)
        documents = [doc if isinstance(doc, str) else doc.text for doc in request.documents]
        rank([], request.top_n)  # checks top_n before anything runs
        request_id = self.request_id(raw_request, request.request_id)
        result = await self._score(
            raw_request,
            request_id,
            [request.query],
            documents,
            ("query", "documents"),
            request,
            _RERANK_FIELDS,
        )
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        scores, outputs = result
        results = []
        for index in rank(scores, request.top_n):
            item: dict[str, Any] = {"index": index}
            if request.return_documents:
                item["document"] = {"text": documents[index]}
            item["relevance_score"] = scores[index]
            results.append(item)
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return JSONResponse(
            {
                "id": f"rerank-{request_id}",
                "model": self.models.served_model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
                "results": results,
            }
        )

    # ------------------------------------------------------------------------------------------------ scoring
    async def _score(
        self,
        raw_request: Request,
        request_id: str,
        texts_1: list[str],
        texts_2: list[str],
        names: tuple[str, str],
        request: ScoreRequest | RerankRequest,
        fields: Collection[str],
    ) -> tuple[list[float], list[PoolingRequestOutput]] | None:
        """Each pair's score, in pair order, and the engine outputs behind them; None if the client went away."""
        pairs = pair_texts(texts_1, texts_2, names)
        self.check_num_inputs(len(pairs), names[1])
        truncate = request.truncate_prompt_tokens
        if self.cross_encoder:
            prompts = await self.pair_prompts(
                [(texts_1[first], texts_2[second]) for first, second in pairs], truncate, names[1]
            )
            params = [
                self.pooling_params(
                    fields,
                    task="score",
                    use_activation=request.use_activation,
                    truncate_prompt_tokens=truncate,
                )
                for _ in prompts
            ]
            outputs = await self.run(
                raw_request, request_id, prompts, params, request.priority, fields
            )
            if outputs is None:
                return None
            return [float(output.outputs.data.reshape(-1)[0]) for output in outputs], outputs
        self.check_task("embed", raw_request.url.path)
        prompts = [
            *await self.prompts_of(texts_1, True, truncate, names[0]),
            *await self.prompts_of(texts_2, True, truncate, names[1]),
        ]
        params = [
            self.pooling_params(fields, task="embed", truncate_prompt_tokens=truncate)
            for _ in prompts
        ]
        outputs = await self.run(raw_request, request_id, prompts, params, request.priority, fields)
        if outputs is None:
            return None
        embeddings_1 = [output.outputs.data for output in outputs[: len(texts_1)]]
        embeddings_2 = [output.outputs.data for output in outputs[len(texts_1) :]]
        scores = [
            cosine_similarity(embeddings_1[first], embeddings_2[second]) for first, second in pairs
        ]
        return scores, outputs
