"""Clear ValueErrors from the Python API for the first-hour mistakes, each naming what to change."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvflow import LLM, AsyncLLM, SamplingParams
from kvflow.engine.arg_utils import EngineArgs

requires_cpu_only_torch = pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="needs a PyTorch build without CUDA"
)


# ------------------------------------------------------------------------------------------------ engine options
@requires_cpu_only_torch
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_cpu_only_build_is_a_value_error(device: str) -> None:
    with pytest.raises(
        ValueError, match=f"device '{device}' requested but this PyTorch build .* no CUDA"
    ):
        LLM("hash", device=device)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu"])
def test_unknown_device_is_a_value_error_naming_device(device: str) -> None:
    with pytest.raises(ValueError, match=f"device must be .*got '{device}'"):
        EngineArgs(model="hash", device=device)


@pytest.mark.parametrize("max_model_len", [0, 1, -5])
def test_max_model_len_below_two_is_a_value_error_not_the_model_limit(max_model_len: int) -> None:
    with pytest.raises(ValueError, match=f"max_model_len must be >= 2, got {max_model_len}"):
        LLM("hash", max_model_len=max_model_len)


# ------------------------------------------------------------------------------------------------ generate
@pytest.fixture(scope="module")
def hash_llm() -> LLM:
    return LLM("hash", max_model_len=64, num_kv_blocks=32, block_size=4)


@pytest.fixture(scope="module")
def text_llm() -> LLM:
    """The built-in default model (it has a tokenizer and a ChatML chat template)."""
    return LLM(max_num_seqs=2, max_model_len=128)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (123, "prompts must be a string, .* got int 123"),
        (None, "prompts must be a string, .* got NoneType None"),
        (b"bytes", "prompts must be a string, .* got bytes"),
        (
            [1, 2, 3],
            r"prompts is a list of ints \(\[1, 2, 3\]\): pass token ids as \{'prompt_token_ids'",
        ),
        ([{"prompt_token_ids": [1]}, [4, 5]], r"prompts\[1\] must be .*pass token ids as"),
        (["fine", 7], r"prompts\[1\] must be a string .* got int 7"),
    ],
)
def test_generate_rejects_what_is_not_a_prompt_batch(
    hash_llm: LLM, prompts: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        hash_llm.generate(prompts, use_tqdm=False)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sampling_params", "message"),
    [
        ({"max_tokens": 4}, "sampling_params must be SamplingParams .*got dict"),
        ("greedy", "sampling_params must be SamplingParams .*got str"),
        (
            [SamplingParams(), {"max_tokens": 4}],
            r"sampling_params\[1\] must be SamplingParams, got dict",
        ),
    ],
)
def test_generate_names_the_wrong_sampling_params_type(
    hash_llm: LLM, sampling_params: object, message: str
) -> None:
    prompts = [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    with pytest.raises(ValueError, match=message):
        hash_llm.generate(prompts, sampling_params, use_tqdm=False)  # type: ignore[arg-type]


def test_a_list_of_token_id_prompts_still_generates(hash_llm: LLM) -> None:
    outputs = hash_llm.generate(
        ({"prompt_token_ids": [i, i + 1]} for i in range(1, 4)),  # any iterable of prompts
        SamplingParams(max_tokens=2),
        use_tqdm=False,
    )
    assert [output.prompt_token_ids for output in outputs] == [[1, 2], [2, 3], [3, 4]]


# ------------------------------------------------------------------------------------------------ parameters
def test_logprobs_above_max_logprobs_names_logprobs_and_the_cap(text_llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"logprobs=21 .*max_logprobs=20"):
        text_llm.generate("Hi", SamplingParams(logprobs=21), use_tqdm=False)
    [output] = text_llm.generate("Hi", SamplingParams(logprobs=20, max_tokens=1), use_tqdm=False)
    assert output.outputs[0].logprobs is not None and len(output.outputs[0].logprobs[0]) >= 20


def test_max_logprobs_is_an_engine_option() -> None:
    llm = LLM("hash", max_model_len=64, num_kv_blocks=32, block_size=4, max_logprobs=2)
    with pytest.raises(ValueError, match=r"logprobs=3 .*max_logprobs=2"):
        llm.generate({"prompt_token_ids": [1]}, SamplingParams(logprobs=3), use_tqdm=False)


def test_async_logprobs_above_the_cap_is_a_value_error() -> None:
    async def first_output() -> None:
        engine = AsyncLLM("hash", max_model_len=64, num_kv_blocks=32, block_size=4)
        try:
            async for _ in engine.generate({"prompt_token_ids": [1]}, SamplingParams(logprobs=50)):
                pass
        finally:
            engine.shutdown()

    with pytest.raises(ValueError, match="max_logprobs=20"):
        asyncio.run(first_output())


def test_stop_token_ids_outside_the_vocabulary_names_stop_token_ids(hash_llm: LLM) -> None:
    params = SamplingParams(stop_token_ids=[5, hash_llm.vocab_size])
    with pytest.raises(ValueError, match=rf"stop_token_ids holds \[{hash_llm.vocab_size}\]"):
        hash_llm.generate({"prompt_token_ids": [1]}, params, use_tqdm=False)


# ------------------------------------------------------------------------------------------------ chat
@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": None}], r"messages\[0\] \(role 'user'\) has no content"),
        (
            [{"role": "system", "content": "Be brief."}, {"role": "user"}],
            r"messages\[1\] \(role 'user'\) has no content",
        ),
        ([{"role": "user", "content": 5}], r"messages\[0\] .*content must be a string or a list"),
        (
            [{"role": "user", "content": [{"text": "x"}]}],
            r"content\[0\] must be a dict with a 'type'",
        ),
        ([{"role": None, "content": "x"}], r"messages\[0\] needs a 'role' string"),
    ],
)
def test_chat_message_without_usable_content_names_its_index(
    text_llm: LLM, messages: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        text_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)


def test_assistant_tool_call_without_content_renders_only_the_call(text_llm: LLM) -> None:
    tokenizer = text_llm.get_tokenizer()
    assert tokenizer is not None
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w"}}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call><|im_end|>\n'
    )
    assert "None" not in text
    assert messages[1]["content"] is None  # the caller's messages are not changed
