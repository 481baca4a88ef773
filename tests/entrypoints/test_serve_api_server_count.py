"""`kvflow serve --api-server-count 2` on the hash model: two API server processes on one port in front of one
shared engine core (and, in the last test, two data-parallel cores).

Every response names the API process that answered (`X-Kvflow-Api-Server`); a test that needs a request on a given
process opens fresh connections until the kernel hands one to it. Streams from the official `openai` client equal
the in-process `LLM`'s greedy output, `/metrics` sums over both processes whichever is asked, a disconnect aborts
its request on either process, a pause from one holds the other's requests, an abort of all ends both processes'
streams, a dead engine turns both processes' `/health` to 503, and SIGTERM (or an API process that dies) leaves no
process behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from kvflow import LLM, SamplingParams
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.waiting import wait_until
from tests.entrypoints.server import (
    RemoteServer,
    child_pids,
    kvflow_command,
    parse_metrics,
    running_server,
)
from tests.entrypoints.test_serve_rl import prompt_ids

TIMEOUT_S = 120.0
MAX_TOKENS = 16
ENDLESS = 4000  # a stream with seconds of work left (max_model_len 4096)
HEADER = "x-kvflow-api-server"
STREAM_BURST = 4  # streams opened at once by streams_on_both
BOTH_PROCESSES_TIMEOUT_S = 60.0
SERVER_ARGS = (
    "hash",
    "--api-server-count",
    "2",
    "--max-model-len",
    "4096",
    "--num-kv-blocks",
    "1024",
    "--max-num-seqs",
    "64",
    "--enable-admin-endpoints",
)


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(*SERVER_ARGS) as remote:
        yield remote


def run(coroutine: object) -> object:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))  # type: ignore[arg-type]


def processes_by_name(launcher_pid: int) -> dict[str, int]:
    """The launcher's children by their OS name (`/proc/<pid>/comm`): kvflow-api-<i>, kvflow-engine-<rank>."""
    found = {}
    for pid in child_pids(launcher_pid):
        with contextlib.suppress(OSError):
            found[Path(f"/proc/{pid}/comm").read_text().strip()] = pid
    return found


def ask_each(
    server: RemoteServer, method: str, path: str, **kwargs: object
) -> dict[str, httpx.Response]:
    """The answer of each API process to one request, sent on fresh connections until both answered."""
    answers: dict[str, httpx.Response] = {}

    def both_answered() -> bool:
        response = httpx.request(method, server.url + path, timeout=60, **kwargs)  # type: ignore[arg-type]
        answers.setdefault(response.headers[HEADER], response)
        return len(answers) == 2

    wait_until(both_answered, f"both API processes answered {path}", timeout_s=60)
    return answers


def success_total(metrics_text: str) -> float:
    return sum(
        value
        for (name, _), value in parse_metrics(metrics_text).items()
        if name == "kvflow:request_success_total"
    )


def metric_sum(server: RemoteServer, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in server.metrics().items()
        if sample == name and set(labels.items()) <= sample_labels
    )


@contextlib.asynccontextmanager
async def streams_on_both(
    server: RemoteServer, max_tokens: int = ENDLESS
) -> AsyncIterator[list[tuple[str, httpx.Response]]]:
    """Open streaming completions, each on its own connection, in bursts of `STREAM_BURST` at once, until both API
    processes hold one (a deadline of `BOTH_PROCESSES_TIMEOUT_S` names the failure); yields (API process, response)
    for every stream opened (its headers read); closes them all at the end.
    The processes share one listening socket, so which one accepts a connection is the kernel's and the
    scheduler's choice: one at a time, on a busy machine, the process back from the previous request could take
    64 in a row (a `make test-latest` run did). Connections that arrive together reach the other process while
    the first one is busy with its request, and the deadline, not a count, bounds the tries."""
    clients: list[httpx.AsyncClient] = []
    opened: list[tuple[str, httpx.Response]] = []

    async def open_stream(index: int) -> None:
        client = httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S)
        clients.append(client)
        body = {
            "model": "hash",
            "prompt": prompt_ids(900 + index),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        request = client.build_request("POST", "/v1/completions", json=body)
        response = await client.send(request, stream=True)
        opened.append((response.headers.get(HEADER, "?"), response))
        assert response.status_code == 200, response.status_code

    try:
        deadline = asyncio.get_running_loop().time() + BOTH_PROCESSES_TIMEOUT_S
        index = 0
        while {process for process, _ in opened} != {"0", "1"}:
            assert asyncio.get_running_loop().time() < deadline, (
                f"timed out waiting until both API processes held a stream ({len(opened)} opened, all on "
                f"{sorted({process for process, _ in opened})}): one process took every connection"
            )
            await asyncio.gather(*(open_stream(index + i) for i in range(STREAM_BURST)))
            index += STREAM_BURST
        yield opened
    finally:
        for _, response in opened:
            await response.aclose()
        for client in clients:
            await client.aclose()


async def finish_reason(response: httpx.Response) -> str | None:
    reason = None
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            choice = json.loads(line[len("data: ") :])["choices"][0]
            reason = choice.get("finish_reason") or reason
    return reason


def test_processes_are_named_and_64_streams_equal_the_in_process_llm(server: RemoteServer) -> None:
    names = processes_by_name(server.process.pid)
    assert {"kvflow-api-0", "kvflow-api-1", "kvflow-engine-0"} <= set(names), names
    prompts = [prompt_ids(100 + i, 3 + i % 11) for i in range(64)]
    before = {api: success_total(r.text) for api, r in ask_each(server, "GET", "/metrics").items()}

    async def stream(client: object, prompt: list[int]) -> tuple[str, list[int]]:
        raw = await client.completions.with_raw_response.create(  # type: ignore[attr-defined]
            model="hash",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        tokens: list[int] = []
        async for chunk in raw.parse():
            tokens += chunk.choices[0].model_extra["token_ids"]
        return raw.headers[HEADER], tokens

    async def scenario() -> list[tuple[str, list[int]]]:
        async with server.async_client() as client:
            return await asyncio.gather(*(stream(client, prompt) for prompt in prompts))

    results = run(scenario())
    llm = LLM("hash", max_model_len=4096, num_kv_blocks=1024, max_num_seqs=64)
    try:
        expected = llm.generate(
            [{"prompt_token_ids": prompt} for prompt in prompts],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert [tokens for _, tokens in results] == [list(out.outputs[0].token_ids) for out in expected]
    # Every finished request counted once, by the process that served it, and /metrics sums both.
    for api, response in ask_each(server, "GET", "/metrics").items():
        assert success_total(response.text) - before[api] == 64, api


def test_a_disconnect_aborts_its_request_on_either_api_process(server: RemoteServer) -> None:
    """Streams held by both processes, with the engine paused (keep) so that none can run a step, let alone finish:
    the clients go away, and each process's abort empties the engine while it is still paused; after the resume
    nothing runs or waits and no request finished by length (an abort by disconnect is not a finished output).
    The pause makes the check exact on a busy machine: with the streams running, a lagging API process could see a
    ~2 s hash-model stream reach its length before the disconnect's abort landed (a fresh-clone run did)."""
    paused = httpx.post(server.url + "/pause", params={"mode": "keep"}, timeout=60)
    assert paused.status_code == 200
    finished_before = metric_sum(server, "kvflow:request_success_total", finished_reason="length")

    async def scenario() -> None:
        async with streams_on_both(server) as opened:
            await asyncio.to_thread(
                wait_until,
                lambda: metric_sum(server, "kvflow:num_requests_waiting") == len(opened),
                "every stream waits in the paused engine",
                60,
            )

    try:
        run(scenario())
        wait_until(
            lambda: metric_sum(server, "kvflow:num_requests_waiting") == 0,
            "every disconnected stream was aborted in the paused engine",
            timeout_s=60,
        )
    finally:
        assert httpx.post(server.url + "/resume", timeout=60).status_code == 200
    assert metric_sum(server, "kvflow:num_requests_running") == 0
    assert (
        metric_sum(server, "kvflow:request_success_total", finished_reason="length")
        == finished_before
    )


def test_a_pause_from_one_process_holds_the_others_requests(server: RemoteServer) -> None:
    response = httpx.post(server.url + "/pause", params={"mode": "abort"}, timeout=60)
    assert response.status_code == 200
    for api, answer in ask_each(server, "GET", "/is_paused").items():
        assert answer.json() == {"is_paused": True}, api

    async def scenario() -> list[str | None]:
        async with streams_on_both(server, max_tokens=MAX_TOKENS) as opened:
            wait_held = asyncio.to_thread(
                wait_until,
                lambda: metric_sum(server, "kvflow:num_requests_waiting") == len(opened),
                "the requests wait",
                60,
            )
            await wait_held
            assert metric_sum(server, "kvflow:num_requests_running") == 0
            resumed = httpx.post(server.url + "/resume", timeout=60)
            assert resumed.status_code == 200
            return await asyncio.gather(*(finish_reason(response) for _, response in opened))

    assert set(run(scenario())) == {"length"}  # type: ignore[arg-type]


def test_abort_all_ends_both_processes_streams(server: RemoteServer) -> None:
    """Streams held by both processes wait in the engine, paused (keep) so that none can finish by itself; one
    abort of all, sent to one process, ends every stream of both with finish_reason "abort".
    Without the pause the check raced the hash model: on a busy machine, opening fresh connections until both
    processes held one outlasted the first streams' 4,000 tokens, which ended by "length" before the abort."""
    paused = httpx.post(server.url + "/pause", params={"mode": "keep"}, timeout=60)
    assert paused.status_code == 200

    async def scenario() -> tuple[list[str | None], int, list[str]]:
        async with streams_on_both(server) as opened:
            await asyncio.to_thread(
                wait_until,
                lambda: metric_sum(server, "kvflow:num_requests_waiting") == len(opened),
                "every stream waits in the paused engine",
                60,
            )
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                answer = await client.post("/abort_requests", json={})
            assert answer.status_code == 200
            reasons = await asyncio.gather(*(finish_reason(response) for _, response in opened))
            return reasons, len(opened), answer.json()["aborted"]

    try:
        reasons, num_opened, aborted = run(scenario())  # type: ignore[misc]
    finally:
        assert httpx.post(server.url + "/resume", timeout=60).status_code == 200
    assert reasons == ["abort"] * num_opened
    assert len(aborted) == num_opened
    assert metric_sum(server, "kvflow:num_requests_waiting") == 0
    assert metric_sum(server, "kvflow:num_requests_running") == 0


def test_engine_death_is_503_everywhere_and_sigterm_leaves_nothing(server: RemoteServer) -> None:
    """Runs last: it ends the module's server."""
    names = processes_by_name(server.process.pid)
    os.kill(names["kvflow-engine-0"], signal.SIGKILL)

    def both_unhealthy() -> bool:
        return all(r.status_code == 503 for r in ask_each(server, "GET", "/health").values())

    wait_until(both_unhealthy, "both API processes report the dead engine", timeout_s=60)
    assert server.stop(signal.SIGTERM) == 0
    assert server.leftover_processes() == []
    for pid in names.values():
        assert (
            not Path(f"/proc/{pid}").exists()
            or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        )


def test_data_parallel_cores_behind_two_api_processes_and_an_api_process_death() -> None:
    with running_server(
        "hash",
        "--api-server-count",
        "2",
        "--data-parallel-size",
        "2",
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        "256",
        "--max-num-seqs",
        "16",
    ) as server:
        names = processes_by_name(server.process.pid)
        assert {"kvflow-api-0", "kvflow-api-1", "kvflow-engine-0", "kvflow-engine-1"} <= set(names)
        prompts = [prompt_ids(300 + i, 5 + i % 7) for i in range(16)]

        async def complete(client: object, prompt: list[int]) -> list[int]:
            response = await client.completions.create(  # type: ignore[attr-defined]
                model="hash",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            return response.choices[0].model_extra["token_ids"]

        async def scenario() -> list[list[int]]:
            async with server.async_client() as client:
                return await asyncio.gather(*(complete(client, prompt) for prompt in prompts))

        assert run(scenario()) == [reference_tokens(prompt, MAX_TOKENS) for prompt in prompts]
        engines = {
            dict(labels)["engine"]
            for (name, labels), value in server.metrics().items()
            if name == "kvflow:generation_tokens_total" and value > 0
        }
        assert engines == {"0", "1"}
        # An API process that dies takes the server down, and nothing is left behind.
        os.kill(names["kvflow-api-1"], signal.SIGKILL)
        assert server.process.wait(TIMEOUT_S) != 0
        assert server.leftover_processes() == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--api-server-count", "0"], "--api-server-count: must be >= 1"),
        (["--api-server-count", "2", "--no-engine-process"], "--no-engine-process"),
    ],
)
def test_impossible_api_server_counts_are_errors_naming_the_flag(
    flags: list[str], message: str
) -> None:
    result = subprocess.run(
        [*kvflow_command(), "serve", "hash", *flags, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 2
    assert message in result.stderr and "--api-server-count" in result.stderr
