"""RL control and admin endpoints, disconnects and metrics, on the hash model (exact oracle) with admin endpoints on.

Pauses make the tests deterministic: while the engine is paused nothing runs, so a request can only leave the
scheduler by being aborted, and a stream in flight can be held mid-generation for as long as a test needs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvflow.engine.stats import FinishedRequestStats
from kvflow.testing.hash_model import reference_tokens
from tests.entrypoints.server import RemoteServer, running_server, sse_payloads

# max_tokens of a request that is still running when a test acts on it: ~2 s of hash-model work at idle speed
# (`long_server`: max_model_len 4096, the hash model's limit). Tests hold such requests with `hold_mid_generation`
# and act on the server's state, never on what a reader has seen: on a busy machine a reader can lag seconds behind
# the engine.
LONG = 4000
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(
        "hash",
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        "256",
        "--max-num-seqs",
        "32",
        "--enable-admin-endpoints",
    ) as remote:
        yield remote


@pytest.fixture(scope="module")
def long_server() -> Iterator[RemoteServer]:
    """Room for requests of `LONG` tokens (the pause and admin tests hold them mid-generation)."""
    with running_server(
        "hash",
        "--max-model-len",
        "4096",
        "--num-kv-blocks",
        "1024",
        "--max-num-seqs",
        "32",
        "--enable-admin-endpoints",
    ) as remote:
        yield remote


@pytest.fixture(autouse=True)
def unpaused(server: RemoteServer, long_server: RemoteServer) -> Iterator[None]:
    """Every test starts and ends with running engines, also when it fails mid-pause."""
    yield
    server.post("/resume")
    long_server.post("/resume")


def prompt_ids(seed: int, length: int = 16) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50000) for _ in range(length)]


@dataclass
class Stream:
    """A streamed completion read in the background: tokens as they arrive, and how it ended."""

    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    async def read(self, http: httpx.AsyncClient, headers: dict[str, str]) -> None:
        body = {
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                [payload] = sse_payloads([line]) or [None]
                if payload == "[DONE]":
                    self.done = True
                elif payload is not None:
                    assert isinstance(payload, dict) and "error" not in payload, payload
                    [choice] = payload["choices"]
                    self.tokens += choice["token_ids"]
                    self.finish_reason = choice["finish_reason"] or self.finish_reason
                    if self.tokens:
                        self.first_token.set()

    def start(self, http: httpx.AsyncClient, request_id: str | None = None) -> Stream:
        headers = {"X-Request-Id": request_id} if request_id else {}
        self.task = asyncio.ensure_future(self.read(http, headers))
        return self

    async def finished(self) -> Stream:
        assert self.task is not None
        await self.task
        assert self.done
        return self

    @property
    def reference(self) -> list[int]:
        return reference_tokens(self.prompt, self.max_tokens)


async def metric(http: httpx.AsyncClient, name: str) -> float:
    from tests.entrypoints.server import parse_metrics

    samples = parse_metrics((await http.get("/metrics")).text)
    return sum(value for (sample, _), value in samples.items() if sample == name)


async def wait_for_metric(http: httpx.AsyncClient, name: str, expected: float) -> None:
    """Poll the server's /metrics until `name` equals `expected` (the scenario's `TIMEOUT_S` bounds it)."""
    while await metric(http, name) != expected:
        await asyncio.sleep(0.02)


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


async def hold_mid_generation(
    http: httpx.AsyncClient,
    start: Callable[[int], list[asyncio.Future[Any]]],
    attempts: int = 4,
) -> list[asyncio.Future[Any]]:
    """Start requests and return once they are held mid-generation by a keep pause (the engine is left paused).

    `start(attempt)` sends the requests (new prompts per attempt) and returns their tasks. A first keep pause is the
    starting gate: the requests wait in the paused engine (`/metrics` shows them all waiting: nothing can finish
    yet, so that wait is exact); `/resume` admits them all in one step and the second keep pause follows one HTTP
    round trip later, while each has ~4,000 steps of work left. Waiting for `/metrics` to show requests sent to a
    running engine as running, instead, races them: on a busy machine a request can run to its end between two polls
    (a streamed hash-model token costs the API process far more than the engine, so polls slow down).

    On a busy machine the second pause can still reach the engine before its first step after `/resume` (the
    requests still wait) or, in theory, after the requests finished. That attempt is then missed: the engine resumes,
    the requests run to their end, and the scenario starts again (at most `attempts` times; the failure names each
    attempt's running count). `/metrics` reads the load gauges from the engine itself, so the counts are exact."""
    missed: list[float] = []
    for attempt in range(attempts):
        assert (
            await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        ).json() == {"status": "paused"}
        tasks = start(attempt)
        await wait_for_metric(http, "kvflow:num_requests_waiting", len(tasks))
        assert not any(task.done() for task in tasks)
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        running = await metric(http, "kvflow:num_requests_running")
        if running == len(tasks):
            return tasks
        missed.append(running)
        await http.post("/resume")
        await asyncio.gather(*tasks)
    raise AssertionError(
        f"in {attempts} attempts the second keep pause never found all requests running: running {missed}"
    )


# ------------------------------------------------------------------------------------------------ pause
@pytest.mark.parametrize("clear_cache", ["false", "true"])
def test_keep_pause_freezes_streams_and_resume_loses_nothing(
    long_server: RemoteServer, clear_cache: str
) -> None:
    """Streams in flight go quiet during a keep pause and continue after resume with exactly the unpaused tokens
    (vLLM #42043 dropped the first token after resume); with clear_cache they are recomputed, same tokens."""

    async def scenario() -> None:
        async with long_server.async_http() as http:
            streams: list[Stream] = []

            def start(attempt: int) -> list[asyncio.Future[Any]]:
                streams[:] = [
                    Stream(prompt_ids(100 * attempt + i), LONG).start(http) for i in range(3)
                ]
                return [stream.task for stream in streams if stream.task is not None]

            await hold_mid_generation(http, start)
            response = await http.post(
                "/pause", params={"mode": "keep", "clear_cache": clear_cache}
            )
            assert (response.status_code, response.json()) == (200, {"status": "paused"})
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            generated = await metric(http, "kvflow:generation_tokens_total")
            late = Stream(prompt_ids(99), 20).start(
                http
            )  # arrives during the pause: queued, visible
            await wait_for_metric(
                http, "kvflow:num_requests_waiting", 1 + (3 if clear_cache == "true" else 0)
            )
            await asyncio.sleep(0.3)
            assert await metric(http, "kvflow:generation_tokens_total") == generated  # frozen
            assert not any(stream.done for stream in [*streams, late])
            assert (await http.post("/resume")).json() == {"status": "resumed"}
            assert (await http.get("/is_paused")).json() == {"is_paused": False}
            for stream in [*streams, late]:
                await stream.finished()
                assert stream.tokens == stream.reference
                assert stream.finish_reason == "length"

    run(scenario())


def test_abort_pause_ends_streams_and_holds_new_requests_until_resume(
    long_server: RemoteServer,
) -> None:
    async def scenario() -> None:
        async with long_server.async_http() as http:
            streams: list[Stream] = []

            def start(attempt: int) -> list[asyncio.Future[Any]]:
                streams[:] = [
                    Stream(prompt_ids(100 * attempt + 10 + i), LONG).start(http) for i in range(3)
                ]
                return [stream.task for stream in streams if stream.task is not None]

            await hold_mid_generation(http, start)
            # Mode "abort" by default; it also ends requests a keep pause holds.
            assert (await http.post("/pause")).status_code == 200
            for stream in streams:
                await stream.finished()
                assert stream.finish_reason == "abort"
                assert 0 < len(stream.tokens) < LONG
                assert stream.tokens == stream.reference[: len(stream.tokens)]
            body = {
                "prompt": prompt_ids(13),
                "max_tokens": 10,
                "temperature": 0,
                "return_token_ids": True,
            }
            held = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await wait_for_metric(http, "kvflow:num_requests_waiting", 1)
            assert not held.done()
            await http.post("/resume")
            choice = (await held).json()["choices"][0]
            assert (choice["token_ids"], choice["finish_reason"]) == (
                reference_tokens(body["prompt"], 10),
                "length",
            )

    run(scenario())


def test_wait_pause_returns_once_running_requests_finished(server: RemoteServer) -> None:
    async def scenario() -> None:
        async with server.async_http() as http:
            streams = [Stream(prompt_ids(20 + i), 300).start(http) for i in range(3)]
            for stream in streams:
                await stream.first_token.wait()
            assert (await http.post("/pause", params={"mode": "wait"})).status_code == 200
            assert await metric(http, "kvflow:num_requests_running") == 0
            for stream in streams:
                await stream.finished()
                assert (stream.tokens, stream.finish_reason) == (stream.reference, "length")
            late = Stream(prompt_ids(23), 5).start(http)
            await wait_for_metric(http, "kvflow:num_requests_waiting", 1)
            await http.post("/resume")
            await late.finished()
            assert late.tokens == late.reference

    run(scenario())


@pytest.mark.parametrize(("clear_cache", "cached_after"), [("true", 0), ("false", 32)])
def test_clear_cache_decides_the_next_requests_cached_tokens(
    server: RemoteServer, clear_cache: str, cached_after: int
) -> None:
    body = {
        "prompt": prompt_ids(30 + int(clear_cache == "true"), 40),
        "max_tokens": 3,
        "temperature": 0,
    }
    server.post("/v1/completions", json=body)
    assert (
        server.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
        == 32
    )
    assert server.post("/pause", params={"clear_cache": clear_cache}).status_code == 200
    server.post("/resume")
    after = server.post("/v1/completions", json=body).json()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_after


def test_bad_pause_mode_is_a_400_naming_mode(server: RemoteServer) -> None:
    response = server.post("/pause", params={"mode": "sleep"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "mode"
    assert server.get("/is_paused").json() == {"is_paused": False}
    assert (
        server.post("/pause", params={"clear_cache": "maybe"}).json()["error"]["param"]
        == "clear_cache"
    )


# ------------------------------------------------------------------------------------------------ admin
def test_reset_prefix_cache_is_409_while_blocks_are_in_use(long_server: RemoteServer) -> None:
    async def scenario() -> None:
        async with long_server.async_http() as http:
            body = {"prompt": prompt_ids(40, 40), "max_tokens": 3}
            await http.post("/v1/completions", json=body)
            assert (await http.post("/reset_prefix_cache")).json() == {"status": "reset"}
            after = (await http.post("/v1/completions", json=body)).json()
            assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            streams: list[Stream] = []

            def start(attempt: int) -> list[asyncio.Future[Any]]:
                streams[:] = [Stream(prompt_ids(100 * attempt + 41), LONG).start(http)]
                return [stream.task for stream in streams if stream.task is not None]

            await hold_mid_generation(http, start)
            [stream] = streams
            refused = await http.post("/reset_prefix_cache")
            assert refused.status_code == 409
            assert refused.json()["error"]["type"] == "ConflictError"
            forced = await http.post(
                "/reset_prefix_cache", params={"reset_running_requests": "true"}
            )
            assert forced.status_code == 200
            await http.post("/resume")
            await stream.finished()
            assert stream.tokens == stream.reference  # preempted by the reset, recomputed

    run(scenario())


def test_abort_requests_by_id_and_all(server: RemoteServer) -> None:
    async def scenario() -> None:
        async with server.async_http() as http:
            await http.post("/pause", params={"mode": "keep"})
            streams = {
                name: Stream(prompt_ids(50 + i), 10).start(http, name)
                for i, name in enumerate("abc")
            }
            await wait_for_metric(http, "kvflow:num_requests_waiting", 3)
            response = await http.post(
                "/abort_requests", json={"request_ids": ["a", "cmpl-b", "unknown"]}
            )
            assert response.json() == {"aborted": ["a", "cmpl-b"]}
            for name in "ab":
                await streams[name].finished()
                assert streams[name].finish_reason == "abort"
            assert not streams["c"].done
            assert (await http.post("/abort_requests")).json() == {"aborted": ["c"]}
            await streams["c"].finished()
            assert streams["c"].finish_reason == "abort"
            await wait_for_metric(http, "kvflow:num_requests_waiting", 0)

    run(scenario())


def test_update_weights_needs_a_pause(server: RemoteServer) -> None:
    response = server.post("/update_weights", json={"path": "/nonexistent"})
    assert (response.status_code, response.json()["error"]["type"]) == (409, "ConflictError")
    server.post("/pause")
    bad = server.post("/update_weights", json={"path": "/nonexistent"})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "path")
    assert server.get("/weight_version").json() == {"weight_version": 0}
    assert server.post("/update_weights", json={}).json()["error"]["param"] == "path"


# ------------------------------------------------------------------------------------------------ disconnects
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_and_frees(
    long_server: RemoteServer, stream: bool
) -> None:
    """Held by a keep pause, the request can only leave by being aborted, and its KV blocks with it."""

    async def scenario() -> None:
        async with long_server.async_http() as http:

            def start(attempt: int) -> list[asyncio.Future[Any]]:
                prompt = prompt_ids(100 * attempt + 60)
                if stream:
                    reader = Stream(prompt, LONG).start(http)
                    assert reader.task is not None
                    return [reader.task]
                body = {"prompt": prompt, "max_tokens": LONG, "stream": stream}
                return [asyncio.ensure_future(http.post("/v1/completions", json=body))]

            [task] = await hold_mid_generation(http, start)
            assert await metric(http, "kvflow:kv_cache_usage_perc") > 0
            task.cancel()  # the client hangs up
            await wait_for_metric(http, "kvflow:num_requests_running", 0)
            await wait_for_metric(http, "kvflow:num_requests_waiting", 0)
            await wait_for_metric(http, "kvflow:kv_cache_usage_perc", 0)
            await http.post("/resume")

    run(scenario())


# ------------------------------------------------------------------------------------------------ metrics
@pytest.mark.slow
def test_48_concurrent_streams_match_the_oracle_and_leave_nothing_behind(
    server: RemoteServer,
) -> None:
    """More streams than slots and more tokens than the KV cache holds: requests wait and are preempted, every
    stream still equals the oracle, and afterwards nothing is running, waiting or holding KV blocks."""
    before = server.metrics()

    def counted(name: str, **labels: str) -> float:
        return server.metric(name, **labels) - sum(
            value
            for (sample, sample_labels), value in before.items()
            if sample == name and set(labels.items()) <= sample_labels
        )

    prompts = [prompt_ids(1000 + i, 8 + i % 24) for i in range(48)]

    async def scenario() -> list[list[int]]:
        async with server.async_http(limits=httpx.Limits(max_connections=64)) as http:
            # All 48 wait behind a pause and start together, so 32 of them run at once and outgrow the KV cache
            # (requests that trickled in on a busy machine could each finish before the next arrived).
            await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            streams = [Stream(prompt, 200).start(http) for prompt in prompts]
            await wait_for_metric(http, "kvflow:num_requests_waiting", 48)
            await http.post("/resume")
            return [(await stream.finished()).tokens for stream in streams]

    assert run(scenario()) == [reference_tokens(prompt, 200) for prompt in prompts]
    server.wait_for_metric("kvflow:num_requests_running", 0)
    server.wait_for_metric("kvflow:num_requests_waiting", 0)
    server.wait_for_metric("kvflow:kv_cache_usage_perc", 0)
    assert counted("kvflow:request_success_total", finished_reason="length") == 48
    assert counted("kvflow:generation_tokens_total") == 48 * 200
    assert counted("kvflow:prompt_tokens_total") == sum(len(prompt) for prompt in prompts)
    assert counted("kvflow:num_preemptions_total") > 0  # 48 x 14 blocks > 256
    assert counted("kvflow:prefix_cache_queries_total") >= sum(len(prompt) for prompt in prompts)
    for histogram in (
        "kvflow:time_to_first_token_seconds_count",
        "kvflow:e2e_request_latency_seconds_count",
        "kvflow:request_prompt_tokens_count",
        "kvflow:request_generation_tokens_count",
    ):
        assert counted(histogram) == 48, histogram
    assert counted("kvflow:inter_token_latency_seconds_count") == 48 * 199
    assert counted("kvflow:request_generation_tokens_sum") == 48 * 200
    if "queue_time" in {field.name for field in dataclasses.fields(FinishedRequestStats)}:
        for histogram in (  # the front end reports lifecycle times
            "kvflow:request_queue_time_seconds_count",
            "kvflow:request_prefill_time_seconds_count",
            "kvflow:request_decode_time_seconds_count",
            "kvflow:request_inference_time_seconds_count",
            "kvflow:request_time_per_output_token_seconds_count",
        ):
            assert counted(histogram) == 48, histogram


def test_metrics_carry_the_design_names_and_the_model_label(server: RemoteServer) -> None:
    text = server.get("/metrics").text
    for name in (
        "kvflow:num_requests_running",
        "kvflow:num_requests_waiting",
        "kvflow:kv_cache_usage_perc",
        "kvflow:prompt_tokens_total",
        "kvflow:generation_tokens_total",
        "kvflow:request_success_total",
        "kvflow:num_preemptions_total",
        "kvflow:prefix_cache_queries_total",
        "kvflow:prefix_cache_hits_total",
        "kvflow:time_to_first_token_seconds",
        "kvflow:inter_token_latency_seconds",
        "kvflow:e2e_request_latency_seconds",
        "kvflow:request_queue_time_seconds",
        "kvflow:request_prefill_time_seconds",
        "kvflow:request_decode_time_seconds",
        "kvflow:request_prompt_tokens",
        "kvflow:request_generation_tokens",
    ):
        assert f"\n{name}" in text or f" {name} " in text, name
    samples = server.metrics()
    assert samples
    assert all(("model_name", "hash") in labels for (name, labels) in samples)
    assert {
        dict(labels)["finished_reason"]
        for (name, labels) in samples
        if name == "kvflow:request_success_total"
    } >= {"stop", "length", "abort"}
    assert "_created" not in text
