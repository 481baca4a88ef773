"""The whole engine on real checkpoints: greedy outputs equal transformers' float32 greedy, token for token.

Each architecture gets a tiny random checkpoint written by transformers itself. The engine must match the reference
however the work is cut: one request alone, mixed batches, prompts longer than the step's token budget (chunked
prefill), shared prefixes (prefix-cache hits), and a KV cache so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from kvflow.testing.hf_checkpoints import hf_greedy, make_tiny_checkpoint

ARCHITECTURES = ["llama", "llama3", "qwen2", "qwen3", "mistral"]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_prompts(
    num_prompts: int, min_len: int, max_len: int, seed: int, vocab: int = 200
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_prompts)
    ]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts], greedy(max_tokens), use_tqdm=False
    )
    return [output.outputs[0].token_ids for output in outputs]


def references(
    checkpoint: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
) -> list[list[int]]:
    return [hf_greedy(checkpoint, prompt, max_tokens) for prompt in prompts]


def test_single_request_and_mixed_batch_match_transformers(checkpoint: Path) -> None:
    prompts = random_prompts(6, 3, 40, seed=1)
    expected = references(checkpoint, prompts)
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=4,
        num_kv_blocks=512,
        max_num_seqs=4,
    )
    assert run(llm, prompts[:1]) == expected[:1]
    assert run(llm, prompts) == expected  # 6 requests through 4 slots: admissions mid-decode


def test_chunked_prefill_and_prefix_hits_match_transformers(checkpoint: Path) -> None:
    shared = random_prompts(1, 50, 50, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 20, seed=3)] + random_prompts(
        1, 90, 90, seed=4
    )
    expected = references(checkpoint, prompts)
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=8,
        num_kv_blocks=256,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    assert run(llm, prompts[:1]) == expected[:1]
    assert run(llm, prompts) == expected
    assert llm.prefix_cache_hit_rate > 0.3  # the later requests reused the shared prefix's blocks


def test_preemption_under_kv_pressure_matches_transformers(checkpoint: Path) -> None:
    prompts = random_prompts(5, 20, 30, seed=5)
    expected = references(checkpoint, prompts, max_tokens=24)
    # 16 blocks of 4 tokens: five requests of ~50 tokens cannot all fit, so some are preempted and recomputed.
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=24,
        max_num_seqs=5,
        enable_prefix_caching=False,
    )
    assert run(llm, prompts, max_tokens=24) == expected
    assert llm.scheduler_stats()[0].num_preemptions_total > 0


@pytest.mark.parametrize("use_v2_model_runner", [True, False])
def test_both_runner_protocols_match_transformers(
    checkpoint: Path, use_v2_model_runner: bool
) -> None:
    prompts = random_prompts(4, 10, 30, seed=6)
    expected = references(checkpoint, prompts, max_tokens=16)
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=28,
        max_num_seqs=4,
        use_v2_model_runner=use_v2_model_runner,
    )
    assert run(llm, prompts, max_tokens=16) == expected
