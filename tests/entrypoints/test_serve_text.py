"""The server on the built-in default model (a tokenizer, a chat template, random weights) against the in-process
`LLM` with the same engine options: greedy text completions and chats, streamed or whole, match it token for token,
and so do logprobs; plus stop strings, seeds, echo, tokenization, the models card and weight updates."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvflow
from kvflow import LLM, SamplingParams
from tests.entrypoints.server import DEFAULT_SERVER, RemoteServer, running_server, sse_payloads

ENGINE_OPTIONS = dict(max_model_len=1024, num_kv_blocks=256, max_num_seqs=4)
PROMPTS = ["Hello, my name is", "The capital of France is"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a KV cache?"},
]


# The server's generation_config.json: defaults for fields a request leaves unset (every other test sets them).
GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 40}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    with running_server(
        *DEFAULT_SERVER, "--enable-admin-endpoints", "--generation-config", str(folder)
    ) as remote:
        yield remote


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The in-process reference: the same model and engine options as the server."""
    return LLM(**ENGINE_OPTIONS)


def greedy(max_tokens: int, **options: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **options)


def stream_lines(
    server: RemoteServer, path: str, body: dict[str, Any]
) -> list[dict[str, Any] | str]:
    with (
        server.http() as http,
        http.stream("POST", path, json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200, response.read()
        return sse_payloads(list(response.iter_lines()))


# ------------------------------------------------------------------------------------------------ vs LLM
@pytest.mark.parametrize("stream", [False, True])
def test_greedy_text_completion_equals_llm(server: RemoteServer, llm: LLM, stream: bool) -> None:
    expected = llm.generate(PROMPTS, greedy(16), use_tqdm=False)
    for prompt, reference in zip(PROMPTS, expected, strict=True):
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
        if stream:
            *chunks, done = stream_lines(server, "/v1/completions", body)
            assert done == "[DONE]"
            text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
            token_ids = [token for chunk in chunks for token in chunk["choices"][0]["token_ids"]]
            prompt_token_ids = chunks[0]["choices"][0]["prompt_token_ids"]
        else:
            [choice] = server.post("/v1/completions", json=body).json()["choices"]
            text, token_ids, prompt_token_ids = (
                choice["text"],
                choice["token_ids"],
                choice["prompt_token_ids"],
            )
        assert token_ids == reference.outputs[0].token_ids
        assert text == reference.outputs[0].text
        assert prompt_token_ids == reference.prompt_token_ids


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_equals_llm_chat(server: RemoteServer, llm: LLM, stream: bool) -> None:
    [reference] = llm.chat(MESSAGES, greedy(12), use_tqdm=False)
    client = server.client()
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="default",
                messages=MESSAGES,
                max_completion_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].prompt_token_ids == reference.prompt_token_ids
        assert chunks[0].object == "chat.completion.chunk"
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        token_ids = [token for chunk in chunks[1:] for token in chunk.choices[0].token_ids]
        assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == "length"
    else:
        response = client.chat.completions.create(
            model="default",
            messages=MESSAGES,
            max_completion_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert response.id.startswith("chatcmpl-")
        assert response.object == "chat.completion"
        [choice] = response.choices
        assert choice.message.role == "assistant"
        assert choice.finish_reason == "length"
        text, token_ids = choice.message.content, choice.token_ids
        assert response.prompt_token_ids == reference.prompt_token_ids
        assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
        assert response.usage.completion_tokens == 12
    assert token_ids == reference.outputs[0].token_ids
    assert text == reference.outputs[0].text


def test_streamed_chat_with_n_samples_opens_each_choice_with_the_role(
    server: RemoteServer, llm: LLM
) -> None:
    [reference] = llm.chat(MESSAGES, greedy(8), use_tqdm=False)
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "n": 2}
    *chunks, done = stream_lines(server, "/v1/chat/completions", body)
    assert done == "[DONE]"
    by_choice: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        by_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(by_choice) == [0, 1]
    for choices in by_choice.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in choice["delta"] for choice in choices[1:])
        assert (
            "".join(choice["delta"]["content"] for choice in choices) == reference.outputs[0].text
        )
        assert [choice["finish_reason"] for choice in choices][-1] == "length"


def test_completion_logprobs_match_llm_in_openai_shape(server: RemoteServer, llm: LLM) -> None:
    [reference] = llm.generate(PROMPTS[:1], greedy(8, logprobs=3), use_tqdm=False)
    choice = (
        server.client()
        .completions.create(
            model="default", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3
        )
        .choices[0]
    )
    logprobs = choice.logprobs
    positions = reference.outputs[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    for i, (token_id, position) in enumerate(
        zip(reference.outputs[0].token_ids, positions, strict=True)
    ):
        actual = position[token_id]
        assert logprobs.tokens[i] == actual.decoded_token
        assert logprobs.token_logprobs[i] == pytest.approx(actual.logprob, abs=1e-4)
        top = logprobs.top_logprobs[i]
        assert top[logprobs.tokens[i]] == logprobs.token_logprobs[i]
        assert len(top) <= 4  # the chosen token and the 3 most likely
        expected_top = {lp.decoded_token: lp.logprob for lp in position.values() if lp.rank <= 3}
        for token, value in expected_top.items():
            assert top[token] == pytest.approx(value, abs=1e-4)
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    assert [b - a for a, b in itertools.pairwise(offsets)] == [
        len(token) for token in logprobs.tokens[:-1]
    ]


def test_streamed_completion_logprobs_are_the_whole_responses(server: RemoteServer) -> None:
    """Each streamed chunk carries its tokens' logprobs; concatenated they are the whole response's (a chunk once
    left them out as `{}`: they were appended to defaults the chunk's serialisation skips as unset)."""
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 3}
    whole = server.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    chunks = [
        payload["choices"][0]["logprobs"]
        for payload in stream_lines(server, "/v1/completions", body)[:-1]
        if payload["choices"]
    ]
    streamed = {
        name: [value for chunk in chunks for value in chunk[name]]
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert len(streamed["tokens"]) == 8
    assert streamed == whole


def test_chat_logprobs_match_llm_in_openai_shape(server: RemoteServer, llm: LLM) -> None:
    [reference] = llm.chat(MESSAGES, greedy(6, logprobs=2), use_tqdm=False)
    response = server.client().chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for entry, token_id, position in zip(
        content, reference.outputs[0].token_ids, reference.outputs[0].logprobs, strict=True
    ):
        assert entry.token == position[token_id].decoded_token
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert (
            entry.top_logprobs[0].token == entry.token
        )  # greedy: the chosen token is the most likely
        assert entry.top_logprobs[0].logprob == entry.logprob
    no_top = server.client().chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True
    )
    assert [entry.top_logprobs for entry in no_top.choices[0].logprobs.content] == [[], []]


# ------------------------------------------------------------------------------------------------ sampling
def test_stop_string_is_held_back_while_streaming(server: RemoteServer, llm: LLM) -> None:
    text = llm.generate(PROMPTS[1:], greedy(32), use_tqdm=False)[0].outputs[0].text
    start = next(k for k in range(5, len(text) - 3) if text.find(text[k : k + 3]) == k)
    stop = text[start : start + 3]
    body = {"prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0, "stop": [stop]}
    [choice] = server.post("/v1/completions", json=body).json()["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        text[:start],
        "stop",
        stop,
    )
    *chunks, _ = stream_lines(server, "/v1/completions", body)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == text[:start]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    included = server.post(
        "/v1/completions", json={**body, "include_stop_str_in_output": True}
    ).json()
    assert included["choices"][0]["text"] == text[:start] + stop


def test_a_seed_gives_the_same_sample_whatever_runs_beside_it(server: RemoteServer) -> None:
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 1234,
        "return_token_ids": True,
    }

    def sample(**overrides: Any) -> list[int]:
        return server.post("/v1/completions", json={**body, **overrides}).json()["choices"][0][
            "token_ids"
        ]

    alone = sample()
    assert sample() == alone
    assert sample(seed=4321) != alone

    async def beside_others() -> list[int]:
        async with server.async_http() as http:
            others = [
                http.post(
                    "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 1.0}
                )
                for prompt in ["Once upon a time", "def main():", "1, 2, 3,"]
            ]
            seeded, *_ = await asyncio.gather(http.post("/v1/completions", json=body), *others)
            return seeded.json()["choices"][0]["token_ids"]

    assert asyncio.run(beside_others()) == alone


def test_echo_prepends_the_prompt(server: RemoteServer, llm: LLM) -> None:
    [reference] = llm.generate(PROMPTS[:1], greedy(5), use_tqdm=False)
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "echo": True}
    assert server.post("/v1/completions", json=body).json()["choices"][0]["text"] == (
        PROMPTS[0] + reference.outputs[0].text
    )
    ids = reference.prompt_token_ids
    by_ids = server.post("/v1/completions", json={**body, "prompt": ids}).json()["choices"][0][
        "text"
    ]
    prompt_text = llm.get_tokenizer().decode(ids, skip_special_tokens=False)
    assert by_ids == prompt_text + reference.outputs[0].text


def test_generation_config_defaults_apply_to_unset_fields(server: RemoteServer, llm: LLM) -> None:
    [reference] = llm.chat(MESSAGES, greedy(40), use_tqdm=False)
    response = server.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "return_token_ids": True}
    )
    [choice] = response.json()["choices"]
    assert (
        choice["token_ids"] == reference.outputs[0].token_ids
    )  # greedy and 40 tokens: both from the file
    capped = server.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 50}).json()
    assert (
        capped["usage"]["completion_tokens"] == 40
    )  # max_new_tokens caps what a request asks, as in vLLM


# ------------------------------------------------------------------------------------------------ prompt logprobs
def test_likelihood_scoring_returns_one_logprob_per_prompt_token(
    server: RemoteServer, llm: LLM
) -> None:
    """lm-evaluation-harness `local-completions`: token-id prompts, echo + logprobs=1 + max_tokens=1."""
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode(text, add_special_tokens=False)
        for text in ["The cat sat", "Paris is in France"]
    ]
    body = {
        "prompt": prompts,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    response = server.post("/v1/completions", json=body).json()
    choices = {choice["index"]: choice for choice in response["choices"]}
    references = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        greedy(1, logprobs=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    for index, (ids, reference) in enumerate(zip(prompts, references, strict=True)):
        logprobs = choices[index]["logprobs"]
        assert (
            len(logprobs["token_logprobs"]) == len(ids) + 1
        )  # no BOS added; the generated token last
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for position in range(1, len(ids) + 1):
            token = logprobs["tokens"][position]
            assert logprobs["top_logprobs"][position][token] == logprobs["token_logprobs"][position]
        for position in range(1, len(ids)):
            expected = reference.prompt_logprobs[position][ids[position]].logprob
            assert logprobs["token_logprobs"][position] == pytest.approx(expected, abs=1e-4)


def test_prompt_logprobs_field_in_vllm_shape(server: RemoteServer, llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    response = server.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2},
    ).json()
    prompt_logprobs = response["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, position in zip(ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token_id) in position
        assert set(position[str(token_id)]) == {"logprob", "rank", "decoded_token"}
        assert 1 <= len(position) <= 3


# ------------------------------------------------------------------------------------------------ other endpoints
def test_tokenize_and_detokenize_round_trip(server: RemoteServer, llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = "Hello world, héllo wörld!"
    response = server.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert response["tokens"] == tokenizer.encode(text)
    assert response["count"] == len(response["tokens"])
    assert response["max_model_len"] == 1024
    assert response["token_strs"] == tokenizer.convert_ids_to_tokens(response["tokens"])
    assert server.post("/detokenize", json={"tokens": response["tokens"]}).json() == {
        "prompt": text
    }
    bare = server.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    chat_tokens = server.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    chat = server.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True},
    ).json()
    assert chat_tokens == chat["prompt_token_ids"]  # what a chat request would use
    outside = server.post("/detokenize", json={"tokens": [10**7]})
    assert (outside.status_code, outside.json()["error"]["param"]) == (400, "tokens")


def test_models_health_and_version(server: RemoteServer) -> None:
    [card] = server.client().models.list().data
    assert (card.id, card.object, card.owned_by) == ("default", "model", "kvflow")
    assert card.max_model_len == 1024
    assert Path(card.root).is_dir()  # the checkpoint folder
    assert server.get("/health").status_code == 200
    assert server.get("/version").json() == {"version": kvflow.__version__}


def test_update_weights_bumps_the_weight_version(server: RemoteServer, llm: LLM) -> None:
    root = server.get("/v1/models").json()["data"][0]["root"]
    assert server.post("/update_weights", json={"path": root}).status_code == 409
    assert server.post("/pause", params={"mode": "wait"}).status_code == 200
    try:
        assert server.post("/update_weights", json={"path": root}).json() == {"weight_version": 1}
        assert server.get("/weight_version").json() == {"weight_version": 1}
    finally:
        server.post("/resume")
    [reference] = llm.generate(PROMPTS[:1], greedy(6), use_tqdm=False)
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    assert server.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == (
        reference.outputs[0].token_ids  # the same checkpoint, reloaded
    )


def test_collective_rpc_runs_a_worker_method_on_every_rank(server: RemoteServer) -> None:
    root = server.get("/v1/models").json()["data"][0]["root"]
    server.post("/pause", params={"mode": "wait"})
    try:
        response = server.post("/collective_rpc", json={"method": "update_weights", "args": [root]})
    finally:
        server.post("/resume")
    assert response.status_code == 200
    assert response.json() == {"results": [None]}


# ------------------------------------------------------------------------------------------------ chat errors
CHAT_INVALID = [
    ({"messages": [{"role": "user"}]}, "messages"),  # no content
    ({"messages": [{"content": "hi"}]}, "messages"),  # no role
    ({"messages": "hi"}, "messages"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages",
    ),
    ({"max_completion_tokens": 5000}, "max_completion_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    (
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
        "tool_choice",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"},
        "tool_choice",
    ),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools"),
    ({"chat_template": "{{ messages[0]['content'] | nonexistent_filter }}"}, "chat_template"),
    ({"n": -1}, "n"),
]


@pytest.mark.parametrize(
    ("fields", "param"), CHAT_INVALID, ids=[str(case[0])[:40] for case in CHAT_INVALID]
)
def test_invalid_chat_request_names_its_field(
    server: RemoteServer, fields: dict[str, Any], param: str
) -> None:
    response = server.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **fields}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_text_content_parts_are_joined(server: RemoteServer) -> None:
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is a"},
                {"type": "text", "text": "KV cache?"},
            ],
        }
    ]
    joined = [{"role": "user", "content": "What is a\nKV cache?"}]
    tokens = [
        server.post("/tokenize", json={"messages": messages}).json()["tokens"]
        for messages in (parts, joined)
    ]
    assert tokens[0] == tokens[1]
    response = server.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 2})
    assert response.status_code == 200


# ------------------------------------------------------------------------------------------------ chunk bytes
STREAMED_BODIES = [
    (
        "/v1/completions",
        {"prompt": PROMPTS, "n": 2, "max_tokens": 6, "temperature": 0.8, "seed": 3},
    ),
    (
        "/v1/completions",
        {
            "prompt": PROMPTS[0],
            "max_tokens": 5,
            "echo": True,
            "logprobs": 2,
            "prompt_logprobs": 1,
            "return_token_ids": True,
            "stop": ["is"],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 6,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 4, "stream_options": {"include_usage": True}},
    ),
]


@pytest.mark.parametrize(("endpoint", "body"), STREAMED_BODIES)
def test_stream_chunks_are_the_response_models_json_byte_for_byte(
    server: RemoteServer, endpoint: str, body: dict[str, Any]
) -> None:
    """Chunks are encoded from dicts (msgspec), not from the pydantic response models: each event's bytes must be
    what the model would write for the same fields (key order, number format, nested models), and carry the fields
    every chunk of its kind has."""
    from kvflow.entrypoints.openai.protocol import (
        ChatCompletionStreamResponse,
        CompletionStreamResponse,
    )

    model = (
        CompletionStreamResponse if endpoint == "/v1/completions" else ChatCompletionStreamResponse
    )
    response = server.post(endpoint, json={"model": "default", "stream": True, **body})
    assert response.status_code == 200, response.text
    events = response.content.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [event.removeprefix(b"data: ") for event in events[:-2]]
    assert chunks and all(event.startswith(b"data: ") for event in events[:-2])
    for raw in chunks:
        parsed = json.loads(raw)
        assert list(parsed)[:5] == ["id", "object", "created", "model", "choices"]
        assert model.model_validate(parsed).model_dump_json(exclude_unset=True).encode() == raw
        for choice in parsed["choices"]:
            assert {"index", "logprobs", "finish_reason", "stop_reason"} <= set(choice)
    usage_on = body.get("stream_options", {}).get("include_usage", False)
    assert ("usage" in json.loads(chunks[-1])) == usage_on
