"""Beam search over HTTP (`use_beam_search` with `n` beams and `length_penalty`) on both endpoints against
`LLM.beam_search` on the same checkpoint: the same beams (tokens, text, finish reason), in the same order, with the
usage and logprobs they imply; the fields beam search does not take are 400s naming them; and `AsyncLLM.beam_search`
aborts its step requests when it is cancelled or aborted.

The checkpoint is the engine tests' tiny random qwen2 with the built-in model's tokenizer (its vocabulary and chat
template) and its EOS embedding scaled up, so that beams end at EOS at various lengths and `length_penalty` changes
their ranking. One server and one offline `LLM` for the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from safetensors.torch import load_file, save_file

from kvflow import LLM, AsyncLLM
from kvflow.beam_search import BeamSearchSequence
from kvflow.default_model import ensure_default_model
from kvflow.engine.core import EngineCore
from kvflow.sampling_params import BeamSearchParams
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from tests.entrypoints.server import RemoteServer, running_server

ENGINE_OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=4, max_num_seqs=8
)
EOS = 4095  # the built-in tokenizer's <|im_end|>
EOS_EMBEDDING_SCALE = 2.0
MAX_TOKENS = 8
TIMEOUT_S = 30.0


def server_options(checkpoint: Path) -> list[str]:
    options = [str(checkpoint)]
    for name, value in ENGINE_OPTIONS.items():
        options += [f"--{name.replace('_', '-')}", str(value)]
    return options


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_checkpoint(
        tmp_path_factory.mktemp("beam-checkpoint"),
        "qwen2",
        vocab_size=4096,
        bos_token_id=4092,
        eos_token_id=EOS,
        pad_token_id=4093,
    )
    weights_file = folder / "model.safetensors"
    weights = load_file(weights_file)
    weights["model.embed_tokens.weight"][EOS] *= EOS_EMBEDDING_SCALE  # tied: the EOS logit grows
    save_file(weights, weights_file, metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_default_model() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RemoteServer]:
    with running_server(*server_options(checkpoint)) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model(server: RemoteServer, checkpoint: Path) -> str:
    return str(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Iterator[LLM]:
    """The offline reference: the same checkpoint and engine options as the server."""
    reference = LLM(str(checkpoint), **ENGINE_OPTIONS)
    yield reference
    reference.shutdown()


def offline(
    llm: LLM, prompt: list[int], n: int, length_penalty: float = 1.0, **options: Any
) -> list[BeamSearchSequence]:
    params = BeamSearchParams(
        beam_width=n, max_tokens=MAX_TOKENS, length_penalty=length_penalty, **options
    )
    [output] = llm.beam_search([{"prompt_token_ids": prompt}], params)
    return output.sequences


def prompt_ids(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 4092) for _ in range(6)]


def beam_search(length_penalty: float = 1.0, **fields: Any) -> dict[str, Any]:
    return {"use_beam_search": True, "length_penalty": length_penalty, **fields}


def complete(
    client: openai.OpenAI,
    model: str,
    prompt: str | list[int] | list[list[int]],
    n: int,
    length_penalty: float = 1.0,
    **fields: Any,
) -> Any:
    """A beam-search completion (with the choices' token ids) of `MAX_TOKENS` tokens."""
    return client.completions.create(
        model=model,
        prompt=prompt,
        n=n,
        max_tokens=MAX_TOKENS,
        extra_body=beam_search(length_penalty, return_token_ids=True, **fields),
    )


def ranking(beams: list[BeamSearchSequence]) -> list[tuple[list[int], str | None]]:
    return [(beam.tokens, beam.finish_reason) for beam in beams]


def assert_choices_are_the_beams(
    choices: list[Any], prompt: list[int], beams: list[BeamSearchSequence], first_index: int = 0
) -> None:
    assert [choice.index for choice in choices] == list(
        range(first_index, first_index + len(beams))
    )
    for choice, beam in zip(choices, beams, strict=True):
        assert choice.token_ids == beam.tokens[len(prompt) :]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert text == beam.text
        assert choice.finish_reason == beam.finish_reason


# ------------------------------------------------------------------------------------------------ completions
@pytest.mark.parametrize(("n", "length_penalty"), [(1, 1.0), (2, 0.0), (3, 1.0), (3, 2.0)])
def test_completion_beams_equal_offline_beam_search(
    client: openai.OpenAI, model: str, llm: LLM, n: int, length_penalty: float
) -> None:
    prompt = prompt_ids(0)
    completion = complete(client, model, prompt, n, length_penalty)
    beams = offline(llm, prompt, n, length_penalty)
    assert_choices_are_the_beams(completion.choices, prompt, beams)
    usage = completion.usage
    num_generated = sum(len(beam.tokens) - len(prompt) for beam in beams)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), num_generated)
    assert usage.total_tokens == len(prompt) + num_generated


def test_several_prompts_each_get_n_beams_in_order(
    client: openai.OpenAI, model: str, llm: LLM
) -> None:
    prompts = [prompt_ids(7), prompt_ids(12)]
    completion = complete(client, model, prompts, 2)
    for index, prompt in enumerate(prompts):
        choices = completion.choices[2 * index : 2 * index + 2]
        assert_choices_are_the_beams(choices, prompt, offline(llm, prompt, 2), 2 * index)
    assert completion.usage.prompt_tokens == sum(map(len, prompts))


def test_length_penalty_changes_the_ranking_as_offline(
    client: openai.OpenAI, model: str, llm: LLM
) -> None:
    """On a prompt whose beams end at different lengths, length_penalty 0 and 2 rank them differently."""
    prompt = next(
        (
            ids
            for ids in map(prompt_ids, range(20))
            if ranking(offline(llm, ids, 3, 0.0)) != ranking(offline(llm, ids, 3, 2.0))
        ),
        None,
    )
    assert prompt is not None, "no prompt has beams that length_penalty ranks differently"
    served = []
    for length_penalty in (0.0, 2.0):
        completion = complete(client, model, prompt, 3, length_penalty)
        beams = offline(llm, prompt, 3, length_penalty)
        assert_choices_are_the_beams(completion.choices, prompt, beams)
        served.append([choice.token_ids for choice in completion.choices])
    assert served[0] != served[1]


def test_text_prompt_echo_ignore_eos_and_temperature(
    client: openai.OpenAI, model: str, llm: LLM
) -> None:
    completion = complete(
        client, model, "Hello, my name is", 2, temperature=0.0, echo=True, ignore_eos=True
    )
    [first, second] = completion.choices
    prompt = first.prompt_token_ids
    beams = offline(llm, prompt, 2, ignore_eos=True)
    for choice, beam in zip(completion.choices, beams, strict=True):
        assert choice.text == "Hello, my name is" + beam.text
        assert choice.token_ids == beam.tokens  # echo: the prompt's ids first
        assert choice.finish_reason == "length"
    assert (first.index, second.index) == (0, 1)


def test_special_tokens_and_the_stop_string_are_kept_when_asked(
    client: openai.OpenAI, model: str, llm: LLM
) -> None:
    prompt = prompt_ids(4)
    completion = complete(
        client, model, prompt, 3, 0.0, skip_special_tokens=False, include_stop_str_in_output=True
    )
    beams = offline(llm, prompt, 3, 0.0, include_stop_str_in_output=True)
    tokenizer = llm.get_tokenizer()
    assert "stop" in {beam.finish_reason for beam in beams}, "no beam ends at EOS"
    for choice, beam in zip(completion.choices, beams, strict=True):
        assert choice.token_ids == beam.tokens[len(prompt) :]
        assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=False)
        assert choice.finish_reason == beam.finish_reason


def test_completion_logprobs_are_the_chosen_tokens(
    client: openai.OpenAI, model: str, llm: LLM
) -> None:
    prompt = prompt_ids(9)
    completion = complete(client, model, prompt, 2, logprobs=4, return_tokens_as_token_ids=True)
    for choice, beam in zip(completion.choices, offline(llm, prompt, 2), strict=True):
        logprobs = choice.logprobs
        assert logprobs.tokens == [f"token_id:{token_id}" for token_id in choice.token_ids]
        assert sum(logprobs.token_logprobs) == pytest.approx(beam.cum_logprob, abs=1e-3)
        assert all(1 <= len(top) <= 5 for top in logprobs.top_logprobs)


# ------------------------------------------------------------------------------------------------ chat
@pytest.mark.parametrize(("n", "length_penalty"), [(1, 1.0), (2, 1.0), (3, 0.5)])
def test_chat_beams_equal_offline_beam_search(
    client: openai.OpenAI, model: str, llm: LLM, n: int, length_penalty: float
) -> None:
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Question 8"}],
        n=n,
        max_completion_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=2,
        extra_body=beam_search(length_penalty, return_token_ids=True),
    )
    assert chat.id.startswith("chatcmpl-")
    prompt = chat.prompt_token_ids
    beams = offline(llm, prompt, n, length_penalty)
    assert_choices_are_the_beams(chat.choices, prompt, beams)
    for choice, beam in zip(chat.choices, beams, strict=True):
        assert choice.message.role == "assistant"
        content = choice.logprobs.content
        assert len(content) == len(beam.tokens) - len(prompt)
        assert sum(entry.logprob for entry in content) == pytest.approx(beam.cum_logprob, abs=1e-3)
        assert all(len(entry.top_logprobs) == 2 for entry in content)
    num_generated = sum(len(beam.tokens) - len(prompt) for beam in beams)
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(prompt), num_generated)


# ------------------------------------------------------------------------------------------------ refusals
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
REFUSED: list[tuple[str, str, dict[str, Any]]] = [
    ("both", "stream", {"stream": True}),
    ("both", "top_p", {"top_p": 0.5}),
    ("both", "top_k", {"top_k": 5}),
    ("both", "repetition_penalty", {"repetition_penalty": 1.2}),
    ("both", "seed", {"seed": 1}),
    ("both", "stop", {"stop": ["x"]}),
    ("both", "stop_token_ids", {"stop_token_ids": [7]}),
    ("both", "min_tokens", {"min_tokens": 2}),
    ("both", "logit_bias", {"logit_bias": {"7": 1.0}}),
    ("both", "response_format", {"response_format": {"type": "json_object"}}),
    ("both", "prompt_logprobs", {"prompt_logprobs": 1}),
    ("both", "n", {"n": 11}),  # 2 * 11 logprobs per step, over max_logprobs 20
    # Once a ZeroDivisionError / OverflowError (500) in the ranking's power of the length.
    ("both", "length_penalty", {"length_penalty": 1e30}),
    ("both", "length_penalty", {"length_penalty": -1e30}),
    ("completions", "logprobs", {"n": 2, "logprobs": 5}),  # more than the 2 * n candidates
    ("completions", "echo", {"echo": True, "logprobs": 1}),
    ("chat", "top_logprobs", {"n": 2, "logprobs": True, "top_logprobs": 5}),
    ("chat", "tool_choice", {"tools": TOOLS, "tool_choice": "required"}),  # a constraint
]
CASES = [
    (endpoint, param, body)
    for where, param, body in REFUSED
    for endpoint in (("completions", "chat") if where == "both" else (where,))
]


def post(server: RemoteServer, endpoint: str, model: str, body: dict[str, Any]) -> Any:
    if endpoint == "chat":
        path, prompt = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
    else:
        path, prompt = "/v1/completions", {"prompt": [5, 6, 7]}
    return server.post(path, json={"model": model, "max_tokens": 2, **prompt, **body})


@pytest.mark.parametrize(
    ("endpoint", "param", "body"), CASES, ids=[f"{case[0]}-{case[1]}" for case in CASES]
)
def test_a_field_beam_search_does_not_take_is_a_400_naming_it(
    server: RemoteServer, model: str, endpoint: str, param: str, body: dict[str, Any]
) -> None:
    response = post(server, endpoint, model, {"use_beam_search": True, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_neutral_values_pass_and_length_penalty_needs_beam_search(
    server: RemoteServer, model: str, endpoint: str
) -> None:
    neutral = {"top_p": 1.0, "top_k": -1, "stream": False, "stop": [], "n": 2}
    served = post(server, endpoint, model, {"use_beam_search": True, **neutral})
    assert served.status_code == 200, served.text
    assert [choice["index"] for choice in served.json()["choices"]] == [0, 1]
    response = post(server, endpoint, model, {"length_penalty": 0.5})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "length_penalty"
    assert "only with use_beam_search" in error["message"]


# ------------------------------------------------------------------------------------------------ AsyncLLM
def engine_requests(core: EngineCore) -> list[str]:
    return sorted(core.scheduler.requests)


async def wait_for(llm: AsyncLLM, ready: Any, what: str) -> list[str]:
    """Poll the engine's request ids until `ready(ids)`; AssertionError naming `what` past the deadline."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        request_ids = await llm.run_in_engine(engine_requests)
        if ready(request_ids):
            return request_ids
        assert time.monotonic() < deadline, f"{what}: the engine holds {request_ids}"
        await asyncio.sleep(0)


def later_step(request_id: str) -> Any:
    """Whether the engine holds a request of a step after the first (`<request_id>-<step>-<beam>`), when the
    search has `beam_width` live beams."""
    return lambda ids: any(
        each.startswith(f"{request_id}-") and each.split("-")[-2] != "0" for each in ids
    )


def test_async_beam_search_equals_offline_and_cancel_or_abort_leaves_no_request(
    checkpoint: Path, llm: LLM
) -> None:
    prompt = prompt_ids(12)
    long_search = BeamSearchParams(beam_width=3, max_tokens=200, ignore_eos=True)

    async def run() -> None:
        engine = AsyncLLM(str(checkpoint), **ENGINE_OPTIONS)
        try:
            params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=2.0)
            output = await engine.beam_search({"prompt_token_ids": prompt}, "plain", params)
            assert ranking(output.sequences) == ranking(offline(llm, prompt, 3, 2.0))

            search = asyncio.ensure_future(
                engine.beam_search({"prompt_token_ids": prompt}, "cancelled", long_search)
            )
            await wait_for(engine, later_step("cancelled"), "the search's second step never ran")
            search.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await search
            assert search.cancelled()
            await wait_for(engine, lambda ids: not ids, "the cancelled search left requests")
            assert not engine.output_processor.request_states
            assert not engine._beam_searches

            search = asyncio.ensure_future(
                engine.beam_search({"prompt_token_ids": prompt}, "aborted", long_search)
            )
            await wait_for(engine, later_step("aborted"), "the search's second step never ran")
            await engine.abort("aborted")
            aborted = await asyncio.wait_for(search, TIMEOUT_S)
            assert {beam.finish_reason for beam in aborted.sequences} == {"abort"}
            assert len(aborted.sequences) == 3
            await wait_for(engine, lambda ids: not ids, "the aborted search left requests")
        finally:
            await asyncio.to_thread(engine.shutdown)

    asyncio.run(asyncio.wait_for(run(), 2 * TIMEOUT_S))
