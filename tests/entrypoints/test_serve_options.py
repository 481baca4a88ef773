"""Server options: --api-key (every path needs `Authorization: Bearer KEY` except the probes /health, /metrics and
/version, admin endpoints included), --served-model-name, and the engine's --scheduling-policy priority behind
vLLM's `priority` field. (Without --enable-admin-endpoints the admin endpoints do not exist: test_serve_hostile.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvflow.testing.hash_model import reference_tokens
from tests.entrypoints.server import HASH_SERVER, RemoteServer, running_server, sse_payloads

KEY = "sk-kvflow-test"
NAME = "my-model"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    options = [
        "--served-model-name",
        NAME,
        "--scheduling-policy",
        "priority",
        "--max-num-seqs",
        "1",
        "--enable-admin-endpoints",
    ]
    with running_server(*HASH_SERVER, *options, api_key=KEY) as remote:
        yield remote


def test_openai_client_with_the_key_is_served(server: RemoteServer) -> None:
    completion = server.client().completions.create(
        model=NAME,
        prompt=[1, 2, 3],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert completion.choices[0].token_ids == reference_tokens([1, 2, 3], 4)
    assert completion.model == NAME


def test_a_wrong_key_is_an_authentication_error(server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/abort_requests"),
        ("POST", "/update_weights"),
        ("GET", "/weight_version"),
        ("POST", "/collective_rpc"),
    ],
)
def test_guarded_paths_need_the_key(server: RemoteServer, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        response = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
        assert response.status_code == 401, (path, headers)
        assert response.json()["error"]["type"] == "AuthenticationError"
    assert server.get("/is_paused").json() == {
        "is_paused": False
    }  # the unauthorized /pause did nothing


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_probes_stay_open(server: RemoteServer, path: str) -> None:
    assert httpx.get(f"{server.url}{path}").status_code == 200


def test_the_served_model_name_is_the_only_name(server: RemoteServer) -> None:
    [card] = server.get("/v1/models").json()["data"]
    assert (card["id"], card["root"]) == (NAME, "hash")
    response = server.post(
        "/v1/completions", json={"model": "hash", "prompt": [1, 2], "max_tokens": 2}
    )
    assert (response.status_code, response.json()["error"]["param"]) == (404, "model")


def test_priority_decides_which_waiting_request_runs_first(server: RemoteServer) -> None:
    """One slot; a low-priority request queued before a high-priority one runs after it. A "wait" pause sent while
    the first admitted request runs lets exactly that one finish and holds the other, waiting, untouched."""

    async def stream(
        http: httpx.AsyncClient, prompt: list[int], max_tokens: int, priority: int
    ) -> list[int]:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "priority": priority,
            "return_token_ids": True,
        }
        async with http.stream("POST", "/v1/completions", json=body) as response:
            payloads = sse_payloads([line async for line in response.aiter_lines()])
        return [token for payload in payloads[:-1] for token in payload["choices"][0]["token_ids"]]

    async def waiting(http: httpx.AsyncClient, expected: float) -> None:
        while server.metric("kvflow:num_requests_waiting") != expected:
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        async with server.async_http() as http:
            await http.post("/pause", params={"mode": "keep"})
            low = asyncio.ensure_future(stream(http, [7, 7, 7], 20, priority=5))
            await waiting(http, 1)
            high = asyncio.ensure_future(stream(http, [8, 8, 8], 600, priority=-5))
            await waiting(http, 2)
            await http.post("/resume")
            await http.post(
                "/pause", params={"mode": "wait"}
            )  # returns once the running one finished
            assert await high == reference_tokens([8, 8, 8], 600)
            assert not low.done()
            assert server.metric("kvflow:num_requests_waiting") == 1
            await http.post("/resume")
            assert await low == reference_tokens([7, 7, 7], 20)

    asyncio.run(asyncio.wait_for(scenario(), 120))
