"""`kvflow serve` with LoRA adapters (issue 42 item 4), through the official openai client and plain HTTP.

A tiny random Llama with real PEFT adapters (`tests.lora.adapters`): `a1` on q/v, `a2` on gate/down. The oracle
for every token is the offline engine, `LLM(base, enable_lora=True).generate(..., lora_request=...)`, greedy; its
outputs with each adapter differ from the base's (checked), so a server that ignored `model` would fail.

Covers: the flags (`--lora-modules` in both forms, `--enable-runtime-lora-updating` and vLLM's variable, their
errors), /v1/models cards with `parent`, `model: "<adapter>"` on completions, chat, streams and /tokenize, unknown
names (404), POST /v1/load_lora_adapter and /v1/unload_lora_adapter (mounted only with runtime updating, behind
--api-key, their 400 and 404 answers, `load_inplace`), unloading an adapter while its requests are queued or
running (every one finishes with all its tokens, and the adapter is freed afterwards), the
`kvflow:lora_requests_info` gauge, and `--lora-modules` with several API server processes. Scenarios that need
requests in flight hold them with keep pauses (`test_serve_rl.hold_mid_generation`) and wait for states with
deadlines naming them, never for time.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvflow.core.sched.output import SchedulerStats
from kvflow.entrypoints.cli import build_parser
from kvflow.entrypoints.openai.metrics import PrometheusStatLogger
from kvflow.entrypoints.openai.server_config import (
    LoRAModulePath,
    parse_lora_module,
    runtime_lora_updating_from_env,
)
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import BeamSearchParams, SamplingParams
from kvflow.testing.waiting import wait_until
from tests.entrypoints.server import (
    RemoteServer,
    kvflow_command,
    parse_metrics,
    running_server,
)
from tests.entrypoints.test_serve_rl import hold_mid_generation, wait_for_metric
from tests.lora.adapters import make_peft_adapter, make_tiny_llama

API_KEY = "lora-test-key"
PROMPT = "The quick brown fox"
MAX_TOKENS = 12
# Requests held mid-generation: room for ~1,000 steps of work (the tiny Llama's max_position_embeddings is 1024).
LONG_MAX_TOKENS = 1000
TIMEOUT_S = 120.0
LORA_INFO = "kvflow:lora_requests_info"


@dataclass(frozen=True)
class Adapters:
    base: Path
    a1: Path
    a2: Path
    rank_32: Path  # over the servers' --max-lora-rank 16
    lm_head: Path  # a module kvflow does not apply adapters to


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    root = tmp_path_factory.mktemp("lora-serve")
    base = make_tiny_llama(root / "base")
    return Adapters(
        base=base,
        a1=make_peft_adapter(base, root / "a1", target_modules=["q_proj", "v_proj"], seed=1),
        a2=make_peft_adapter(base, root / "a2", target_modules=["gate_proj", "down_proj"], seed=2),
        rank_32=make_peft_adapter(base, root / "rank32", target_modules=["q_proj"], r=32, seed=3),
        lm_head=make_peft_adapter(base, root / "lm_head", target_modules=["lm_head"], seed=4),
    )


def server_args(adapters: Adapters, *extra: str) -> list[str]:
    a2_module = json.dumps({"name": "a2", "path": str(adapters.a2), "base_model_name": "tiny-base"})
    return [
        str(adapters.base),
        "--served-model-name",
        "base",
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        "512",
        "--max-num-seqs",
        "8",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "4",
        "--lora-modules",
        f"a1={adapters.a1}",
        a2_module,
        *extra,
    ]


@pytest.fixture(scope="module")
def server(adapters: Adapters) -> Iterator[RemoteServer]:
    """Runtime updating on, admin endpoints (keep pauses) on, behind an API key."""
    with running_server(
        *server_args(adapters, "--enable-runtime-lora-updating", "--enable-admin-endpoints"),
        api_key=API_KEY,
    ) as remote:
        yield remote


@pytest.fixture(autouse=True)
def unpaused(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails mid-pause leaves the shared server running."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").post("/resume")


@pytest.fixture(scope="module")
def offline(adapters: Adapters) -> Iterator[Any]:
    """The offline engine on the same base, the oracle for every token."""
    from kvflow.entrypoints.llm import LLM

    llm = LLM(
        str(adapters.base),
        enable_lora=True,
        max_loras=2,
        max_model_len=1024,
        num_kv_blocks=512,
    )
    try:
        yield llm
    finally:
        llm.shutdown()


def lora(name: str, lora_id: int, path: Path) -> LoRARequest:
    return LoRARequest(name, lora_id, str(path))


def offline_tokens(
    llm: Any,
    prompt: str | list[int],
    lora_request: LoRARequest | None,
    max_tokens: int = MAX_TOKENS,
) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    item = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    [output] = llm.generate([item], params, use_tqdm=False, lora_request=lora_request)
    return list(output.outputs[0].token_ids)


@pytest.fixture(scope="module")
def references(offline: Any, adapters: Adapters) -> dict[str, list[int]]:
    """PROMPT's greedy tokens on the base and with each adapter; all three differ."""
    tokens = {
        "base": offline_tokens(offline, PROMPT, None),
        "a1": offline_tokens(offline, PROMPT, lora("a1", 1, adapters.a1)),
        "a2": offline_tokens(offline, PROMPT, lora("a2", 2, adapters.a2)),
    }
    assert tokens["a1"] != tokens["base"] and tokens["a2"] != tokens["base"]
    assert tokens["a1"] != tokens["a2"]
    return tokens


def complete(remote: RemoteServer, model: str, **kwargs: Any) -> Any:
    return remote.client().completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **kwargs,
    )


def load(remote: RemoteServer, **body: Any) -> httpx.Response:
    return remote.post("/v1/load_lora_adapter", json=body)


def unload(remote: RemoteServer, **body: Any) -> httpx.Response:
    return remote.post("/v1/unload_lora_adapter", json=body)


def model_ids(remote: RemoteServer) -> list[str]:
    return [card.id for card in remote.client().models.list().data]


# ---------------------------------------------------------------------------------------------------- flags
def test_lora_flags_parse_in_both_of_vllms_forms() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--enable-lora",
            "--max-loras",
            "3",
            "--max-lora-rank",
            "32",
            "--max-cpu-loras",
            "5",
            "--lora-modules",
            "x=/adapters/x",
            '{"name": "y", "path": "/adapters/y", "base_model_name": "org/base"}',
            "--enable-runtime-lora-updating",
        ]
    )
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (
        True,
        3,
        32,
        5,
    )
    assert args.enable_runtime_lora_updating
    assert [parse_lora_module(text) for text in args.lora_modules] == [
        LoRAModulePath("x", "/adapters/x"),
        LoRAModulePath("y", "/adapters/y", "org/base"),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no-equals-sign", "neither name=path nor JSON"),
        ("=/path", "neither name=path nor JSON"),
        ('{"name": "x"}', "needs path"),
        ('{"name": "x", "path": "/p", "rank": 8}', "unknown keys ['rank']"),
        ('{"name": "x", ', "not valid JSON"),
    ],
)
def test_a_bad_lora_module_is_an_error_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="--lora-modules") as error:
        parse_lora_module(text)
    assert message in str(error.value)


def test_runtime_updating_variables_are_vllms_and_kvflows() -> None:
    assert runtime_lora_updating_from_env({}) is None
    assert runtime_lora_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}) is None
    assert (
        runtime_lora_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
        == "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
    )
    assert (
        runtime_lora_updating_from_env({"KVFLOW_ALLOW_RUNTIME_LORA_UPDATING": "1"})
        == "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"
    )
    with pytest.raises(ValueError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING='yes'"):
        runtime_lora_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"})


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING")
    }
    return subprocess.run(
        [*kvflow_command(), "serve", *args, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["--lora-modules", "x=/adapters/x"],
            {},
            "--lora-modules needs --enable-lora",
        ),
        (
            ["--enable-runtime-lora-updating"],
            {},
            "--enable-runtime-lora-updating needs --enable-lora",
        ),
        (
            [],
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 needs --enable-lora",
        ),
        (
            ["--enable-lora", "--enable-runtime-lora-updating", "--api-server-count", "2"],
            {},
            "--enable-runtime-lora-updating needs a single API server process",
        ),
        (["--enable-lora", "--lora-modules", "oops"], {}, "--lora-modules: 'oops' is neither"),
    ],
)
def test_lora_flag_mistakes_are_one_line_errors_before_anything_loads(
    args: list[str], env: dict[str, str], message: str
) -> None:
    result = run_serve("hash", *args, env=env)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"kvflow serve: error: {message}"), line


def test_a_bad_adapter_in_lora_modules_stops_the_server_naming_it(adapters: Adapters) -> None:
    result = run_serve(
        str(adapters.base),
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "64",
        "--enable-lora",
        "--lora-modules",
        f"good={adapters.a1}",
        f"big={adapters.rank_32}",
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("kvflow serve: error: --lora-modules big: cannot load"), last
    assert str(adapters.rank_32) in last and "32" in last


# ---------------------------------------------------------------------------------------------------- serving
def test_models_lists_each_adapter_with_its_parent(
    server: RemoteServer, adapters: Adapters
) -> None:
    cards = {card.id: card for card in server.client().models.list().data}
    assert list(cards) == ["base", "a1", "a2"]
    base, a1, a2 = (cards[name].model_dump() for name in ("base", "a1", "a2"))
    assert (base["root"], base["parent"]) == (str(adapters.base), None)
    assert (a1["root"], a1["parent"]) == (str(adapters.a1), "base")
    assert (a2["root"], a2["parent"]) == (str(adapters.a2), "tiny-base")  # its base_model_name
    assert a1["max_model_len"] == base["max_model_len"] == 1024


def test_completions_with_an_adapter_equal_offline_generate(
    server: RemoteServer, references: dict[str, list[int]]
) -> None:
    for model in ("base", "a1", "a2"):
        response = complete(server, model)
        assert response.model == model
        [choice] = response.choices
        assert choice.model_extra["token_ids"] == references[model], model
    no_model = server.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    )
    assert no_model.status_code == 200 and no_model.json()["model"] == "base"


def test_chat_with_an_adapter_equals_offline_generate(
    server: RemoteServer, offline: Any, adapters: Adapters
) -> None:
    results = {}
    for model in ("base", "a2"):
        response = server.client().chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert response.model == model
        prompt_ids = response.model_extra["prompt_token_ids"]
        results[model] = response.choices[0].model_extra["token_ids"]
        lora_request = lora("a2", 2, adapters.a2) if model == "a2" else None
        assert results[model] == offline_tokens(offline, prompt_ids, lora_request), model
    assert results["a2"] != results["base"]


def test_streams_name_the_adapter_and_carry_its_tokens(
    server: RemoteServer, references: dict[str, list[int]]
) -> None:
    stream = complete(server, "a1", stream=True)
    tokens: list[int] = []
    for chunk in stream:
        assert chunk.model == "a1"
        for choice in chunk.choices:
            tokens += choice.model_extra["token_ids"]
    assert tokens == references["a1"]
    chat = server.client().chat.completions.create(
        model="a2",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    assert {chunk.model for chunk in chat} == {"a2"}


def test_beam_search_runs_every_beam_with_the_adapter(
    server: RemoteServer, offline: Any, adapters: Adapters
) -> None:
    """`use_beam_search` with `model: "<adapter>"` returns the offline engine's beams under that adapter (not the
    base's)."""
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, "temperature": 0}
    by_adapter = server.post("/v1/completions", json={**body, "model": "a1"})
    by_base = server.post("/v1/completions", json={**body, "model": "base"})
    assert by_adapter.status_code == 200, by_adapter.text
    assert by_base.status_code == 200, by_base.text
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    [expected] = offline.beam_search([PROMPT], params, lora_request=lora("a1", 1, adapters.a1))
    [expected_base] = offline.beam_search([PROMPT], params)
    assert [choice["text"] for choice in by_adapter.json()["choices"]] == [
        sequence.text for sequence in expected.sequences
    ]
    assert [choice["text"] for choice in by_base.json()["choices"]] == [
        sequence.text for sequence in expected_base.sequences
    ]
    assert by_adapter.json()["choices"] != by_base.json()["choices"]


def test_an_unknown_model_is_404_naming_it(server: RemoteServer) -> None:
    with pytest.raises(openai.NotFoundError) as completion:
        complete(server, "a9")
    assert "`a9` does not exist" in str(completion.value)
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(
            model="a9", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert server.post("/tokenize", json={"model": "a9", "prompt": "x"}).status_code == 404


def test_tokenize_takes_an_adapters_name(server: RemoteServer) -> None:
    by_adapter = server.post("/tokenize", json={"model": "a1", "prompt": PROMPT})
    by_base = server.post("/tokenize", json={"model": "base", "prompt": PROMPT})
    assert by_adapter.status_code == 200
    assert by_adapter.json()["tokens"] == by_base.json()["tokens"]


# ---------------------------------------------------------------------------------------------------- load / unload
def test_load_and_unload_are_not_served_without_runtime_updating(adapters: Adapters) -> None:
    """As in vLLM, which mounts them only under VLLM_ALLOW_RUNTIME_LORA_UPDATING: 404 (not found), and nothing
    changes."""
    with running_server(*server_args(adapters)) as remote:
        loaded = load(remote, lora_name="a3", lora_path=str(adapters.a1))
        assert loaded.status_code == 404 and loaded.json()["error"]["message"] == "Not Found"
        assert unload(remote, lora_name="a1").status_code == 404
        assert model_ids(remote) == ["base", "a1", "a2"]


def test_vllms_variable_turns_runtime_updating_on(
    adapters: Adapters, references: dict[str, list[int]]
) -> None:
    with running_server(
        *server_args(adapters), env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    ) as remote:
        loaded = load(remote, lora_name="a3", lora_path=str(adapters.a1))
        assert loaded.status_code == 200, loaded.text
        assert complete(remote, "a3").choices[0].model_extra["token_ids"] == references["a1"]
        # --lora-modules took ids 1 and 2, in their order: unloading id 2 removes a2.
        by_id = unload(remote, lora_int_id=2)
        assert by_id.text == "Success: LoRA adapter 'a2' removed successfully."
        assert model_ids(remote) == ["base", "a1", "a3"]


def test_load_use_unload_then_404(
    server: RemoteServer, adapters: Adapters, references: dict[str, list[int]]
) -> None:
    loaded = load(server, lora_name="a3", lora_path=str(adapters.a1))
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'a3' added successfully."
    cards = {each.id: each.model_dump() for each in server.client().models.list().data}
    assert (cards["a3"]["root"], cards["a3"]["parent"]) == (str(adapters.a1), "base")
    assert complete(server, "a3").choices[0].model_extra["token_ids"] == references["a1"]

    unloaded = unload(server, lora_name="a3")
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'a3' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(server, "a3")
    assert "a3" not in model_ids(server)
    again = unload(server, lora_name="a3")
    assert again.status_code == 404 and "'a3' cannot be found" in again.json()["error"]["message"]

    # The name can be loaded again (a new id: nothing of the old one is reused), from another folder.
    assert load(server, lora_name="a3", lora_path=str(adapters.a2)).status_code == 200
    assert complete(server, "a3").choices[0].model_extra["token_ids"] == references["a2"]
    assert unload(server, lora_name="a3").status_code == 200


def test_load_errors_are_400_naming_the_problem(server: RemoteServer, adapters: Adapters) -> None:
    def error_of(**body: Any) -> dict[str, Any]:
        response = load(server, **body)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    missing = error_of(lora_name="gone", lora_path="/no/such/adapter")
    assert "/no/such/adapter" in missing["message"] and missing["param"] == "lora_path"
    rank = error_of(lora_name="big", lora_path=str(adapters.rank_32))
    assert "32" in rank["message"] and "rank" in rank["message"]
    module = error_of(lora_name="head", lora_path=str(adapters.lm_head))
    assert "lm_head" in module["message"]
    twice = error_of(lora_name="a1", lora_path=str(adapters.a2))
    assert "has already been loaded" in twice["message"] and twice["param"] == "lora_name"
    base = error_of(lora_name="base", lora_path=str(adapters.a1))
    assert "conflicts with the served base model" in base["message"]
    no_path = error_of(lora_name="x")
    assert no_path["param"] == "lora_path"
    # None of them was registered, and a1 still runs its own weights.
    assert model_ids(server) == ["base", "a1", "a2"]


def test_unload_by_id_and_its_errors(server: RemoteServer, adapters: Adapters) -> None:
    assert load(server, lora_name="by-id", lora_path=str(adapters.a1)).status_code == 200
    neither = unload(server)
    assert neither.status_code == 400
    assert "lora_name" in neither.json()["error"]["message"]
    assert unload(server, lora_int_id=10_000).status_code == 404
    wrong = unload(
        server, lora_name="by-id", lora_int_id=1
    )  # 1 is a1's id (--lora-modules: 1, 2, ...)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "lora_int_id"
    assert unload(server, lora_name="by-id").status_code == 200


def test_load_inplace_moves_the_name_to_the_new_folder(
    server: RemoteServer, adapters: Adapters, references: dict[str, list[int]]
) -> None:
    assert load(server, lora_name="swap", lora_path=str(adapters.a1)).status_code == 200
    assert complete(server, "swap").choices[0].model_extra["token_ids"] == references["a1"]
    swapped = load(server, lora_name="swap", lora_path=str(adapters.a2), load_inplace=True)
    assert swapped.status_code == 200, swapped.text
    assert complete(server, "swap").choices[0].model_extra["token_ids"] == references["a2"]
    assert unload(server, lora_name="swap").status_code == 200


def test_the_endpoints_need_the_api_key(server: RemoteServer, adapters: Adapters) -> None:
    body = {"lora_name": "nokey", "lora_path": str(adapters.a1)}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 401
    assert "nokey" not in model_ids(server)


# ---------------------------------------------------------------------------------------------------- in flight
async def lora_info(http: httpx.AsyncClient) -> list[dict[str, str]]:
    """The labels of every `kvflow:lora_requests_info` series."""
    samples = parse_metrics((await http.get("/metrics")).text)
    return [dict(labels) for (name, labels) in samples if name == LORA_INFO]


async def wait_for_lora_info(
    http: httpx.AsyncClient, condition: str, **labels: str
) -> list[dict[str, str]]:
    """Poll /metrics until the gauge's one series carries `labels`; TimeoutError naming `condition` and the
    last series seen."""
    deadline = time.monotonic() + TIMEOUT_S
    seen = await lora_info(http)
    while not (len(seen) == 1 and labels.items() <= seen[0].items()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waiting for {condition}: {LORA_INFO} series are {seen}")
        await asyncio.sleep(0.02)
        seen = await lora_info(http)
    return seen


async def stream_tokens(
    client: openai.AsyncOpenAI, model: str, prompt: str
) -> tuple[list[int], str]:
    """A streamed completion's tokens and finish reason."""
    tokens: list[int] = []
    finish_reason = None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=LONG_MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            tokens += choice.model_extra["token_ids"]
            finish_reason = choice.finish_reason or finish_reason
    assert finish_reason is not None
    return tokens, finish_reason


def test_unloading_an_adapter_in_use_loses_no_request(
    server: RemoteServer, adapters: Adapters, offline: Any
) -> None:
    """Streams of a runtime adapter are held mid-generation (keep pauses); the gauge shows them running with it;
    the adapter is unloaded under them: new requests naming it get 404 at once, and after /resume every stream
    finishes with all its tokens, equal to the offline engine's with that adapter. The server then frees it."""
    assert load(server, lora_name="busy", lora_path=str(adapters.a2)).status_code == 200
    prompts = [f"Stream number {index} says" for index in range(3)]
    busy = LoRARequest("busy", 99, str(adapters.a2))  # the weights, under an id of the oracle's own
    expected = [offline_tokens(offline, prompt, busy, LONG_MAX_TOKENS) for prompt in prompts]

    async def scenario() -> None:
        client = server.async_client()
        async with server.async_http() as http:

            def start(attempt: int) -> list[asyncio.Future[Any]]:
                return [
                    asyncio.ensure_future(stream_tokens(client, "busy", prompt))
                    for prompt in prompts
                ]

            # hold_mid_generation's first pause queues the streams (all waiting), its second holds them running.
            await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            waiting = start(0)
            await wait_for_lora_info(
                http, "the streams waiting with 'busy'", waiting_lora_adapters="busy"
            )
            await http.post("/resume")
            await asyncio.gather(*waiting)  # a first round, to completion: the gate works
            tasks = await hold_mid_generation(http, start)
            [series] = await wait_for_lora_info(
                http,
                "the held streams running with 'busy'",
                running_lora_adapters="busy",
                waiting_lora_adapters="",
            )
            assert series["max_lora"] == "2" and series["model_name"] == "base"
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
            assert unloaded.status_code == 200, unloaded.text
            refused = await http.post(
                "/v1/completions", json={"model": "busy", "prompt": PROMPT, "max_tokens": 2}
            )
            assert refused.status_code == 404
            assert not any(task.done() for task in tasks)
            assert (await http.post("/resume")).json() == {"status": "resumed"}
            results = await asyncio.gather(*tasks)
            for (tokens, finish_reason), reference in zip(results, expected, strict=True):
                assert finish_reason == "length"
                assert tokens == reference
            await wait_for_metric(http, "kvflow:num_requests_running", 0)
            await wait_for_lora_info(
                http, "no adapter in use", running_lora_adapters="", waiting_lora_adapters=""
            )
        await client.close()

    asyncio.run(asyncio.wait_for(scenario(), TIMEOUT_S * 2))
    wait_until(
        lambda: any(line.endswith("freed") for line in _busy_lines(server)),
        "the server frees adapter 'busy' after its last request",
        timeout_s=TIMEOUT_S,
    )
    assert model_ids(server) == ["base", "a1", "a2"]


def _busy_lines(server: RemoteServer) -> list[str]:
    """The server's log lines about adapter 'busy'."""
    return [line.rstrip() for line in server.log.splitlines() if "'busy'" in line]


# ---------------------------------------------------------------------------------------------------- metrics
def scheduler_stats(running: dict[str, int], waiting: dict[str, int]) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=sum(running.values()),
        num_waiting_reqs=sum(waiting.values()),
        kv_cache_usage=0.0,
        prefix_cache_query_tokens=0,
        prefix_cache_hit_tokens=0,
        num_preemptions_total=0,
        running_lora_adapters=running,
        waiting_lora_adapters=waiting,
    )


def test_lora_gauge_is_vllms_with_one_series_at_a_time() -> None:
    logger = PrometheusStatLogger("m", max_loras=4)
    before = time.time()
    logger.refresh([scheduler_stats({"b": 1, "a": 2}, {"c": 1})], logger.refresh_token())
    samples = parse_metrics(logger.render().decode())
    [(labels, value)] = [(dict(lab), v) for (name, lab), v in samples.items() if name == LORA_INFO]
    assert labels == {
        "model_name": "m",
        "engine": "0",
        "max_lora": "4",
        "running_lora_adapters": "a,b",
        "waiting_lora_adapters": "c",
    }
    assert before <= value <= time.time()
    logger.refresh([scheduler_stats({}, {})], logger.refresh_token())
    samples = parse_metrics(logger.render().decode())
    [labels] = [dict(lab) for (name, lab) in samples if name == LORA_INFO]
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("", "")


def test_no_lora_gauge_without_lora() -> None:
    logger = PrometheusStatLogger("m")
    logger.refresh([scheduler_stats({}, {})], logger.refresh_token())
    assert "lora_requests_info" not in logger.render().decode()


# ---------------------------------------------------------------------------------------------------- processes
def test_lora_modules_with_several_api_server_processes(
    adapters: Adapters, references: dict[str, list[int]]
) -> None:
    """Every API process registers the --lora-modules adapters under the same ids: whichever process answers,
    the adapter's tokens are its own."""
    with running_server(*server_args(adapters, "--api-server-count", "2")) as remote:
        answered: set[str] = set()
        deadline = time.monotonic() + TIMEOUT_S
        while answered != {"0", "1"}:
            assert time.monotonic() < deadline, f"only API servers {answered} answered"
            with remote.http() as http:  # a new connection: the kernel picks the process
                response = http.post(
                    "/v1/completions",
                    json={
                        "model": "a1",
                        "prompt": PROMPT,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    },
                )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == references["a1"]
            answered.add(response.headers["X-Kvflow-Api-Server"])
        assert model_ids(remote) == ["base", "a1", "a2"]
