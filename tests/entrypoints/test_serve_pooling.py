"""`kvflow serve MODEL --runner pooling` (issue 43 item 4): /v1/embeddings through the official `openai` client,
/v1/score, /v1/rerank, /classify and /pooling as raw JSON, and their errors.

Tiny random checkpoints (`kvflow.testing.pooling_checkpoints`), one server each, all started at once: a
sentence-transformers BERT embedder (mean pooling, normalized, Matryoshka sizes; behind an API key, with a chat
template), a BERT cross-encoder with one label, and a three-label Qwen2 classifier with named labels. The oracle
for every value is the offline engine on the same checkpoint (`LLM(..., runner="pooling")`'s `embed`, `score`,
`classify`, `encode`), which the server must match to float32 precision. A generate server (the hash model)
checks the reverse refusal.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from kvflow.entrypoints.llm import LLM
from kvflow.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from kvflow.pooling_params import PoolingParams
from kvflow.testing.pooling_checkpoints import make_tiny_decoder_classifier, make_tiny_encoder
from tests.entrypoints.server import HASH_SERVER, RemoteServer
from tests.entrypoints.test_serve_hostile import random_json
from tests.entrypoints.test_serve_rl import wait_for_metric

API_KEY = "pooling-test-key"
EMBEDDER = "tiny-embedder"
RERANKER = "tiny-reranker"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "What is the capital of France?",
]
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Berlin is the capital of Germany.",
    "Paris is the capital and most populous city of France.",
    "A monkey is playing drums.",
    "The weather today is sunny.",
]
# Longer than the checkpoints' 128 positions.
LONG_TEXT = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)
ATOL = 1e-6
LABELS = ["negative", "neutral", "positive"]
# The embedder server's chat template (for /v1/embeddings' `messages` form).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
)


@dataclass(frozen=True)
class Checkpoints:
    embedder: Path
    reranker: Path
    classifier: Path


def make_checkpoints(root: Path) -> Checkpoints:
    embedder = make_tiny_encoder(
        root / "embedder", "bert", sentence_transformers={"pooling": "mean", "normalize": True}
    )
    _update_config(embedder, matryoshka_dimensions=[8, 16, 64])  # `dimensions` may cut to 8 or 16
    reranker = make_tiny_encoder(root / "reranker", "bert_cls", seed=1)
    _update_config(reranker, id2label={"0": "relevant"}, label2id={"relevant": 0})
    classifier = make_tiny_decoder_classifier(root / "classifier", num_labels=3, seed=2)
    _update_config(
        classifier,
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
    )
    return Checkpoints(embedder, reranker, classifier)


def _update_config(folder: Path, **fields: object) -> None:
    config_path = folder / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **fields}))


@dataclass(frozen=True)
class Servers:
    checkpoints: Checkpoints
    embed: RemoteServer
    rerank: RemoteServer
    classify: RemoteServer
    generate: RemoteServer


def _pooling_launches(checkpoints: Checkpoints) -> dict[str, tuple[list[str], str | None]]:
    """Each pooling server's arguments and API key."""
    embed_args = [str(checkpoints.embedder), "--runner", "pooling", "--served-model-name", EMBEDDER]
    embed_args += ["--enable-admin-endpoints", "--chat-template", CHAT_TEMPLATE]
    rerank_args = [
        str(checkpoints.reranker),
        "--runner",
        "pooling",
        "--served-model-name",
        RERANKER,
    ]
    classify_args = [str(checkpoints.classifier), "--runner", "pooling"]
    # Only the embedder's engine core runs in a process of its own (kvflow serve's default layout, where the
    # disconnect and abort tests run); the others keep theirs in the server process: three fewer processes to
    # start (the setup took 13 s instead of 8).
    return {
        "embed": (embed_args, API_KEY),
        "rerank": ([*rerank_args, "--no-engine-process"], None),
        "classify": ([*classify_args, "--no-engine-process"], None),
    }


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Every server, started (and stopped) at once, the generate one while the checkpoints are written: each
    start is mostly waiting on imports."""
    started: dict[str, RemoteServer] = {}
    failure: BaseException | None = None
    with ThreadPoolExecutor(4) as pool:
        futures = {"generate": pool.submit(RemoteServer, *HASH_SERVER, "--no-engine-process")}
        try:
            checkpoints = make_checkpoints(tmp_path_factory.mktemp("pooling-serve"))
            for name, (args, api_key) in _pooling_launches(checkpoints).items():
                futures[name] = pool.submit(RemoteServer, *args, api_key=api_key)
        except BaseException as error:  # the servers started are stopped below
            failure = error
        for name, future in futures.items():
            try:
                started[name] = future.result()
            except BaseException as error:
                failure = error
    try:
        if failure is not None:
            raise failure
        yield Servers(checkpoints, **started)
    finally:
        with ThreadPoolExecutor(len(started) or 1) as pool:
            list(pool.map(RemoteServer.stop, started.values()))
        for server in started.values():
            server.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def checkpoints(servers: Servers) -> Checkpoints:
    return servers.checkpoints


@pytest.fixture(scope="module")
def embed_server(servers: Servers) -> RemoteServer:
    return servers.embed


@pytest.fixture(scope="module")
def rerank_server(servers: Servers) -> RemoteServer:
    return servers.rerank


@pytest.fixture(scope="module")
def embed_llm(checkpoints: Checkpoints) -> Iterator[LLM]:
    llm = LLM(str(checkpoints.embedder), runner="pooling")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def rerank_llm(checkpoints: Checkpoints) -> Iterator[LLM]:
    llm = LLM(str(checkpoints.reranker), runner="pooling")
    yield llm
    llm.shutdown()


def _error(response: httpx.Response, status: int, param: str | None) -> str:
    """The message of an OpenAI-shaped error with `status` and `param` (asserted)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param, error
    return str(error["message"])


def _decode(text: str) -> list[float]:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()


# ---------------------------------------------------------------------------------------------------- embeddings
def test_embeddings_through_the_openai_client(embed_server: RemoteServer, embed_llm: LLM) -> None:
    expected = embed_llm.embed(TEXTS, use_tqdm=False)
    client = embed_server.client()
    floats = client.embeddings.create(
        model=EMBEDDER, input=TEXTS, encoding_format="float", user="someone"
    )
    # The client's default: base64, decoded by the client itself.
    decoded = client.embeddings.create(model=EMBEDDER, input=TEXTS)
    for response in (floats, decoded):
        assert response.object == "list" and response.model == EMBEDDER
        assert [item.index for item in response.data] == [0, 1, 2]
        for item, output in zip(response.data, expected, strict=True):
            assert item.object == "embedding"
            np.testing.assert_allclose(item.embedding, output.outputs.embedding, atol=ATOL, rtol=0)
        num_tokens = sum(len(output.prompt_token_ids) for output in expected)
        assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    assert floats.id.startswith("embd-")
    norm = float(np.linalg.norm(floats.data[0].embedding))
    assert norm == pytest.approx(1.0, abs=1e-5)


def test_many_inputs_come_back_in_order(
    embed_server: RemoteServer, rerank_server: RemoteServer, rerank_llm: LLM
) -> None:
    """More inputs than `serving_engine.MANY_PROMPTS`: prepared on a worker thread, run at once, answered in input
    order."""
    texts = [f"{text} ({index})" for index, text in enumerate(TEXTS * 7)]
    response = embed_server.client().embeddings.create(model=EMBEDDER, input=texts)
    alone = embed_server.client().embeddings.create(model=EMBEDDER, input=texts[17])
    assert [item.index for item in response.data] == list(range(len(texts)))
    np.testing.assert_allclose(response.data[17].embedding, alone.data[0].embedding, atol=ATOL)
    expected = rerank_llm.score(QUERY, texts, use_tqdm=False)
    scores = rerank_server.post("/score", json={"text_1": QUERY, "text_2": texts}).json()["data"]
    np.testing.assert_allclose(
        [item["score"] for item in scores], [output.outputs.score for output in expected], atol=ATOL
    )


def test_embeddings_dimensions_normalize_and_token_ids(
    embed_server: RemoteServer, embed_llm: LLM
) -> None:
    client = embed_server.client()
    tokenizer = embed_llm.get_tokenizer()
    token_ids = [tokenizer.encode(text) for text in TEXTS]
    by_text = client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="float")
    by_ids = client.embeddings.create(model=EMBEDDER, input=token_ids, encoding_format="float")
    one_ids = client.embeddings.create(model=EMBEDDER, input=token_ids[1], encoding_format="float")
    for item, same in zip(by_ids.data, by_text.data, strict=True):
        np.testing.assert_allclose(item.embedding, same.embedding, atol=ATOL, rtol=0)
    np.testing.assert_allclose(one_ids.data[0].embedding, by_text.data[1].embedding, atol=ATOL)
    assert by_ids.usage.prompt_tokens == sum(map(len, token_ids))

    cut = client.embeddings.create(model=EMBEDDER, input=TEXTS[0], dimensions=8)
    [expected] = embed_llm.embed(
        [TEXTS[0]], pooling_params=PoolingParams(dimensions=8), use_tqdm=False
    )
    assert len(cut.data[0].embedding) == 8
    np.testing.assert_allclose(cut.data[0].embedding, expected.outputs.embedding, atol=ATOL)

    raw = embed_server.post(
        "/v1/embeddings", json={"input": TEXTS[0], "normalize": False, "encoding_format": "base64"}
    )
    assert raw.status_code == 200, raw.text
    EmbeddingResponse.model_validate(raw.json())
    [plain] = embed_llm.embed(
        [TEXTS[0]], pooling_params=PoolingParams(normalize=False), use_tqdm=False
    )
    np.testing.assert_allclose(
        _decode(raw.json()["data"][0]["embedding"]), plain.outputs.embedding, atol=1e-5
    )


def test_embeddings_of_chat_messages(embed_server: RemoteServer, embed_llm: LLM) -> None:
    """vLLM's chat form: the messages rendered with the chat template, no special tokens added by default."""
    messages = [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": TEXTS[1]}]
    rendered = "".join(f"{message['role']}: {message['content']}\n" for message in messages)
    token_ids = embed_llm.get_tokenizer().encode(rendered, add_special_tokens=False)
    [expected] = embed_llm.embed([{"prompt_token_ids": token_ids}], use_tqdm=False)
    response = embed_server.post("/v1/embeddings", json={"messages": messages})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(token_ids)
    np.testing.assert_allclose(
        response.json()["data"][0]["embedding"], expected.outputs.embedding, atol=ATOL
    )


def test_too_long_inputs_and_truncation(embed_server: RemoteServer, embed_llm: LLM) -> None:
    response = embed_server.post("/v1/embeddings", json={"input": ["short", LONG_TEXT]})
    assert "maximum context length is 128" in _error(response, 400, "input")
    cut = embed_server.post(
        "/v1/embeddings", json={"input": LONG_TEXT, "truncate_prompt_tokens": 20}
    )
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 20
    [expected] = embed_llm.embed([LONG_TEXT], truncate_prompt_tokens=20, use_tqdm=False)
    np.testing.assert_allclose(
        cut.json()["data"][0]["embedding"], expected.outputs.embedding, atol=ATOL
    )


def test_embedding_errors(embed_server: RemoteServer) -> None:
    client = embed_server.client()
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBEDDER, input="x", dimensions=100_000)
    assert caught.value.body["param"] == "dimensions"  # type: ignore[index]
    cases = [
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [1.5]}, "input"),
        ({}, "input"),
        ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input"),
        ({"input": "x", "priority": 3}, "priority"),
        ({"input": [10**9]}, "input"),
        ({"input": "x", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
    ]
    for body, param in cases:
        _error(embed_server.post("/v1/embeddings", json=body), 400, param)
    # The server's API key guards the pooling endpoints too.
    unauthorized = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": "x"})
    assert unauthorized.status_code == 401


def test_wrong_task_and_runner_are_400s(embed_server: RemoteServer) -> None:
    message = _error(embed_server.post("/classify", json={"input": "x"}), 400, None)
    assert "'classify'" in message and "embeddings" in message
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {"prompt": "x"} if path == "/v1/completions" else {"messages": []}
        message = _error(embed_server.post(path, json=body), 400, None)
        assert message == f"this model runs with --runner pooling; {path} needs --runner generate"
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        embed_server.client().completions.create(model=EMBEDDER, prompt="x")
    models = embed_server.client().models.list()
    assert [card.id for card in models.data] == [EMBEDDER]
    tokens = embed_server.post("/tokenize", json={"prompt": TEXTS[0]})
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["count"] == len(tokens.json()["tokens"]) > 2


def test_request_id_header_and_metrics(embed_server: RemoteServer) -> None:
    before = embed_server.metric("kvflow:prompt_tokens_total")
    response = embed_server.post(
        "/v1/embeddings", json={"input": TEXTS}, headers={"X-Request-Id": "embed-abc"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["X-Request-Id"] == "embed-abc"
    assert response.json()["id"] == "embd-embed-abc"
    num_tokens = response.json()["usage"]["prompt_tokens"]
    embed_server.wait_for_metric("kvflow:prompt_tokens_total", before + num_tokens)


def test_client_disconnect_aborts_its_inputs(embed_server: RemoteServer) -> None:
    """A keep pause holds the request's three inputs waiting in the engine; the client goes away; every input is
    aborted (nothing waits any more, still paused), and the server serves the next request once resumed."""

    async def scenario() -> None:
        async with embed_server.async_http() as http:
            assert (await http.post("/pause", params={"mode": "keep"})).json() == {
                "status": "paused"
            }
            try:
                task = asyncio.ensure_future(http.post("/v1/embeddings", json={"input": TEXTS}))
                await wait_for_metric(http, "kvflow:num_requests_waiting", len(TEXTS))
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await wait_for_metric(http, "kvflow:num_requests_waiting", 0)
            finally:
                await http.post("/resume")
            response = await http.post("/v1/embeddings", json={"input": TEXTS[0]})
            assert response.status_code == 200, response.text

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_abort_requests_by_response_id(embed_server: RemoteServer) -> None:
    """POST /abort_requests takes a pooling response's id (`embd-<request id>`); the aborted request, held by a
    keep pause, is answered with an error naming the abort (a pooling request has no partial result)."""

    async def scenario() -> None:
        async with embed_server.async_http() as http:
            assert (await http.post("/pause", params={"mode": "keep"})).json() == {
                "status": "paused"
            }
            try:
                task = asyncio.ensure_future(
                    http.post(
                        "/v1/embeddings", json={"input": TEXTS}, headers={"X-Request-Id": "held"}
                    )
                )
                await wait_for_metric(http, "kvflow:num_requests_waiting", len(TEXTS))
                aborted = await http.post("/abort_requests", json={"request_ids": ["embd-held"]})
                assert aborted.json() == {"aborted": ["embd-held"]}
                response = await task
            finally:
                await http.post("/resume")
            assert response.status_code == 500
            assert "abort" in response.json()["error"]["message"]

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_cosine_scores_on_an_embedding_model(embed_server: RemoteServer, embed_llm: LLM) -> None:
    expected = [
        output.outputs.score for output in embed_llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    ]
    for path in ("/v1/score", "/score"):
        response = embed_server.post(path, json={"text_1": QUERY, "text_2": DOCUMENTS})
        assert response.status_code == 200, response.text
        body = response.json()
        ScoreResponse.model_validate(body)
        assert body["object"] == "list" and body["model"] == EMBEDDER
        assert body["id"].startswith("score-")
        assert [item["index"] for item in body["data"]] == [0, 1, 2, 3]
        assert {item["object"] for item in body["data"]} == {"score"}
        np.testing.assert_allclose([item["score"] for item in body["data"]], expected, atol=ATOL)
    rerank = embed_server.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert rerank.status_code == 200, rerank.text
    assert [item["index"] for item in rerank.json()["results"]] == list(
        np.argsort(-np.asarray(expected), kind="stable")
    )


# ---------------------------------------------------------------------------------------------------- cross-encoder
def test_cross_encoder_scores(rerank_server: RemoteServer, rerank_llm: LLM) -> None:
    expected = [
        output.outputs.score for output in rerank_llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    ]
    one_to_n = rerank_server.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
    assert one_to_n.status_code == 200, one_to_n.text
    scores = [item["score"] for item in one_to_n.json()["data"]]
    np.testing.assert_allclose(scores, expected, atol=ATOL)
    pair_tokens = sum(
        len(rerank_llm.get_tokenizer().encode_pair(QUERY, doc)[0]) for doc in DOCUMENTS
    )
    assert one_to_n.json()["usage"]["prompt_tokens"] == pair_tokens

    n_to_n = rerank_server.post(
        "/score", json={"queries": [QUERY, QUERY], "documents": DOCUMENTS[2:]}
    )
    assert n_to_n.status_code == 200, n_to_n.text
    np.testing.assert_allclose(
        [item["score"] for item in n_to_n.json()["data"]], expected[2:], atol=ATOL
    )
    one_to_one = rerank_server.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS[1]})
    assert one_to_one.json()["data"][0]["score"] == pytest.approx(expected[1], abs=ATOL)

    mismatched = {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:3]}
    assert "1:1, 1:N" in _error(rerank_server.post("/score", json=mismatched), 400, "text_2")
    _error(rerank_server.post("/score", json={"text_1": QUERY}), 400, "text_2")
    _error(rerank_server.post("/score", json={"text_1": [], "text_2": "x"}), 400, "text_1")


def test_rerank(rerank_server: RemoteServer, rerank_llm: LLM) -> None:
    expected = [
        output.outputs.score for output in rerank_llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    ]
    order = [int(index) for index in np.argsort(-np.asarray(expected), kind="stable")]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        response = rerank_server.post(
            path, json={"model": RERANKER, "query": QUERY, "documents": DOCUMENTS}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        RerankResponse.model_validate(body)
        assert body["model"] == RERANKER and body["id"].startswith("rerank-")
        assert [item["index"] for item in body["results"]] == order
        for item in body["results"]:
            assert item["document"] == {"text": DOCUMENTS[item["index"]]}
            assert item["relevance_score"] == pytest.approx(expected[item["index"]], abs=ATOL)
        assert body["usage"]["total_tokens"] > 0
    top = rerank_server.post(
        "/rerank",
        json={
            "query": QUERY,
            "documents": [{"text": doc} for doc in DOCUMENTS],
            "top_n": 2,
            "return_documents": False,
        },
    ).json()
    assert [item["index"] for item in top["results"]] == order[:2]
    assert all("document" not in item for item in top["results"])
    _error(rerank_server.post("/rerank", json={"query": QUERY, "documents": []}), 400, "documents")
    bad_top_n = {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}
    _error(rerank_server.post("/rerank", json=bad_top_n), 400, "top_n")


def test_classify_and_pooling(rerank_server: RemoteServer, rerank_llm: LLM) -> None:
    expected = rerank_llm.classify(TEXTS, use_tqdm=False)
    response = rerank_server.post("/classify", json={"model": RERANKER, "input": TEXTS})
    assert response.status_code == 200, response.text
    body = response.json()
    ClassificationResponse.model_validate(body)
    assert body["id"].startswith("classify-") and body["object"] == "list"
    for item, output in zip(body["data"], expected, strict=True):
        assert item["label"] == "relevant" and item["num_classes"] == 1
        np.testing.assert_allclose(item["probs"], output.outputs.probs, atol=ATOL)
    one = rerank_server.post("/classify", json={"input": TEXTS[0]}).json()
    assert len(one["data"]) == 1

    pooled = rerank_server.post("/pooling", json={"input": TEXTS[:2]})
    assert pooled.status_code == 200, pooled.text
    PoolingResponse.model_validate(pooled.json())
    [first, _] = rerank_llm.encode(TEXTS[:2], use_tqdm=False)
    data = pooled.json()["data"]
    assert [item["object"] for item in data] == ["pooling", "pooling"]
    np.testing.assert_allclose(data[0]["data"], first.outputs.data.tolist(), atol=ATOL)

    message = _error(rerank_server.post("/v1/embeddings", json={"input": "x"}), 400, None)
    assert "'embed'" in message and "classification" in message
    _error(rerank_server.post("/pooling", json={"input": "x", "task": "embed"}), 400, "task")
    by_task = rerank_server.post("/pooling", json={"input": TEXTS[0], "task": "classify"}).json()
    np.testing.assert_allclose(by_task["data"][0]["data"], expected[0].outputs.probs, atol=ATOL)


def test_decoder_classifier_labels(servers: Servers, checkpoints: Checkpoints) -> None:
    """A three-label Qwen2 classifier: each input's probabilities and its most probable class's name; it scores no
    pairs (only one-label classifiers do), which is a 400 naming the task."""
    llm = LLM(str(checkpoints.classifier), runner="pooling")
    try:
        expected = llm.classify(TEXTS, use_tqdm=False)
    finally:
        llm.shutdown()
    response = servers.classify.post("/classify", json={"input": TEXTS})
    assert response.status_code == 200, response.text
    for item, output in zip(response.json()["data"], expected, strict=True):
        probs = output.outputs.probs
        assert item["num_classes"] == 3
        assert item["label"] == LABELS[int(np.argmax(probs))]
        np.testing.assert_allclose(item["probs"], probs, atol=ATOL)
    score = servers.classify.post("/score", json={"text_1": "a", "text_2": "b"})
    assert "'score'" in _error(score, 400, None)


FUZZED = {  # each pooling path's request model, and a valid body its fields are fuzzed from
    "/v1/embeddings": (EmbeddingRequest, {"input": ["a b", "c"]}),
    "/pooling": (PoolingRequest, {"input": "a b"}),
    "/classify": (ClassificationRequest, {"input": "x"}),
    "/score": (ScoreRequest, {"text_1": "a", "text_2": ["b", "c"]}),
    "/rerank": (RerankRequest, {"query": "q", "documents": ["a", "b"]}),
}


def test_random_json_at_every_field_is_never_a_5xx(servers: Servers) -> None:
    """`test_serve_hostile`'s hurtful JSON values in one to three fields of a valid body, on both kinds of pooling
    server: each answer is a 200 or an error in OpenAI's shape below 500, and the servers stay healthy."""
    rng = random.Random(43)
    statuses: dict[int, int] = {}
    for server in (servers.embed, servers.rerank):
        with server.http() as http:
            for _ in range(25):
                path = rng.choice(list(FUZZED))
                model, base = FUZZED[path]
                body: dict[str, Any] = dict(base)
                for field_name in rng.sample(sorted(model.model_fields), rng.randrange(1, 4)):
                    body[field_name] = random_json(rng)
                try:
                    raw = json.dumps(body).encode("utf-8", "surrogatepass")
                except RecursionError:
                    continue
                response = http.post(
                    path, content=raw, headers={"content-type": "application/json"}
                )
                assert response.status_code < 500, (path, str(body)[:400], response.text[:400])
                if response.status_code != 200:
                    assert response.json()["error"]["code"] == response.status_code
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert server.get("/health").status_code == 200
    assert statuses.get(400, 0) > 0 and statuses.get(200, 0) > 0, statuses


# ---------------------------------------------------------------------------------------------------- generate
def test_pooling_endpoints_on_a_generate_server(servers: Servers) -> None:
    server = servers.generate
    for path in ("/v1/embeddings", "/pooling", "/classify"):
        message = _error(server.post(path, json={"input": [1, 2]}), 400, None)
        assert message == f"this model runs with --runner generate; {path} needs --runner pooling"
    for path in ("/v1/score", "/score"):
        _error(server.post(path, json={"text_1": "a", "text_2": "b"}), 400, None)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        _error(server.post(path, json={"query": "a", "documents": ["b"]}), 400, None)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        server.client().embeddings.create(model="hash", input=[1, 2])
    completion = server.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert completion.status_code == 200, completion.text
