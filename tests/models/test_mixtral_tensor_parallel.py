"""Mixtral with tensor parallelism: 2 ranks (the `mp` executor, gloo on CPU) against one rank and transformers.

`FusedMoE` splits every expert's intermediate dimension (96 -> 48 per rank: rows of `w1` and `w3`, columns of
`w2`), keeps the router whole on every rank and all-reduces the layer's output once. The tiny float32 checkpoint
of tests/models/test_mixtral_vs_hf.py (4 experts, top-2, routing decided by clear margins); prompts longer than
the step budget (chunked prefill) and several requests at once (batched decode). Greedy tokens must equal one
rank's and transformers' exactly; each rank holds its half of every expert and the whole router.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_mixtral_vs_hf import NUM_EXPERTS, make_mixtral_checkpoint

from kvflow import LLM, SamplingParams
from kvflow.testing.hf_checkpoints import hf_greedy, load_hf_model
from kvflow.testing.tensor_parallel import parameter_shapes

MAX_TOKENS = 10
HIDDEN, INTERMEDIATE = 64, 96
ENGINE_OPTIONS = {
    "dtype": "float32",
    "skip_tokenizer_init": True,
    "max_model_len": 96,
    "block_size": 4,
    "max_num_batched_tokens": 32,  # the 40-token prompt is chunked
    "max_num_seqs": 4,
}


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mixtral_checkpoint(tmp_path_factory.mktemp("mixtral_tp"))


def test_two_ranks_greedy_tokens_equal_one_rank_and_transformers(checkpoint: Path) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 380) for _ in range(length)] for length in (3, 40, 17, 9)]
    hf_model = load_hf_model(checkpoint)
    expected = [hf_greedy(checkpoint, prompt, MAX_TOKENS, hf_model) for prompt in prompts]
    one_rank = LLM(str(checkpoint), **ENGINE_OPTIONS)
    try:
        one_rank_outputs = _run(one_rank, prompts)
    finally:
        one_rank.shutdown()
    two_ranks = LLM(
        str(checkpoint),
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        **ENGINE_OPTIONS,
    )
    try:
        outputs = _run(two_ranks, prompts)
        rank_shapes = two_ranks.collective_rpc(parameter_shapes)
    finally:
        two_ranks.shutdown()
    assert one_rank_outputs == expected
    assert outputs == expected
    assert len(rank_shapes) == 2
    local = INTERMEDIATE // 2
    for shapes in rank_shapes:
        assert shapes["model.layers.0.mlp.gate.weight"] == (NUM_EXPERTS, HIDDEN)
        assert shapes["model.layers.0.mlp.w13_weight"] == (NUM_EXPERTS, 2 * local, HIDDEN)
        assert shapes["model.layers.0.mlp.w2_weight"] == (NUM_EXPERTS, HIDDEN, local)
