"""Tensor parallelism on CPU (gloo, the `mp` executor) against one rank and against transformers.

Two tiny float32 checkpoints: a Qwen2 (q/k/v biases, tied embeddings) whose 4 query and 2 KV heads divide over 2
ranks, and a Llama with 2 KV heads run on 4 ranks (fewer KV heads than ranks: each KV head is replicated on 2
ranks). Each engine is built once per module and runs one workload that mixes everything the scheduler does: more
requests than slots (admissions mid-decode), prompts longer than the step budget (chunked prefill), shared prefixes
(prefix-cache hits) and a KV cache too small for all of them (preemption and recompute). The same workload on one
rank gives the reference: the logits of every step must match it within float32 tolerance (only the order of
the all-reduced sums differs), and greedy tokens must equal it and transformers exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.testing.hf_checkpoints import hf_greedy, load_hf_model, make_tiny_checkpoint
from kvflow.testing.tensor_parallel import parameter_shapes, record_logits, take_logits

# Logits are float32 with std ~6; summing a row-parallel product over ranks instead of in one matmul moves them by
# a few ulps of the largest partial sums.
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-4
MAX_TOKENS = 12
ENGINE_OPTIONS = {
    "dtype": "float32",
    "skip_tokenizer_init": True,
    "max_model_len": 96,
    "block_size": 4,
    "num_kv_blocks": 24,  # 96 tokens for 4 slots of up to 52: requests are preempted
    "max_num_batched_tokens": 32,  # prompts over 32 tokens are chunked
    "max_num_seqs": 4,
}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(24)]
    lengths = [3, 40, 17, 9, 36, 25]
    fresh = [[rng.randrange(3, 300) for _ in range(length)] for length in lengths]
    with_prefix = [
        shared + [rng.randrange(3, 300) for _ in range(rng.randint(1, 8))] for _ in range(3)
    ]
    return fresh + with_prefix


@dataclass
class Case:
    """One checkpoint run at `tp_size` ranks and at one rank, with transformers' greedy tokens."""

    path: Path
    tp_size: int
    num_kv_heads: int
    llm: LLM
    expected: list[list[int]]
    outputs: list[list[int]]
    logits: list[list[torch.Tensor]]  # per rank, per step
    reference_outputs: list[list[int]]
    reference_logits: list[torch.Tensor]
    num_preemptions: int
    prefix_hit_rate: float


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _workload(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Mixed batch first (chunking, admissions, preemption), then the shared-prefix prompts one by one (hits)."""
    outputs = _run(llm, prompts[:6])
    for prompt in prompts[6:]:
        outputs += _run(llm, [prompt])
    return outputs


def _case(
    tmp_path: Path, architecture: str, tp_size: int, num_kv_heads: int, async_scheduling: bool
) -> Case:
    path = make_tiny_checkpoint(
        tmp_path, architecture, seed=3, num_attention_heads=4, num_key_value_heads=num_kv_heads
    )
    prompts = _prompts(seed=tp_size)
    hf_model = load_hf_model(path)
    expected = [hf_greedy(path, prompt, MAX_TOKENS, hf_model) for prompt in prompts]
    options = {**ENGINE_OPTIONS, "async_scheduling": async_scheduling}
    reference = LLM(str(path), **options)
    reference.collective_rpc(record_logits)
    reference_outputs = _workload(reference, prompts)
    [reference_logits] = reference.collective_rpc(take_logits)
    reference.shutdown()
    llm = LLM(str(path), tensor_parallel_size=tp_size, **options)
    llm.collective_rpc(record_logits)
    outputs = _workload(llm, prompts)
    return Case(
        path,
        tp_size,
        num_kv_heads,
        llm,
        expected,
        outputs,
        llm.collective_rpc(take_logits),
        reference_outputs,
        reference_logits,
        llm.scheduler_stats()[0].num_preemptions_total,
        llm.prefix_cache_hit_rate,
    )


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory):
    """Qwen2, 4 heads / 2 KV heads on 2 ranks, async scheduling."""
    case = _case(tmp_path_factory.mktemp("qwen2"), "qwen2", 2, 2, async_scheduling=True)
    yield case
    case.llm.shutdown()


@pytest.fixture(scope="module")
def tp4(tmp_path_factory: pytest.TempPathFactory):
    """Llama, 4 heads / 2 KV heads on 4 ranks (each KV head on 2 ranks), synchronous scheduling."""
    case = _case(tmp_path_factory.mktemp("llama"), "llama", 4, 2, async_scheduling=False)
    yield case
    case.llm.shutdown()


@pytest.fixture(params=["tp2", "tp4"])
def case(request: pytest.FixtureRequest) -> Case:
    return request.getfixturevalue(request.param)


def test_the_workload_preempts_chunks_and_hits_the_prefix_cache(case: Case) -> None:
    assert case.num_preemptions > 0
    assert case.prefix_hit_rate > 0.2


def test_greedy_tokens_equal_one_rank_and_transformers(case: Case) -> None:
    assert case.reference_outputs == case.expected
    assert case.outputs == case.expected


def test_every_step_logits_match_one_rank(case: Case) -> None:
    """Every rank returns the whole vocabulary's logits (gathered), equal on all ranks, and within float32
    tolerance of one rank's at every step."""
    first_rank = case.logits[0]
    assert len(first_rank) == len(case.reference_logits) > 20
    for rank_logits in case.logits[1:]:
        for step, (mine, rank0) in enumerate(zip(rank_logits, first_rank, strict=True)):
            assert torch.equal(mine, rank0), f"step {step}: ranks disagree"
    for step, (mine, reference) in enumerate(zip(first_rank, case.reference_logits, strict=True)):
        assert mine.shape == reference.shape == (reference.shape[0], 384), step
        torch.testing.assert_close(mine, reference, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_each_rank_holds_its_share_of_kv_heads_and_weights(case: Case) -> None:
    infos = case.llm.collective_rpc("rank_info")
    assert [info["rank"] for info in infos] == list(range(case.tp_size))
    assert len({info["pid"] for info in infos}) == case.tp_size
    kv_heads_per_rank = max(1, case.num_kv_heads // case.tp_size)
    for info in infos:
        # torch backend: [layers, K/V, kv_heads, blocks, block_size, head_dim]
        assert info["kv_cache_shape"] == [2, 2, kv_heads_per_rank, 24, 4, 16]
    head_dim, hidden, heads = 16, 64, 4
    for shapes in case.llm.collective_rpc(parameter_shapes):
        q_rows = heads // case.tp_size * head_dim
        kv_rows = kv_heads_per_rank * head_dim
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (q_rows + 2 * kv_rows, hidden)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (hidden, q_rows)
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 128 // case.tp_size, hidden)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (hidden, 128 // case.tp_size)
        assert shapes["model.embed_tokens.weight"] == (384 // case.tp_size, hidden)
        assert shapes["model.norm.weight"] == (hidden,)


def test_update_weights_reloads_every_ranks_shards(tp2: Case) -> None:
    """Reloading the checkpoint folder (each rank reads its shards again) keeps the outputs."""
    tp2.llm.pause_generation()
    tp2.llm.update_weights(str(tp2.path))
    tp2.llm.resume_generation()
    prompts = _prompts(seed=2)[:2]
    assert _run(tp2.llm, prompts) == tp2.expected[:2]
