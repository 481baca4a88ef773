"""Hostile requests against a real `kvflow serve` (loopback): none may kill the engine, stall the event loop or
exhaust memory. One test per way a single request once took the server down (the hardening review's table),
each checking the 4xx it now gets, that a good request running alongside finishes with exactly its expected
tokens, that `/health` stays 200 and that the engine process is the same one afterwards. Then random JSON at
every field of both endpoints (only 2xx/4xx, never 5xx), and 10,000 streamed requests over a keep-alive pool
without one client error.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvflow.default_model import ensure_default_model
from kvflow.entrypoints.openai.protocol import (
    BodySurrogateScan,
    ChatCompletionRequest,
    CompletionRequest,
)
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.waiting import wait_until
from kvflow.tokenizer import load_tokenizer, render_chat
from tests.entrypoints.server import (
    DEFAULT_SERVER,
    HASH_SERVER,
    STARTUP_TIMEOUT_S,
    RemoteServer,
    kvflow_command,
    parse_metrics,
    running_server,
    sse_payloads,
)

TIMEOUT_S = 120.0  # hang guard


def load_benchmark(name: str) -> Any:
    """A script of benchmarks/, imported through the `benchmarks` package."""
    return importlib.import_module(f"benchmarks.{name}")


KEEPALIVE_BENCHMARK = load_benchmark("serve_keepalive")
# The keep-alive benchmark's hash server (256 slots), with the admin endpoints.
HOSTILE_HASH_SERVER = [*KEEPALIVE_BENCHMARK.SERVER_ARGS, "--enable-admin-endpoints"]
# The default model, every server option at its default but the engine's size and the stream buffer (small, so
# that the unread-stream test overflows it soon after the kernel's socket buffers, ~3 MiB on loopback).
TEXT_SERVER = [
    *DEFAULT_SERVER,
    "--max-num-seqs",
    "16",
    "--num-kv-blocks",
    "1024",
    "--max-stream-buffer-bytes",
    "65536",
]
GOOD_PROMPT = [11, 12, 13, 14]
GOOD_MAX_TOKENS = 300
TEXT_PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is a KV cache?"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


# ------------------------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def hash_server() -> Iterator[RemoteServer]:
    with running_server(*HOSTILE_HASH_SERVER) as remote:
        yield remote


@pytest.fixture(scope="module")
def text_server() -> Iterator[RemoteServer]:
    """The default model without admin endpoints or request chat templates."""
    with running_server(*TEXT_SERVER) as remote:
        yield remote


@pytest.fixture(scope="module")
def trusting_server() -> Iterator[RemoteServer]:
    with running_server(*DEFAULT_SERVER, "--trust-request-chat-template") as remote:
        yield remote


_EXPECTED_TEXT: dict[str, list[int]] = {}  # server URL -> its good request's tokens


def expected_text(server: RemoteServer) -> list[int]:
    """The greedy tokens of the default model's good request (deterministic): asked once per server, the first
    time, before any hostile request reaches it."""
    if server.url not in _EXPECTED_TEXT:
        _EXPECTED_TEXT[server.url] = text_tokens(server)
    return _EXPECTED_TEXT[server.url]


def text_tokens(server: RemoteServer) -> list[int]:
    body = {"prompt": TEXT_PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def hash_tokens(server: RemoteServer) -> list[int]:
    """The good request on the hash model, streamed (so it runs for many engine steps)."""
    body = {
        "prompt": GOOD_PROMPT,
        "max_tokens": GOOD_MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        payloads = sse_payloads(list(response.iter_lines()))
    assert payloads[-1] == "[DONE]", payloads[-3:]
    return [token for payload in payloads[:-1] for token in payload["choices"][0]["token_ids"]]


@contextlib.contextmanager
def good_request_alongside(server: RemoteServer) -> Iterator[None]:
    """Runs the server's good request while the block runs; afterwards its tokens are exactly the expected ones,
    /health is 200 and the engine process is the one from before."""
    engine_pid = server.engine_pid()
    is_hash = server.get("/v1/models").json()["data"][0]["root"] == "hash"
    expected = reference_tokens(GOOD_PROMPT, GOOD_MAX_TOKENS) if is_hash else expected_text(server)
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(hash_tokens(server) if is_hash else text_tokens(server))
        except BaseException as error:  # reported by the assertion below
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield
    finally:
        thread.join(TIMEOUT_S)
    assert outcome == [expected]
    assert server.get("/health").status_code == 200
    assert server.engine_pid() == engine_pid


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (status, param), error
    return error


# ------------------------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": 9223372036854775808}, "top_k"),  # once killed the engine (int64 in the sampler)
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 1e30}, "top_k"),
        ({"seed": 2**64}, "seed"),  # once a 500 (msgspec cannot encode it)
        ({"seed": 2**63}, "seed"),
        ({"priority": 2**64}, "priority"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"logprobs": 2**64}, "logprobs"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"temperature": 1e39}, "temperature"),
        ({"repetition_penalty": 1e-50}, "repetition_penalty"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_numbers_out_of_range_are_400s_naming_the_field(
    text_server: RemoteServer, fields: dict[str, Any], param: str, stream: bool
) -> None:
    with good_request_alongside(text_server):
        body = {"prompt": TEXT_PROMPT, "max_tokens": 2, "stream": stream, **fields}
        assert_error(text_server.post("/v1/completions", json=body), 400, param)


def test_a_top_k_above_the_vocabulary_means_the_whole_vocabulary(text_server: RemoteServer) -> None:
    body = {"prompt": TEXT_PROMPT, "max_tokens": 4, "top_k": 2**31 - 1, "seed": 1}
    whole = {"prompt": TEXT_PROMPT, "max_tokens": 4, "top_k": -1, "seed": 1}
    first, second = (text_server.post("/v1/completions", json=each) for each in (body, whole))
    assert first.status_code == second.status_code == 200
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]


# ------------------------------------------------------------------------------------------------ limits
def test_n_and_best_of_are_bounded_and_refused_before_any_work(hash_server: RemoteServer) -> None:
    with good_request_alongside(hash_server):
        for n in (129, 10_000, 1_000_000, 10**9):
            body = {"prompt": [1, 2], "max_tokens": 1, "n": n}
            error = assert_error(hash_server.post("/v1/completions", json=body), 400, "n")
            assert "--max-n" in error["message"]
        body = {"prompt": [1, 2], "max_tokens": 1, "n": 2, "best_of": 10**6}
        assert_error(hash_server.post("/v1/completions", json=body), 400, "best_of")
        body = {"messages": MESSAGES, "max_tokens": 1, "n": 10**6}
        assert_error(hash_server.post("/v1/chat/completions", json=body), 400, "n")
        at_the_limit = hash_server.post(
            "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "n": 128}
        )
        assert at_the_limit.status_code == 200
        assert len(at_the_limit.json()["choices"]) == 128


def test_stop_strings_prompts_logit_bias_and_the_body_are_bounded(
    hash_server: RemoteServer,
) -> None:
    with good_request_alongside(hash_server):
        for stop in (["x"] * 100_000, ["x"] * 65, ["y" * 1001]):
            body = {"prompt": [1, 2], "max_tokens": 2, "stop": stop}
            assert_error(hash_server.post("/v1/completions", json=body), 400, "stop")
        many = {"prompt": [[1, 2]] * 1025, "max_tokens": 1}
        assert_error(hash_server.post("/v1/completions", json=many), 400, "prompt")
        bias = {"prompt": [1, 2], "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(301)}}
        assert_error(hash_server.post("/v1/completions", json=bias), 400, "logit_bias")
        huge = b'{"prompt": [1, 2], "max_tokens": 1, "user": "' + b"a" * (33 * 2**20) + b'"}'
        with hash_server.http() as http:
            response = http.post(
                "/v1/completions", content=huge, headers={"content-type": "application/json"}
            )
        assert_error(response, 413, None)
        allowed = hash_server.post(
            "/v1/completions", json={"prompt": [[1, 2]] * 64, "max_tokens": 1, "stop": ["x"] * 64}
        )
        assert allowed.status_code == 200 and len(allowed.json()["choices"]) == 64


# ------------------------------------------------------------------------------------------------ chat templates
def test_request_chat_templates_are_refused_by_default(text_server: RemoteServer) -> None:
    with good_request_alongside(text_server):
        body = {"messages": MESSAGES, "max_tokens": 1, "chat_template": NESTED_LOOPS}
        error = assert_error(
            text_server.post("/v1/chat/completions", json=body), 400, "chat_template"
        )
        assert "--trust-request-chat-template" in error["message"]
        tokenize = {"messages": MESSAGES, "chat_template": "{{ messages }}"}
        assert_error(text_server.post("/tokenize", json=tokenize), 400, "chat_template")
        sneaked = {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
        assert_error(text_server.post("/tokenize", json=sneaked), 400, "chat_template_kwargs")


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (NESTED_LOOPS, "did not finish rendering within 5 s"),
        ('{{ "a" * 10000000 }}', "longer than"),
        ('{{ "x" | center(3000000000) }}', "more memory"),
        ("{% for i in range(1000000000) %}x{% endfor %}", "Range too big"),
        ("{{ ().__class__.__base__.__subclasses__() }}", "unsafe"),
    ],
)
def test_trusted_request_templates_render_in_a_bounded_sandbox(
    trusting_server: RemoteServer, template: str, message: str
) -> None:
    """A hostile template costs at most its time limit, and only its own request: the good request and /health
    are answered meanwhile (the render runs in another process)."""
    with good_request_alongside(trusting_server):
        body = {"messages": MESSAGES, "max_tokens": 1, "chat_template": template}
        error = assert_error(
            trusting_server.post("/v1/chat/completions", json=body), 400, "chat_template"
        )
        assert message in error["message"]


def test_a_trusted_request_template_renders_the_prompt(trusting_server: RemoteServer) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    response = trusting_server.post(
        "/tokenize", json={"messages": MESSAGES, "chat_template": template}
    )
    plain = trusting_server.post(
        "/tokenize",
        json={"prompt": "<user>What is a KV cache?", "add_special_tokens": False},
    )
    assert response.status_code == plain.status_code == 200
    assert response.json()["tokens"] == plain.json()["tokens"]


def test_a_sandboxed_template_renders_through_the_one_chat_renderer(
    trusting_server: RemoteServer,
) -> None:
    """Content parts, tool calls and continue_final_message reach a request template in the sandbox exactly as
    they reach a trusted one in-process (`prepare_chat`, the sandbox's render, `PreparedChat.finish`)."""
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}{% endif %}{% endfor %}<end>"
    )
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "22 C"},
        {"role": "assistant", "content": "It is"},
    ]
    body = {
        "messages": messages,
        "chat_template": template,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    response = trusting_server.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    expected = render_chat(
        load_tokenizer(ensure_default_model()),
        messages,
        chat_template=template,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert (
        expected.prompt_text == "<user>Weather\nin Paris?<assistant>Paris<tool>22 C<assistant>It is"
    )
    assert response.json()["tokens"] == expected.prompt_token_ids


def test_thousands_of_distinct_request_templates_do_not_grow_the_server(
    trusting_server: RemoteServer,
) -> None:
    """Each template is compiled once in the sandbox, which keeps the latest 64; the API process keeps none."""

    def send(first: int, count: int) -> None:
        with trusting_server.http() as http:
            for index in range(first, first + count):
                template = "{{ messages[0].content }}" + "x" * 2000 + str(index)
                response = http.post(
                    "/tokenize", json={"messages": MESSAGES, "chat_template": template}
                )
                assert response.status_code == 200, response.text

    send(0, 100)  # past the cache size: every allocator pool the templates use exists now
    before = trusting_server.rss_bytes()
    send(100, 400)
    growth = trusting_server.rss_bytes() - before
    assert growth < 12 * 2**20, f"the API process grew by {growth / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------------ text
@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
            "messages",
        ),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "x\\udc00"}]}', "messages"),
        # a surrogate's own UTF-8 bytes (JSON decodes bytes with "surrogatepass"), and a UTF-16 body
        ("/v1/completions", b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}', "prompt"),
        (
            "/v1/completions",
            '{"prompt": "a\\ud800", "max_tokens": 2}'.encode("utf-16-le", "surrogatepass"),
            "prompt",
        ),
        (
            "/v1/completions",
            b'{"prompt": "x", "max_tokens": 2, "structured_outputs": {"choice": ["ok", "\\ud800"]}}',
            "structured_outputs",
        ),
    ],
)
def test_lone_surrogates_are_400s_naming_the_field(
    text_server: RemoteServer, path: str, raw: bytes, param: str
) -> None:
    with good_request_alongside(text_server), text_server.http() as http:
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
        error = assert_error(response, 400, param)
        assert "lone surrogate" in error["message"]


def test_a_surrogate_pair_escape_is_valid_text(text_server: RemoteServer) -> None:
    raw = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    response = text_server.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("chunks", "possible"),
    [
        ([b'{"prompt": "plain ascii and caf\xc3\xa9"}'], False),
        ([b'{"a": "\\u00e9 \\uD7FF \\ue000"}'], False),  # escapes next to the surrogate range
        ([b'{"a": "\\uDBFF"}'], True),
        ([b'{"a": "\\', b"ud", b'800"}'], True),  # an escape split across three chunks
        ([b'{"a": "\xed', b'\xbf\xbf"}'], True),
        ([b"{\x00}"], True),
    ],
)
def test_the_body_scan_finds_every_way_to_a_lone_surrogate(
    chunks: list[bytes], possible: bool
) -> None:
    scan = BodySurrogateScan()
    for chunk in chunks:
        scan.feed(chunk)
    assert scan.possible is possible


# ------------------------------------------------------------------------------------------------ control
def test_pause_and_resume_are_admin_endpoints(text_server: RemoteServer) -> None:
    with good_request_alongside(text_server):
        for path in ("/pause", "/resume", "/pause?mode=abort"):
            assert_error(text_server.post(path), 404, None)
        assert text_server.get("/is_paused").json() == {"is_paused": False}
        for method, path in (
            ("POST", "/reset_prefix_cache"),
            ("POST", "/abort_requests"),
            ("POST", "/update_weights"),
            ("GET", "/weight_version"),
            ("POST", "/collective_rpc"),
        ):
            with text_server.http() as http:
                assert_error(http.request(method, path, json={}), 404, None)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"method": "__setattr__", "args": ["model_runner", None]}, 400),
        ({"method": "__reduce_ex__", "args": [2]}, 400),
        ({"method": "execute_method", "args": ["__setattr__", ["model_runner", None]]}, 400),
        ({"method": "execute_model", "args": [{}]}, 400),
        ({"method": "model", "args": [1]}, 400),  # an attribute, not a method
        ({"method": "update_weights", "args": ["/nowhere"]}, 409),  # not paused
    ],
)
def test_collective_rpc_calls_only_public_worker_methods(
    hash_server: RemoteServer, body: dict[str, Any], status: int
) -> None:
    with good_request_alongside(hash_server):
        response = hash_server.post("/collective_rpc", json=body)
        assert_error(response, status, "method" if status == 400 else None)
    [info] = hash_server.post("/collective_rpc", json={"method": "rank_info"}).json()["results"]
    assert info["rank"] == 0


# ------------------------------------------------------------------------------------------------ 500s
def test_an_unexpected_error_is_an_openai_500_on_a_connection_that_stays_usable() -> None:
    """The server's middleware around an app whose route fails unexpectedly, served by uvicorn on loopback: the
    client gets OpenAI's error shape, and its next request on the same kept-alive connection is answered."""
    import uvicorn
    from fastapi import FastAPI

    from kvflow.entrypoints.openai.middleware import RequestIdMiddleware, UnexpectedErrorMiddleware

    app = FastAPI()

    @app.get("/fails")
    async def fails() -> None:
        raise ZeroDivisionError("the route's own bug")

    @app.get("/works")
    async def works() -> dict[str, bool]:
        return {"ok": True}

    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(RequestIdMiddleware)
    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
            failed = http.get("/fails", headers={"X-Request-Id": "r-500"})
            assert_error(failed, 500, None)
            assert failed.json()["error"]["type"] == "InternalServerError"
            assert failed.headers["X-Request-Id"] == "r-500"
            stream = failed.extensions["network_stream"]
            again = http.get("/works")
            assert again.json() == {"ok": True}
            assert again.extensions["network_stream"] is stream  # the same connection
    finally:
        server.should_exit = True
        thread.join(TIMEOUT_S)
        listener.close()


# ------------------------------------------------------------------------------------------------ slow consumers
def test_a_stream_whose_client_does_not_read_is_aborted(text_server: RemoteServer) -> None:
    """A client sends a long streamed request (16 samples of 900 tokens with 20 logprobs each, ~9 MB of events)
    and never reads. Once the kernel's socket buffers and the stream's 64 KiB are full, the request is aborted:
    its KV blocks and slots are freed long before max_tokens, and other requests are served meanwhile."""
    host, port = text_server.url.removeprefix("http://").split(":")
    tokens_before = text_server.metric("kvflow:generation_tokens_total")
    body = json.dumps(
        {"prompt": TEXT_PROMPT, "max_tokens": 900, "n": 16, "logprobs": 20, "stream": True}
    ).encode()
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((host, int(port)))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: "has not read" in text_server.log, "the unread stream was aborted")
        text_server.wait_for_metric("kvflow:num_requests_running", 0)
        text_server.wait_for_metric("kvflow:kv_cache_usage_perc", 0)
        generated = text_server.metric("kvflow:generation_tokens_total") - tokens_before
        with good_request_alongside(text_server):
            pass
    assert generated < 16 * 900 * 0.8, f"the unread request ran on: {generated} tokens"


# ------------------------------------------------------------------------------------------------ keep-alive
def test_a_connection_idle_past_the_clients_expiry_is_still_open(hash_server: RemoteServer) -> None:
    """httpx and the openai client reuse a connection idle for up to 5 s. uvicorn closed idle connections after
    exactly 5 s, so a reuse at that moment met a connection closing under it. The server's idle timeout is now
    far longer: a connection idle for 6 s is still open and serves the next request."""
    limits = httpx.Limits(keepalive_expiry=60.0)  # the client keeps it: does the server?
    with httpx.Client(base_url=hash_server.url, timeout=TIMEOUT_S, limits=limits) as http:
        first = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        stream = first.extensions["network_stream"]
        time.sleep(6.0)  # the idle time is what this test is about
        assert stream.get_extra_info("is_readable") is False  # no EOF: the server has not closed it
        second = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert second.status_code == 200
        assert second.extensions["network_stream"] is stream


@pytest.mark.slow
def test_ten_thousand_streamed_requests_over_a_keep_alive_pool_see_no_error(
    hash_server: RemoteServer,
) -> None:
    """The load of benchmarks/serve_keepalive.py (two-token streams through one httpx pool), 10,000 requests at
    concurrency 256; uvicorn's 5 s keep-alive failed about one request in 3,000 under it."""
    load = KEEPALIVE_BENCHMARK.load(hash_server.url, 10_000, 256)
    errors, _ = asyncio.run(asyncio.wait_for(load, 900))
    assert errors == []
    hash_server.wait_for_metric("kvflow:num_requests_running", 0)


# ------------------------------------------------------------------------------------------------ random JSON
FIELDS = {  # every field of both endpoints' request models
    "/v1/completions": sorted(CompletionRequest.model_fields),
    "/v1/chat/completions": sorted(ChatCompletionRequest.model_fields),
}
BASE_BODIES = {
    "/v1/completions": {"prompt": TEXT_PROMPT, "max_tokens": 3},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 3},
}


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value chosen to hurt: huge and negative numbers, NaN and infinities, long and invalid text, deep
    and wide containers, and plausible values that are just out of range."""
    kind = rng.randrange(14 if depth < 3 else 10)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 10**300])
    if kind == 1:
        return rng.choice([0.0, -0.0, 1e-320, 1e39, -1e308, 0.5, 2.5, 1e30])
    if kind == 2:
        return rng.choice([float("nan"), float("inf"), float("-inf")])
    if kind == 3:
        return rng.choice(["", "x", "\ud800", "a" * 5000, "\x00", "<|endoftext|>", "{{ 7 * 7 }}"])
    if kind == 4:
        return rng.choice([True, False, None])
    if kind == 5:
        return [rng.randrange(-5, 5000) for _ in range(rng.randrange(0, 40))]
    if kind == 6:
        return [[rng.randrange(5000)] * rng.randrange(1, 4)] * rng.randrange(1, 4)
    if kind == 7:
        return rng.randrange(-3, 300)
    if kind == 8:
        return rng.random() * rng.choice([1, 3, 100])
    if kind == 9:
        return [rng.choice(["a", "stop", "\n", ""]) for _ in range(rng.randrange(0, 80))]
    if kind == 10:
        return {
            str(rng.randrange(10**6)): random_json(rng, depth + 1) for _ in range(rng.randrange(4))
        }
    if kind == 11:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 12:
        return {"role": random_json(rng, depth + 1), "content": random_json(rng, depth + 1)}
    nested: Any = 1
    for _ in range(rng.choice([10, 1000, 100_000])):
        nested = [nested]
    return nested


@pytest.mark.slow  # a fuzz run (~18 s); the named-field 400 tests above cover each field
def test_random_json_at_every_field_is_never_a_5xx(text_server: RemoteServer) -> None:
    rng = random.Random(19)
    statuses: dict[int, int] = {}
    engine_pid = text_server.engine_pid()
    deadline = time.monotonic() + 25.0
    num_sent = 0
    with text_server.http() as http:
        while num_sent < 600 and time.monotonic() < deadline:
            path = rng.choice(list(FIELDS))
            body: dict[str, Any] = dict(BASE_BODIES[path])
            for field_name in rng.sample(FIELDS[path], rng.randrange(1, 4)):
                body[field_name] = random_json(rng)
            try:
                raw = json.dumps(body).encode("utf-8", "surrogatepass")
            except RecursionError:
                continue
            response = http.post(path, content=raw, headers={"content-type": "application/json"})
            if response.status_code == 200 and body.get("stream") is True:
                assert '"code": 5' not in response.text, (body, response.text[-500:])
            assert response.status_code < 500, (str(body)[:400], response.text[:400])
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            num_sent += 1
    assert num_sent >= 50
    assert statuses.get(400, 0) > 0 and statuses.get(200, 0) > 0, statuses
    assert text_server.get("/health").status_code == 200
    assert text_server.engine_pid() == engine_pid
    assert text_tokens(text_server) == expected_text(text_server)


# ------------------------------------------------------------------------------------------------ process level
def test_two_servers_started_on_one_port_at_once_leave_exactly_one_serving(
    tmp_path: Path,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [*kvflow_command(), "serve", *HASH_SERVER, "--port", str(port)]
    logs = [tmp_path / f"server-{index}.log" for index in range(2)]
    processes: list[subprocess.Popen[bytes]] = []
    winner = None
    for log in logs:
        with log.open("wb") as out:
            processes.append(
                subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not any(process.poll() is not None for process in processes):
            assert time.monotonic() < deadline, "neither server gave up its claim on the port"
            time.sleep(0.05)
        [loser] = [index for index, process in enumerate(processes) if process.poll() is not None]
        winner = 1 - loser
        assert processes[loser].returncode != 0
        assert "cannot listen" in logs[loser].read_text()

        def announced() -> list[str]:
            return [
                line for log in logs for line in log.read_text().splitlines() if "at http" in line
            ]

        while not announced():  # the port is taken (listening) before the model loads
            assert processes[winner].poll() is None, logs[winner].read_text()
            assert time.monotonic() < deadline, "the other server never served"
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        assert len(announced()) == 1 and str(port) in announced()[0]
        assert processes[winner].poll() is None
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(30)
    assert winner is not None and processes[winner].returncode == 0


def test_every_limit_flag_sets_its_limit() -> None:
    flags = {
        "--max-n": "2",
        "--max-prompts-per-request": "2",
        "--max-stop-strings": "1",
        "--max-stop-string-chars": "3",
        "--max-logit-bias": "1",
        "--max-request-body-bytes": "2000",
        "--timeout-keep-alive": "30",
    }
    with running_server(*HASH_SERVER, *(part for item in flags.items() for part in item)) as server:
        over = [
            ({"n": 3}, "n"),
            ({"prompt": [[1], [2], [3]]}, "prompt"),
            ({"stop": ["a", "b"]}, "stop"),
            ({"stop": ["abcd"]}, "stop"),
            ({"logit_bias": {"1": 1, "2": 1}}, "logit_bias"),
        ]
        for fields, param in over:
            body = {"prompt": [1, 2], "max_tokens": 1, **fields}
            assert_error(server.post("/v1/completions", json=body), 400, param)
        body = {"prompt": [1, 2], "max_tokens": 1, "user": "u" * 2000}
        assert_error(server.post("/v1/completions", json=body), 413, None)
        at_the_limits = {"prompt": [[1], [2]], "max_tokens": 1, "n": 2, "stop": ["abc"]}
        response = server.post("/v1/completions", json=at_the_limits)
        assert response.status_code == 200 and len(response.json()["choices"]) == 4


def test_a_killed_engine_is_logged_reaped_and_shown_in_metrics() -> None:
    with running_server(*HASH_SERVER) as server:
        engine_pid = server.engine_pid()
        os.kill(engine_pid, signal.SIGKILL)
        wait_until(lambda: server.get("/health").status_code == 503, "/health turned 503")
        wait_until(lambda: not Path(f"/proc/{engine_pid}").exists(), "the dead engine was reaped")
        errors = [line for line in server.log.splitlines() if line.startswith("ERROR")]
        assert len(errors) == 1 and "SIGKILL" in errors[0], errors
        samples = parse_metrics(server.get("/metrics").text)
        names = {name for name, _ in samples}
        assert (
            samples[("kvflow:engine_alive", frozenset({("model_name", "hash"), ("engine", "0")}))]
            == 0
        )
        assert not names & {
            "kvflow:num_requests_running",
            "kvflow:num_requests_waiting",
            "kvflow:kv_cache_usage_perc",
        }
        assert server.stop(signal.SIGTERM) == 0
