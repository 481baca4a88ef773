"""kvflow's Mixtral against transformers (float32) on a tiny random checkpoint made with `MixtralForCausalLM`.

The checkpoint: 2 layers, 4 experts, top-2 routing, a sliding window of 16 on every layer, router weights scaled
up so routing is decided by clear margins and differs between tokens (checked here). Everything runs through the
real paged layout (`paged_model_driver`): chunked prefill, batched decodes mixed with prefill chunks, prefix blocks
shared between requests; then through `LLM` (sync and async scheduling, both runner protocols). `FusedMoE` itself:
a token's output is the same alone as in any batch, and the checkpoint's per-expert tensors load into the stacked
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_model_driver import PagedDriver

from kvflow.distributed import TensorParallelGroup
from kvflow.models.fused_decode import FusedDecodeLayers
from kvflow.models.hf_config import load_hf_config, parse_hf_config
from kvflow.models.layers.fused_moe import FusedMoE, softmax_topk
from kvflow.models.loader import load_model
from kvflow.models.mixtral import MixtralForCausalLM
from kvflow.testing.hf_checkpoints import hf_greedy, hf_logits, load_hf_model

VOCAB_SIZE = 384
SLIDING_WINDOW = 16
NUM_EXPERTS = 4
TOP_K = 2


def make_mixtral_checkpoint(path: Path, *, seed: int = 7) -> Path:
    """A tiny float32 Mixtral checkpoint: norms perturbed, router weights x4, final norm x4."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.08,
        sliding_window=SLIDING_WINDOW,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * 0.2)
                if "gate.weight" in name:
                    param.mul_(4.0)
            model.model.norm.weight.mul_(4.0)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(path, safe_serialization=True)
    return path


@dataclass
class Checkpoint:
    """The checkpoint and its transformers model; greedy references are computed once."""

    path: Path
    reference: Any
    _greedy: dict[tuple[tuple[int, ...], int], list[int]] = field(default_factory=dict)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._greedy:
            self._greedy[key] = hf_greedy(self.path, prompt, max_new_tokens, self.reference)
        return self._greedy[key]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return hf_logits(self.path, token_ids, self.reference)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_mixtral_checkpoint(tmp_path_factory.mktemp("mixtral"))
    return Checkpoint(path, load_hf_model(path))


@pytest.fixture(scope="module")
def model(checkpoint: Checkpoint) -> MixtralForCausalLM:
    loaded = load_model(checkpoint.path, attention_backend="torch")
    assert isinstance(loaded, MixtralForCausalLM)
    return loaded


def _prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()


def _assert_argmax_equal(logits: torch.Tensor, reference: torch.Tensor) -> None:
    """Teacher-forced argmax equal at every position, and the logits themselves within float32 rounding."""
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def test_config_parsing() -> None:
    """MixtralConfig's defaults for the expert keys; the sliding window applies to every layer."""
    raw = {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    }
    config = parse_hf_config(raw)
    assert (config.num_experts, config.num_experts_per_tok, config.sliding_window) == (8, 2, None)
    config = parse_hf_config(
        {**raw, "num_local_experts": 4, "num_experts_per_tok": 1, "sliding_window": 4096}
    )
    assert (config.num_experts, config.num_experts_per_tok) == (4, 1)
    assert [config.layer_sliding_window(i) for i in range(2)] == [4096, 4096]


def test_weights_load_into_stacked_experts(
    checkpoint: Checkpoint, model: MixtralForCausalLM
) -> None:
    """Each expert's w1 / w3 / w2 sits in its slice of the stacked parameters; the router is the gate."""
    hf_layer = checkpoint.reference.model.layers[1].mlp
    moe = model.model.layers[1].mlp
    assert isinstance(moe, FusedMoE)
    assert torch.equal(moe.gate.weight, hf_layer.gate.weight)
    assert torch.equal(moe.w13_weight, hf_layer.experts.gate_up_proj)
    assert torch.equal(moe.w2_weight, hf_layer.experts.down_proj)


def test_missing_expert_is_reported(checkpoint: Checkpoint, tmp_path: Path) -> None:
    from kvflow.models.loader import iterate_safetensors_weights

    model = MixtralForCausalLM(load_hf_config(checkpoint.path), dtype=torch.float32)
    weights = [
        (name, tensor)
        for name, tensor in iterate_safetensors_weights(checkpoint.path)
        if "experts.3.w3" not in name
    ]
    with pytest.raises(ValueError, match=r"w13_weight\[3, 1\]"):
        model.load_weights(weights)


def test_routing_varies_and_fused_decode_declines(
    checkpoint: Checkpoint, model: MixtralForCausalLM
) -> None:
    """Tokens of one prompt pick different expert pairs (the comparisons below exercise the grouping); the Llama
    fused decode path declines a model with experts."""
    embeddings = checkpoint.reference.model.embed_tokens.weight[_prompt(1, 40)]
    _, ids = softmax_topk(embeddings @ model.model.layers[0].mlp.gate.weight.T, TOP_K)
    assert len({tuple(sorted(row)) for row in ids.tolist()}) >= 4
    config = model.config
    for dtype in (torch.float32, torch.bfloat16):
        assert (
            FusedDecodeLayers.select(
                config,
                list(model.model.layers),
                model.layer_windows,
                model.attention_backend,
                dtype=dtype,
                device=torch.device("cpu"),
                tp=TensorParallelGroup.single(),
            )
            is None
        )


def test_tensor_parallel_is_refused(checkpoint: Checkpoint) -> None:
    config = load_hf_config(checkpoint.path)
    with pytest.raises(ValueError, match="tensor parallelism"):
        FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            dtype=torch.float32,
            device=torch.device("cpu"),
            tp=TensorParallelGroup(rank=0, size=2),
        )


def test_moe_token_alone_equals_token_in_batch(model: MixtralForCausalLM) -> None:
    """Each token's MoE output alone and in batches of 2..64 tokens: the same experts and weights, and outputs
    within 1e-5 (not bitwise: each expert's product runs over its tokens as one matrix product, and the BLAS
    library's float32 product of a row differs in the last bits with the number of rows (measured up to ~1e-5
    here, as `F.linear` alone does); a bitwise batch-invariant product is the C++ kernel's job)."""
    moe = model.model.layers[0].mlp
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randn(64, 64, generator=generator)
    alone = torch.cat([moe(tokens[i : i + 1]) for i in range(64)])
    ids_alone = torch.cat(
        [softmax_topk(moe.gate.weight @ tokens[i], TOP_K)[1][None] for i in range(64)]
    )
    for size in (2, 7, 16, 64):
        batched = torch.cat([moe(chunk) for chunk in tokens.split(size)])
        ids = torch.cat(
            [softmax_topk(chunk @ moe.gate.weight.T, TOP_K)[1] for chunk in tokens.split(size)]
        )
        assert torch.equal(ids.sort(-1).values, ids_alone.sort(-1).values), size
        torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5, msg=str(size))


def test_moe_matches_transformers_block(checkpoint: Checkpoint, model: MixtralForCausalLM) -> None:
    hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        reference = checkpoint.reference.model.layers[0].mlp(hidden[None])[0]
    assert torch.equal(model.model.layers[0].mlp(hidden), reference)


def test_prompt_logits_one_shot(model: MixtralForCausalLM, checkpoint: Checkpoint) -> None:
    prompt = _prompt(1, 37)
    driver = PagedDriver(model, block_size=4, seed=1)
    driver.add_request("a", prompt)
    _assert_argmax_equal(driver.prompt_logits("a", [37]), checkpoint.logits(prompt))


def test_prompt_logits_chunked(model: MixtralForCausalLM, checkpoint: Checkpoint) -> None:
    """Chunks continue the cached KV; edges inside and on block boundaries and past the sliding window."""
    prompt = _prompt(2, 45)
    driver = PagedDriver(model, block_size=16, seed=2)
    driver.add_request("a", prompt)
    logits = driver.prompt_logits("a", [7, 1, 8, 13, 16])
    _assert_argmax_equal(logits, checkpoint.logits(prompt))


def test_prompt_logits_with_shared_prefix_blocks(
    model: MixtralForCausalLM, checkpoint: Checkpoint
) -> None:
    """Request b starts on request a's first 5 blocks (a prefix-cache hit) and computes only its own tail."""
    prompt_a = _prompt(3, 30)
    prompt_b = prompt_a[:20] + _prompt(4, 11)
    driver = PagedDriver(model, block_size=4, seed=3)
    driver.add_request("a", prompt_a)
    driver.prompt_logits("a", [30])
    driver.add_request("b", prompt_b, share_prefix_from="a", num_shared_blocks=5)
    logits = driver.prompt_logits("b", [11])
    _assert_argmax_equal(logits, checkpoint.logits(prompt_b)[20:])


def test_greedy_batch_with_mixed_steps(model: MixtralForCausalLM, checkpoint: Checkpoint) -> None:
    """Prompts arrive at different steps and prefill in chunks of 6 while earlier requests decode."""
    prompts = {"a": _prompt(6, 9), "b": _prompt(7, 23), "c": _prompt(8, 3), "d": _prompt(9, 31)}
    driver = PagedDriver(model, block_size=4, seed=6)
    outputs = driver.generate(
        prompts, max_new_tokens=16, chunk_size=6, arrival_steps={"c": 2, "d": 4}
    )
    assert any(lens.count(1) >= 2 and max(lens) > 1 for lens in driver.step_query_lens)
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == checkpoint.greedy(prompt, 16), req_id


def test_greedy_with_shared_prefix(model: MixtralForCausalLM, checkpoint: Checkpoint) -> None:
    """b reuses a's first three full blocks (prompt tokens only) and decodes alongside a."""
    prompt_a = _prompt(10, 17)
    prompt_b = prompt_a[:12] + _prompt(11, 6)
    driver = PagedDriver(model, block_size=4, seed=7)
    driver.generate({"a": prompt_a}, max_new_tokens=1)
    driver.add_request("b", prompt_b, share_prefix_from="a", num_shared_blocks=3)
    outputs = driver.generate({"a": prompt_a, "b": prompt_b}, max_new_tokens=14)
    assert driver.step_query_lens[1] == [1, 6]
    assert outputs["b"] == checkpoint.greedy(prompt_b, 14)
    assert outputs["a"] == checkpoint.greedy(prompt_a, 14)


@pytest.mark.parametrize(
    ("use_v2_model_runner", "async_scheduling"), [(True, False), (True, True), (False, False)]
)
def test_llm_generates_transformers_greedy(
    checkpoint: Checkpoint, use_v2_model_runner: bool, async_scheduling: bool
) -> None:
    """`LLM` on the checkpoint: batched, chunked prefill (8 tokens a step) and a prefix-cache hit (the third
    prompt repeats the first's 16-token prefix), token for token transformers' greedy output."""
    from kvflow import LLM, SamplingParams

    first = _prompt(20, 21)
    prompts = [first, _prompt(21, 5), first[:16] + _prompt(22, 7)]
    llm = LLM(
        str(checkpoint.path),
        skip_tokenizer_init=True,
        disable_log_stats=True,
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        use_v2_model_runner=use_v2_model_runner,
        async_scheduling=async_scheduling,
    )
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)  # fills the cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    cached = [output.metrics.num_cached_tokens if output.metrics else None for output in outputs]
    assert cached[0] == 20 and cached[2] == 16, cached
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == checkpoint.greedy(prompt, 12)
