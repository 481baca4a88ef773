"""The pooling endpoints' pure parts, without an engine (issue 43): score pairing (1:1, 1:N, N:N and the errors),
rerank order and `top_n`, `input` forms, base64 embeddings as the official `openai` client decodes them, the score
request's two namings, classifier labels from config.json, and the runner check."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol_pooling import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from kvflow.entrypoints.openai.serving_classification import label_of, load_id2label
from kvflow.entrypoints.openai.serving_pooling import encode_base64, input_items, require_runner
from kvflow.entrypoints.openai.serving_score import pair_texts, rank, score_sides


def _refused(param: str | None) -> pytest.RaisesContext[OpenAIServingError]:
    return pytest.raises(OpenAIServingError, check=lambda error: error.param == param)


# ---------------------------------------------------------------------------------------------------- pairing
def test_pairing_one_to_one_one_to_n_and_n_to_n() -> None:
    assert pair_texts(["q"], ["d"]) == [(0, 0)]
    assert pair_texts(["q"], ["a", "b", "c"]) == [(0, 0), (0, 1), (0, 2)]
    assert pair_texts(["q1", "q2"], ["a", "b"]) == [(0, 0), (1, 1)]


def test_pairing_errors_name_the_field() -> None:
    with _refused("text_2") as caught:
        pair_texts(["q1", "q2"], ["a", "b", "c"])
    assert "1:1, 1:N" in caught.value.message and caught.value.status_code == 400
    with _refused("documents"):
        pair_texts(["q1", "q2", "q3"], ["a"], ("queries", "documents"))
    with _refused("text_1"):
        pair_texts([], ["a"])
    with _refused("documents"):
        pair_texts(["q"], [], ("query", "documents"))


def test_score_sides_take_either_naming() -> None:
    legacy = ScoreRequest(text_1="q", text_2=["a", "b"])
    assert score_sides(legacy) == (["q"], ["a", "b"], ("text_1", "text_2"))
    newer = ScoreRequest(queries=["q1", "q2"], documents=["a", "b"])
    assert score_sides(newer) == (["q1", "q2"], ["a", "b"], ("queries", "documents"))
    with _refused("text_2"):
        score_sides(ScoreRequest(text_1="q"))
    with _refused("queries"):
        score_sides(ScoreRequest(text_1="q", documents=["a"]))


def test_rank_is_best_first_with_ties_in_input_order_and_top_n() -> None:
    scores = [0.1, 0.9, 0.5, 0.9]
    assert rank(scores, 0) == [1, 3, 2, 0]
    assert rank(scores, 2) == [1, 3]
    assert rank(scores, 10) == [1, 3, 2, 0]
    with _refused("top_n"):
        rank(scores, -1)


def test_rerank_documents_may_be_objects() -> None:
    request = RerankRequest(query="q", documents=["a", {"text": "b"}])
    assert [doc if isinstance(doc, str) else doc.text for doc in request.documents] == ["a", "b"]


# ---------------------------------------------------------------------------------------------------- inputs
def test_input_forms() -> None:
    assert input_items("hello") == ["hello"]
    assert input_items(["a", "b"]) == ["a", "b"]
    assert input_items([1, 2, 3]) == [[1, 2, 3]]
    assert input_items([[1, 2], [3]]) == [[1, 2], [3]]
    for empty in ([], "", [[1], []]):
        with _refused("input"):
            input_items(empty)  # type: ignore[arg-type]
    with _refused("input"):
        input_items(None)


def test_embedding_request_types_are_checked() -> None:
    with pytest.raises(ValueError, match="encoding_format"):
        EmbeddingRequest(input="x", encoding_format="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input"):
        EmbeddingRequest(input=[1.5])  # type: ignore[list-item]
    assert EmbeddingRequest(input="x", user="u", dimensions=8).dimensions == 8


def test_base64_is_little_endian_float32_as_the_openai_client_decodes_it() -> None:
    values = torch.tensor([0.25, -1.5, 3.0e-8, 123.456], dtype=torch.float32)
    text = encode_base64(values)
    raw = base64.b64decode(text)
    assert raw == np.asarray(values.numpy(), dtype="<f4").tobytes()
    # The openai client's own decoding (openai.resources.embeddings: np.frombuffer(..., dtype="float32")).
    assert np.frombuffer(raw, dtype="float32").tolist() == values.tolist()
    rows = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert np.frombuffer(base64.b64decode(encode_base64(rows)), dtype="<f4").tolist() == [
        0.0,
        1.0,
        2.0,
        3.0,
        4.0,
        5.0,
    ]


# ---------------------------------------------------------------------------------------------------- labels
def test_labels_from_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"0": "neg", "1": "pos"}}))
    id2label = load_id2label(tmp_path)
    assert id2label == {0: "neg", 1: "pos"}
    assert label_of([0.2, 0.8], id2label) == "pos"
    assert label_of([0.5, 0.5], id2label) == "neg"
    assert label_of([0.1, 0.2, 0.7], {}) == "LABEL_2"
    assert load_id2label(tmp_path / "missing") == {}
    assert load_id2label(None) == {}


def test_runner_check_names_both_runners() -> None:
    require_runner("pooling", "pooling", "/v1/embeddings")
    with _refused(None) as caught:
        require_runner("pooling", "generate", "/v1/completions")
    assert caught.value.message == (
        "this model runs with --runner pooling; /v1/completions needs --runner generate"
    )
