"""Scoring text pairs (`LLM.score`, the server's /score and /rerank): vLLM's pairing rules, the pair prompts a
cross-encoder reads, and the cosine similarity an embedding model scores with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvflow.tokenizer import Tokenizer


def pair_texts(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, vLLM's rules: one text against one or many (1:1, 1:N: the query
    against every document), or two lists of the same length paired in order (N:N). Anything else is a ValueError
    naming the argument."""
    texts_1 = _as_texts("text_1", data_1)
    texts_2 = _as_texts("text_2", data_2)
    if not texts_1:
        raise ValueError("text_1 must hold at least one text")
    if not texts_2:
        raise ValueError("text_2 must hold at least one text")
    if len(texts_1) == 1:
        return [(texts_1[0], text) for text in texts_2]
    if len(texts_1) != len(texts_2):
        raise ValueError(
            f"text_1 has {len(texts_1)} texts and text_2 {len(texts_2)}: pass one text_1, or as many as text_2"
        )
    return list(zip(texts_1, texts_2, strict=True))


def _as_texts(name: str, data: object) -> list[str]:
    if isinstance(data, str):
        return [data]
    if not isinstance(data, Sequence) or not all(isinstance(item, str) for item in data):
        raise ValueError(f"{name} must be a string or a list of strings")
    return list(data)


def pair_prompt(tokenizer: Tokenizer, text_1: str, text_2: str) -> dict[str, Any]:
    """A cross-encoder's prompt for a pair: the pair's token ids and token type ids (`Tokenizer.encode_pair`)."""
    token_ids, token_type_ids = tokenizer.encode_pair(text_1, text_2)
    return {"prompt_token_ids": token_ids, "token_type_ids": token_type_ids}


def cosine_similarity(embedding_1: torch.Tensor, embedding_2: torch.Tensor) -> float:
    """The cosine similarity of two embeddings (float32), as sentence-transformers' `cos_sim` computes it."""
    return float(F.cosine_similarity(embedding_1.float(), embedding_2.float(), dim=0))
