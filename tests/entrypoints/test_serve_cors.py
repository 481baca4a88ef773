"""CORS (`--allowed-origins`, `--allowed-methods`, `--allowed-headers`, `--allow-credentials`, vLLM's flags): a
browser's preflight is answered before the API key is asked for, answers to an allowed origin carry
Access-Control-Allow-Origin (errors included), other origins get none, and a server without the flags sends no
CORS headers at all (closed by default, unlike vLLM)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvflow.entrypoints.cli.main import main
from kvflow.entrypoints.openai.middleware import cors_options
from kvflow.entrypoints.openai.server_config import CORSConfig
from kvflow.testing.hash_model import reference_tokens
from tests.entrypoints.server import HASH_SERVER, RemoteServer, running_server

KEY = "sk-cors-test"
APP = "https://app.example"
OTHER = "https://elsewhere.example"


def preflight(origin: str, method: str = "POST", headers: str | None = None) -> dict[str, str]:
    """The headers of a browser's preflight before a cross-origin `method` request carrying `headers`."""
    request = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        request["Access-Control-Request-Headers"] = headers
    return request


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(*HASH_SERVER, "--allowed-origins", f'["{APP}"]', api_key=KEY) as remote:
        yield remote


@pytest.fixture(scope="module")
def closed_server() -> Iterator[RemoteServer]:
    with running_server(*HASH_SERVER) as remote:
        yield remote


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_api_key(
    server: RemoteServer,
) -> None:
    response = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers=preflight(APP, "POST", "authorization, content-type"),
    )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == APP
    assert "POST" in response.headers["access-control-allow-methods"].split(", ")
    assert response.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in response.headers


def test_a_preflight_from_another_origin_is_refused(server: RemoteServer) -> None:
    response = httpx.options(
        f"{server.url}/v1/completions", headers=preflight(OTHER, "POST", "authorization")
    )
    assert response.status_code == 400
    assert "access-control-allow-origin" not in response.headers


def test_requests_from_an_allowed_origin_carry_the_cors_headers(server: RemoteServer) -> None:
    with server.http() as http:
        models = http.get("/v1/models", headers={"Origin": APP})
        completion = http.post(
            "/v1/completions",
            headers={"Origin": APP},
            json={"model": "hash", "prompt": [1, 2, 3], "max_tokens": 3, "return_token_ids": True},
        )
    assert models.status_code == 200
    assert models.headers["access-control-allow-origin"] == APP
    assert "Origin" in models.headers["vary"]
    assert completion.status_code == 200
    assert completion.headers["access-control-allow-origin"] == APP
    assert completion.json()["choices"][0]["token_ids"] == reference_tokens([1, 2, 3], 3)


def test_an_error_answer_carries_them_too_so_the_page_can_read_it(server: RemoteServer) -> None:
    response = httpx.get(f"{server.url}/v1/models", headers={"Origin": APP})  # no API key
    assert response.status_code == 401
    assert response.headers["access-control-allow-origin"] == APP
    assert response.json()["error"]["code"] == 401


def test_another_origin_gets_the_answer_but_no_allow_origin(server: RemoteServer) -> None:
    response = server.get("/v1/models", headers={"Origin": OTHER})
    assert response.status_code == 200  # the browser, not the server, withholds it from the page
    assert "access-control-allow-origin" not in response.headers


def test_without_allowed_origins_the_server_sends_no_cors_headers(
    closed_server: RemoteServer,
) -> None:
    answered = httpx.options(
        f"{closed_server.url}/v1/chat/completions", headers=preflight(APP, "POST", "content-type")
    )
    simple = closed_server.get("/v1/models", headers={"Origin": APP})
    assert answered.status_code == 405  # no route answers OPTIONS
    assert simple.status_code == 200
    for response in (answered, simple):
        assert not [name for name in response.headers if name.startswith("access-control-")]


def test_credentials_with_any_origin_name_the_requesting_origin() -> None:
    """Browsers refuse 'Access-Control-Allow-Origin: *' on a request with credentials: with
    --allow-credentials and '*' origins, the answer names the page's origin (Starlette's middleware, as built
    from the flags), for the preflight and for the request."""
    config = CORSConfig(allowed_origins=("*",), allow_credentials=True)

    async def echo(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[Route("/v1/models", echo)],
        middleware=[Middleware(CORSMiddleware, **cors_options(config))],
    )

    async def call() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvflow") as client:
            answered = await client.options(
                "/v1/models", headers=preflight(OTHER, "GET", "authorization")
            )
            simple = await client.get(
                "/v1/models", headers={"Origin": OTHER, "Cookie": "session=1"}
            )
            return answered, simple

    answered, simple = asyncio.run(call())
    assert answered.status_code == 200
    for response in (answered, simple):
        assert response.headers["access-control-allow-origin"] == OTHER
        assert response.headers["access-control-allow-credentials"] == "true"
    assert "*" not in answered.headers["access-control-allow-methods"]


def test_methods_are_taken_in_any_case() -> None:
    assert CORSConfig(("*",), allowed_methods=("get", "Post")).allowed_methods == ("GET", "POST")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--allowed-origins", "https://app.example"],
            "kvflow serve: error: argument --allowed-origins: expected a JSON list of strings",
        ),
        (
            ["--allowed-headers", '"authorization"'],
            "kvflow serve: error: argument --allowed-headers: expected a JSON list of non-empty strings",
        ),
        (
            ["--allow-credentials"],
            "kvflow serve: error: --allow-credentials needs --allowed-origins",
        ),
    ],
)
def test_bad_cors_flags_are_a_one_line_usage_error(
    flags: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "hash", "--port", "0", *flags])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(expected)
