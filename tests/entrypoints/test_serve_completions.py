"""/v1/completions on the hash model, whose output for any prompt is computable (`reference_tokens`): greedy over
HTTP, streamed or whole, equals the oracle token for token; n, several prompts, usage, X-Request-Id, and every
way a request can be invalid. One server for the module."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvflow.testing.hash_model import reference_tokens
from tests.entrypoints.server import HASH_SERVER, RemoteServer, running_server, sse_payloads

MODEL = "hash"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(*HASH_SERVER, "--enable-admin-endpoints") as remote:
        yield remote


def prompt_ids(seed: int, length: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50000) for _ in range(length)]


async def stream_completion(
    http: httpx.AsyncClient, body: dict[str, Any]
) -> list[dict[str, Any] | str]:
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        return sse_payloads([line async for line in response.aiter_lines()])


# ------------------------------------------------------------------------------------------------ outputs
def test_greedy_completion_equals_the_oracle(server: RemoteServer) -> None:
    prompt = prompt_ids(1)
    completion = server.client().completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    assert completion.model == MODEL
    [choice] = completion.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.token_ids == reference_tokens(prompt, 20)
    assert choice.prompt_token_ids == prompt  # used as given: no BOS added
    assert choice.text == ""  # the hash model has no tokenizer
    assert choice.logprobs is None
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (12, 20, 32)
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_completion_equals_the_oracle_with_usage_only_at_the_end(
    server: RemoteServer,
) -> None:
    prompt = prompt_ids(2)
    stream = server.client().completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    *token_chunks, usage_chunk = chunks
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (12, 30)
    assert all(chunk.usage is None for chunk in token_chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    tokens = [token for chunk in token_chunks for token in chunk.choices[0].token_ids]
    assert tokens == reference_tokens(prompt, 30)
    assert [chunk.choices[0].finish_reason for chunk in token_chunks] == [None] * (
        len(token_chunks) - 1
    ) + ["length"]
    assert token_chunks[0].choices[0].prompt_token_ids == prompt
    assert all(
        getattr(chunk.choices[0], "prompt_token_ids", None) is None for chunk in token_chunks[1:]
    )


def test_continuous_usage_stats_count_up_on_every_chunk(server: RemoteServer) -> None:
    async def run() -> list[dict[str, Any] | str]:
        async with server.async_http() as http:
            return await stream_completion(
                http,
                {
                    "prompt": prompt_ids(3),
                    "max_tokens": 10,
                    "temperature": 0,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                },
            )

    *chunks, done = asyncio.run(run())
    assert done == "[DONE]"
    assert all(chunk["usage"]["prompt_tokens"] == 12 for chunk in chunks)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 10
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 22


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_with_n_samples_are_indexed_prompt_major(
    server: RemoteServer, stream: bool
) -> None:
    prompts = [prompt_ids(4, 5), prompt_ids(5, 9), prompt_ids(6, 3)]
    body = {"prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    tokens: dict[int, list[int]] = {}
    if stream:
        body["stream_options"] = {"include_usage": True}

        async def run() -> list[dict[str, Any] | str]:
            async with server.async_http() as http:
                return await stream_completion(http, body)

        *chunks, usage_chunk, _ = asyncio.run(run())
        for chunk in chunks:
            [choice] = chunk["choices"]
            tokens.setdefault(choice["index"], []).extend(choice["token_ids"])
        usage = usage_chunk["usage"]
    else:
        response = server.post("/v1/completions", json=body).json()
        for choice in response["choices"]:
            tokens[choice["index"]] = choice["token_ids"]
            assert choice["prompt_token_ids"] == prompts[choice["index"] // 2]
        assert [choice["index"] for choice in response["choices"]] == list(range(6))
        usage = response["usage"]
    assert tokens == {index: reference_tokens(prompts[index // 2], 8) for index in range(6)}
    assert usage["prompt_tokens"] == 5 + 9 + 3  # each prompt once, not once per sample
    assert usage["completion_tokens"] == 6 * 8


def test_repeated_prompt_reports_its_prefix_cache_hit(server: RemoteServer) -> None:
    prompt = prompt_ids(7, 40)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = server.post("/v1/completions", json=body).json()
    second = server.post("/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # full 16-token blocks
    assert first["choices"][0]["finish_reason"] == second["choices"][0]["finish_reason"] == "length"


def test_ignore_eos_min_tokens_and_stop_token_ids_reach_the_engine(server: RemoteServer) -> None:
    prompt = prompt_ids(8)
    expected = reference_tokens(prompt, 12)
    stop_at = expected[5]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    stopped = server.post("/v1/completions", json={**body, "stop_token_ids": [stop_at]}).json()[
        "choices"
    ][0]
    assert stopped["token_ids"] == expected[: expected.index(stop_at) + 1]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop_at)
    assert expected[1] not in expected[2:]
    held = server.post(
        "/v1/completions", json={**body, "stop_token_ids": [expected[1]], "min_tokens": 4}
    ).json()["choices"][0]
    # Below min_tokens a stop token does not end the request.
    assert (held["token_ids"], held["finish_reason"]) == (expected, "length")


# ------------------------------------------------------------------------------------------------ request ids
def test_x_request_id_names_the_request_and_is_echoed(server: RemoteServer) -> None:
    response = server.post(
        "/v1/completions",
        json={"prompt": prompt_ids(9), "max_tokens": 2},
        headers={"X-Request-Id": "trace-42"},
    )
    assert response.status_code == 200
    assert response.headers["X-Request-Id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"


def test_a_live_request_id_cannot_be_reused(server: RemoteServer) -> None:
    async def run() -> None:
        async with server.async_http() as http:
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
            try:
                body = {"prompt": prompt_ids(10), "max_tokens": 3, "temperature": 0}
                first = asyncio.ensure_future(
                    http.post("/v1/completions", json=body, headers={"X-Request-Id": "same"})
                )
                while server.metric("kvflow:num_requests_waiting") < 1:  # queued behind the pause
                    await asyncio.sleep(0.02)
                duplicate = await http.post(
                    "/v1/completions", json=body, headers={"X-Request-Id": "same"}
                )
                assert duplicate.status_code == 400
                assert "already in use" in duplicate.json()["error"]["message"]
            finally:
                await http.post("/resume")
            assert (await first).json()["choices"][0]["finish_reason"] == "length"
            again = await http.post("/v1/completions", json=body, headers={"X-Request-Id": "same"})
            assert again.status_code == 200  # free once the first one finished

    asyncio.run(asyncio.wait_for(run(), 60))


# ------------------------------------------------------------------------------------------------ errors
INVALID = [
    ({"max_tokens": 1020}, 400, "max_tokens"),  # 12 + 1020 > max_model_len 1024
    ({"prompt": list(range(1, 1100))}, 400, "prompt"),  # the prompt alone is too long
    ({"prompt": [1, 2, 50256]}, 400, "prompt"),  # not in the vocabulary
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt"),
    ({"prompt": "text needs a tokenizer"}, 400, "prompt"),
    ({"prompt": [1.5, 2]}, 400, "prompt"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"top_k": -5}, 400, "top_k"),
    ({"min_p": 2}, 400, "min_p"),
    ({"n": 0}, 400, "n"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"min_tokens": 50, "max_tokens": 5}, 400, "min_tokens"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"presence_penalty": 3}, 400, "presence_penalty"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"stop_token_ids": [60000]}, 400, "stop_token_ids"),
    ({"seed": "x"}, 400, "seed"),
    ({"priority": 1}, 400, "priority"),  # needs --scheduling-policy priority
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),  # without stream
    ({"suffix": "!"}, 400, "suffix"),
    ({"logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ({"model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize(
    ("fields", "status", "param"), INVALID, ids=[str(case[0])[:40] for case in INVALID]
)
def test_invalid_request_names_its_field(
    server: RemoteServer, fields: dict[str, Any], status: int, param: str
) -> None:
    response = server.post(
        "/v1/completions", json={"prompt": prompt_ids(11), "max_tokens": 4, **fields}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert error["message"]


def test_openai_client_raises_its_own_exception_classes(server: RemoteServer) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=4, top_p=7)
    assert bad.value.param == "top_p"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt=[1, 2], max_tokens=4)
    assert missing.value.param == "model"


def test_malformed_json_and_unknown_routes_are_openai_errors(server: RemoteServer) -> None:
    malformed = server.post(
        "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert malformed.status_code == 400
    assert malformed.json()["error"]["type"] == "BadRequestError"
    missing = server.get("/v1/engines")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == 404


def test_unknown_fields_are_ignored(server: RemoteServer) -> None:
    prompt = prompt_ids(12)
    response = server.post(
        "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 3,
            "temperature": 0,
            "user": "u",
            "metadata": {"a": 1},
            "return_token_ids": True,
        },
    )
    assert response.status_code == 200
    assert response.json()["choices"][0]["token_ids"] == reference_tokens(prompt, 3)


def test_a_flood_of_bad_requests_leaves_good_ones_untouched(server: RemoteServer) -> None:
    """Good streams run beside hundreds of invalid requests and clients that give up early."""
    good_prompts = [prompt_ids(100 + i, 10 + i) for i in range(8)]

    async def good(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        chunks = await stream_completion(
            http, {"prompt": prompt, "max_tokens": 80, "temperature": 0, "return_token_ids": True}
        )
        assert chunks[-1] == "[DONE]"
        return [token for chunk in chunks[:-1] for token in chunk["choices"][0]["token_ids"]]

    async def bad(http: httpx.AsyncClient, index: int) -> int:
        fields, _, _ = INVALID[index % len(INVALID)]
        response = await http.post(
            "/v1/completions", json={"prompt": prompt_ids(11), "max_tokens": 4, **fields}
        )
        return response.status_code

    async def impatient(http: httpx.AsyncClient, prompt: list[int]) -> None:
        async with http.stream(
            "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 500, "stream": True}
        ) as response:
            async for _ in response.aiter_lines():
                break  # hang up after the first line

    async def run() -> tuple[list[list[int]], list[int]]:
        async with server.async_http(limits=httpx.Limits(max_connections=200)) as http:
            goods = [asyncio.ensure_future(good(http, prompt)) for prompt in good_prompts]
            noise = [bad(http, i) for i in range(200)] + [
                impatient(http, prompt_ids(200 + i)) for i in range(10)
            ]
            results = await asyncio.gather(*noise)
            return await asyncio.gather(*goods), [
                status for status in results if status is not None
            ]

    outputs, statuses = asyncio.run(asyncio.wait_for(run(), 120))
    assert outputs == [reference_tokens(prompt, 80) for prompt in good_prompts]
    assert set(statuses) <= {400, 404}
    server.wait_for_metric("kvflow:num_requests_running", 0)
    server.wait_for_metric("kvflow:kv_cache_usage_perc", 0)
