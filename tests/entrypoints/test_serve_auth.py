"""--api-key: every path needs `Authorization: Bearer KEY` except the probes (/health, /metrics, /version); without
--enable-admin-endpoints the admin endpoints do not exist."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kvflow.testing.hash_model import reference_tokens
from tests.entrypoints.server import HASH_SERVER, RemoteServer, running_server

KEY = "sk-kvflow-test"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(*HASH_SERVER, api_key=KEY) as remote:
        yield remote


def test_openai_client_with_the_key_is_served(server: RemoteServer) -> None:
    completion = server.client().completions.create(
        model="hash",
        prompt=[1, 2, 3],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert completion.choices[0].token_ids == reference_tokens([1, 2, 3], 4)


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


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/reset_prefix_cache"),
        ("POST", "/abort_requests"),
        ("POST", "/update_weights"),
        ("GET", "/weight_version"),
        ("POST", "/collective_rpc"),
    ],
)
def test_admin_endpoints_need_the_flag(server: RemoteServer, method: str, path: str) -> None:
    with server.http() as http:
        response = http.request(method, path, json={})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "NotFoundError"
