"""End to end on the hash model: a request whose last allowed token is a stop token finishes "stop" (vLLM)."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.testing.hash_model import reference_tokens

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 6


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_token_as_max_tokens_th_token_finishes_stop(async_scheduling: bool) -> None:
    expected = reference_tokens(PROMPT, MAX_TOKENS)
    last = expected[-1]
    assert last not in expected[:-1], "pick a prompt whose last reference token is new"
    llm = LLM(
        "hash", max_model_len=64, num_kv_blocks=32, block_size=4, async_scheduling=async_scheduling
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[last])
    [output] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.token_ids == expected
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == last
    # The same request without the stop token ran out of tokens: "length".
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    [control] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    assert control.outputs[0].token_ids == expected
    assert control.outputs[0].finish_reason == "length"
