"""kvflow's Qwen2-MoE against transformers (float32) on a tiny random checkpoint made with `Qwen2MoeForCausalLM`.

The checkpoint: 3 layers, the middle one dense (`mlp_only_layers`), the others 4 experts with top-2 routing not
renormalised (`norm_topk_prob` false) plus the shared expert and its sigmoid gate; q/k/v bias; a sliding window of
16 on the first layer (`use_sliding_window`, `max_window_layers` 2). Router and shared-expert-gate weights are
scaled up so routing is decided by clear margins and differs between tokens (checked here), and the gate is not
near 0.5 everywhere. Everything runs through the real paged layout (`paged_model_driver`) and `LLM`
(`family_suite`); the shared expert, its gate and the dense layer load as transformers holds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from family_suite import Checkpoint, FamilySuite, random_prompt, save_random_checkpoint

from kvflow import LLM, SamplingParams
from kvflow.distributed import TensorParallelGroup
from kvflow.models.fused_decode import FusedDecodeLayers
from kvflow.models.hf_config import SLIDING_ATTENTION, load_hf_config, parse_hf_config
from kvflow.models.layers.fused_moe import softmax_topk
from kvflow.models.layers.mlp import GatedMLP
from kvflow.models.loader import iterate_safetensors_weights, load_model
from kvflow.models.qwen_moe import Qwen2MoeForCausalLM, SharedExpertMoE
from kvflow.testing.hf_checkpoints import hf_greedy, load_hf_model
from kvflow.testing.tensor_parallel import parameter_shapes

VOCAB_SIZE = 384
NUM_EXPERTS = 4
TOP_K = 2
SLIDING_WINDOW = 16
MAX_TOKENS = 10
TP_ENGINE_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "skip_tokenizer_init": True,
    "max_model_len": 96,
    "block_size": 4,
    "max_num_batched_tokens": 32,  # the 40-token prompt is chunked
    "max_num_seqs": 4,
}
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}


def make_qwen2_moe_checkpoint(path: Path, *, seed: int = 11) -> Path:
    """A tiny float32 Qwen2-MoE checkpoint: norms and biases perturbed, router and shared-expert-gate weights x4,
    final norm x4."""
    import transformers

    config = transformers.Qwen2MoeConfig(
        **SHAPE,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
        max_window_layers=2,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return save_random_checkpoint(
        path,
        lambda: transformers.AutoModelForCausalLM.from_config(config),
        seed=seed,
        scaled=lambda name: name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")),
        perturbed=lambda name: "norm" in name or name.endswith("bias"),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_qwen2_moe_checkpoint(tmp_path_factory.mktemp("qwen2_moe"))
    return Checkpoint(path, load_hf_model(path))


@pytest.fixture(scope="module")
def model(checkpoint: Checkpoint) -> Qwen2MoeForCausalLM:
    loaded = load_model(checkpoint.path, attention_backend="torch")
    assert isinstance(loaded, Qwen2MoeForCausalLM)
    return loaded


def _raw(**overrides: Any) -> dict[str, Any]:
    return {"architectures": ["Qwen2MoeForCausalLM"], **SHAPE, **overrides}


def test_config_parsing() -> None:
    """Qwen2MoeConfig's defaults for omitted keys; the sliding window only with `use_sliding_window`, on every other
    layer below `max_window_layers` unless `layer_types` says otherwise; q/k/v bias unless `qkv_bias` is false."""
    bare = {key: SHAPE[key] for key in ("vocab_size", "hidden_size", "intermediate_size")}
    config = parse_hf_config(
        {
            "architectures": ["Qwen2MoeForCausalLM"],
            **bare,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "sliding_window": 8,
        }
    )
    assert (config.num_experts, config.num_experts_per_tok) == (60, 4)
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (1408, 5632)
    assert (config.norm_topk_prob, config.decoder_sparse_step, config.mlp_only_layers) == (
        False,
        1,
        (),
    )
    assert (config.attention_bias, config.o_proj_bias, config.sliding_window) == (True, False, None)
    config = parse_hf_config(
        _raw(
            num_hidden_layers=5,
            use_sliding_window=True,
            max_window_layers=4,
            norm_topk_prob=True,
            qkv_bias=False,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        )
    )
    assert config.sliding_window == 4096
    assert [config.layer_sliding_window(i) for i in range(5)] == [4096, None, 4096, None, None]
    assert config.norm_topk_prob and not config.attention_bias
    assert [config.layer_has_experts(i) for i in range(5)] == [False, True, False, False, False]
    config = parse_hf_config(
        _raw(use_sliding_window=True, sliding_window=8, layer_types=["full_attention"] * 3)
    )
    assert config.sliding_window is None


@pytest.mark.parametrize(
    ("decoder_sparse_step", "mlp_only_layers"), [(1, [1]), (2, []), (2, [3]), (3, [0, 2])]
)
def test_layers_with_experts_match_transformers(
    decoder_sparse_step: int, mlp_only_layers: list[int]
) -> None:
    """Which layers hold experts (`decoder_sparse_step`, `mlp_only_layers`): the same as transformers builds."""
    import transformers

    settings = {"num_hidden_layers": 4, "decoder_sparse_step": decoder_sparse_step}
    hf_config = transformers.Qwen2MoeConfig(
        **{**SHAPE, **settings}, mlp_only_layers=mlp_only_layers
    )
    reference = transformers.AutoModelForCausalLM.from_config(hf_config)
    config = parse_hf_config(_raw(**settings, mlp_only_layers=mlp_only_layers))
    ours = Qwen2MoeForCausalLM(config, dtype=torch.float32)
    expected = [
        type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in reference.model.layers
    ]
    assert [isinstance(layer.mlp, SharedExpertMoE) for layer in ours.model.layers] == expected
    assert [isinstance(layer.mlp, GatedMLP) for layer in ours.model.layers] == [
        not has_experts for has_experts in expected
    ]


def test_shared_expert_and_dense_layer_load(
    checkpoint: Checkpoint, model: Qwen2MoeForCausalLM
) -> None:
    """The router, the stacked experts, the shared expert (gate/up fused, gate rows first), its gate and the dense
    layer's MLP hold transformers' tensors."""
    reference = checkpoint.reference.model.layers
    moe = model.model.layers[2].mlp
    hf_moe = reference[2].mlp
    assert isinstance(moe, SharedExpertMoE)
    assert torch.equal(moe.gate.weight, hf_moe.gate.weight)
    assert torch.equal(moe.w13_weight, hf_moe.experts.gate_up_proj)
    assert torch.equal(moe.w2_weight, hf_moe.experts.down_proj)
    shared = hf_moe.shared_expert
    assert torch.equal(
        moe.shared_expert.gate_up_proj.weight,
        torch.cat([shared.gate_proj.weight, shared.up_proj.weight]),
    )
    assert torch.equal(moe.shared_expert.down_proj.weight, shared.down_proj.weight)
    assert torch.equal(moe.shared_expert_gate.weight, hf_moe.shared_expert_gate.weight)
    dense = model.model.layers[1].mlp
    hf_dense = reference[1].mlp
    assert isinstance(dense, GatedMLP)
    assert torch.equal(
        dense.gate_up_proj.weight, torch.cat([hf_dense.gate_proj.weight, hf_dense.up_proj.weight])
    )
    assert torch.equal(dense.down_proj.weight, hf_dense.down_proj.weight)
    assert torch.equal(
        model.model.layers[0].self_attn.qkv_proj.bias[:64], reference[0].self_attn.q_proj.bias
    )


def test_missing_shared_expert_gate_is_reported(checkpoint: Checkpoint) -> None:
    model = Qwen2MoeForCausalLM(load_hf_config(checkpoint.path), dtype=torch.float32)
    weights = [
        (name, tensor)
        for name, tensor in iterate_safetensors_weights(checkpoint.path)
        if name != "model.layers.2.mlp.shared_expert_gate.weight"
    ]
    with pytest.raises(
        ValueError, match=r"missing parameters: .*layers\.2\.mlp\.shared_expert_gate"
    ):
        model.load_weights(weights)


def test_expert_in_dense_layer_is_unexpected(checkpoint: Checkpoint) -> None:
    """A checkpoint whose dense layer has experts does not fit the config: named as unexpected."""
    model = Qwen2MoeForCausalLM(load_hf_config(checkpoint.path), dtype=torch.float32)
    weights = list(iterate_safetensors_weights(checkpoint.path))
    extra = next(tensor for name, tensor in weights if name.endswith("experts.0.up_proj.weight"))
    weights.append(("model.layers.1.mlp.experts.0.up_proj.weight", extra))
    with pytest.raises(ValueError, match=r"unexpected parameters: model\.layers\.1\.mlp\.experts"):
        model.load_weights(weights)


def test_routing_varies_and_fused_decode_declines(
    checkpoint: Checkpoint, model: Qwen2MoeForCausalLM
) -> None:
    """Tokens of one prompt pick different expert pairs; the Llama fused decode path declines a model with
    experts."""
    embeddings = checkpoint.reference.model.embed_tokens.weight[random_prompt(1, 40, VOCAB_SIZE)]
    router = model.model.layers[0].mlp.gate.weight
    weights, ids = softmax_topk(embeddings @ router.T, TOP_K, renormalize=False)
    assert len({tuple(sorted(row)) for row in ids.tolist()}) >= 4
    assert (weights.sum(-1) < 0.999).any()  # not renormalised
    assert model.config.layer_types[0] == SLIDING_ATTENTION
    for dtype in (torch.float32, torch.bfloat16):
        assert (
            FusedDecodeLayers.select(
                model.config,
                list(model.model.layers),
                model.layer_windows,
                model.attention_backend,
                dtype=dtype,
                device=torch.device("cpu"),
                tp=TensorParallelGroup.single(),
            )
            is None
        )


def test_moe_block_matches_transformers(checkpoint: Checkpoint, model: Qwen2MoeForCausalLM) -> None:
    """The whole block (routed experts + gated shared expert) against transformers' `Qwen2MoeSparseMoeBlock`, to
    float32 rounding (the experts may run in the C++ kernel, whose sums are not torch's)."""
    hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        reference = checkpoint.reference.model.layers[0].mlp(hidden[None])[0]
    torch.testing.assert_close(model.model.layers[0].mlp(hidden), reference, atol=1e-5, rtol=1e-5)


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        Qwen2MoeForCausalLM(parse_hf_config(_raw(hidden_act="gelu")), dtype=torch.float32)
    with pytest.raises(ValueError, match="decoder_sparse_step 0"):
        parse_hf_config(_raw(decoder_sparse_step=0))
    with pytest.raises(ValueError, match=r"mlp_only_layers \[3\]"):
        parse_hf_config(_raw(mlp_only_layers=[0, 3]))
    with pytest.raises(ValueError, match="top_k 5"):
        Qwen2MoeForCausalLM(parse_hf_config(_raw(num_experts_per_tok=5)), dtype=torch.float32)


def _rank_model(checkpoint: Checkpoint, rank: int, *, sliced: bool) -> Qwen2MoeForCausalLM:
    """Rank `rank` of 2, loaded from whole checkpoint tensors or from just its parts (`checkpoint_index`)."""
    model = Qwen2MoeForCausalLM(
        load_hf_config(checkpoint.path),
        dtype=torch.float32,
        tp=TensorParallelGroup(rank=rank, size=2),
    )
    select = model.checkpoint_index if sliced else None
    model.load_weights(iterate_safetensors_weights(checkpoint.path, select), sliced=sliced)
    return model


@pytest.mark.parametrize("sliced", [False, True])
def test_tensor_parallel_rank_loads_its_part(checkpoint: Checkpoint, sliced: bool) -> None:
    """Rank 1 of 2 holds the second half of every routed expert's intermediate dimension (rows of gate and up,
    columns of down), the second half of the shared expert's and of the dense layer's (as `GatedMLP`), and the whole
    router and shared-expert gate."""
    model = _rank_model(checkpoint, 1, sliced=sliced)
    moe, hf_moe = model.model.layers[2].mlp, checkpoint.reference.model.layers[2].mlp
    half = SHAPE["moe_intermediate_size"] // 2
    gate_up, down = hf_moe.experts.gate_up_proj, hf_moe.experts.down_proj
    assert torch.equal(moe.gate.weight, hf_moe.gate.weight)
    assert torch.equal(
        moe.w13_weight, torch.cat([gate_up[:, half : 2 * half], gate_up[:, 3 * half :]], dim=1)
    )
    assert torch.equal(moe.w2_weight, down[:, :, half:])
    assert torch.equal(moe.shared_expert_gate.weight, hf_moe.shared_expert_gate.weight)
    half = SHAPE["shared_expert_intermediate_size"] // 2
    shared = hf_moe.shared_expert
    assert torch.equal(
        moe.shared_expert.gate_up_proj.weight,
        torch.cat([shared.gate_proj.weight[half:], shared.up_proj.weight[half:]]),
    )
    assert torch.equal(moe.shared_expert.down_proj.weight, shared.down_proj.weight[:, half:])
    dense, hf_dense = model.model.layers[1].mlp, checkpoint.reference.model.layers[1].mlp
    half = SHAPE["intermediate_size"] // 2
    assert torch.equal(
        dense.gate_up_proj.weight,
        torch.cat([hf_dense.gate_proj.weight[half:], hf_dense.up_proj.weight[half:]]),
    )
    assert torch.equal(dense.down_proj.weight, hf_dense.down_proj.weight[:, half:])


def test_tensor_parallel_partials_sum_to_the_block(
    checkpoint: Checkpoint, model: Qwen2MoeForCausalLM
) -> None:
    """The two ranks' partial outputs (routed experts plus gated shared expert, before the block's one all-reduce)
    add up to the one-rank block's output, to float32 rounding: the replicated sigmoid gate scales each partial
    sum exactly."""
    hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(9))
    partials = [
        _rank_model(checkpoint, rank, sliced=True).model.layers[0].mlp.partial(hidden)
        for rank in (0, 1)
    ]
    torch.testing.assert_close(
        partials[0] + partials[1], model.model.layers[0].mlp(hidden), atol=1e-5, rtol=1e-5
    )


def test_two_ranks_greedy_tokens_equal_transformers(checkpoint: Checkpoint) -> None:
    """`LLM(tensor_parallel_size=2)` with the multiprocess executor (gloo on CPU): chunked prefill (a prompt longer
    than the step budget) and batched decode give transformers' greedy tokens; each rank holds half of every
    expert, of the shared expert and of the dense MLP, and the whole router and gate."""
    prompts = [
        random_prompt(seed, length, VOCAB_SIZE)
        for seed, length in ((1, 3), (2, 40), (3, 17), (4, 9))
    ]
    expected = [
        hf_greedy(checkpoint.path, prompt, MAX_TOKENS, checkpoint.reference) for prompt in prompts
    ]
    llm = LLM(
        str(checkpoint.path),
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        **TP_ENGINE_OPTIONS,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rank_shapes = llm.collective_rpc(parameter_shapes)
    finally:
        llm.shutdown()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert len(rank_shapes) == 2
    moe_local, shared_local = (
        SHAPE["moe_intermediate_size"] // 2,
        SHAPE["shared_expert_intermediate_size"] // 2,
    )
    for shapes in rank_shapes:
        assert shapes["model.layers.0.mlp.gate.weight"] == (NUM_EXPERTS, 64)
        assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 64)
        assert shapes["model.layers.0.mlp.w13_weight"] == (NUM_EXPERTS, 2 * moe_local, 64)
        assert shapes["model.layers.0.mlp.w2_weight"] == (NUM_EXPERTS, 64, moe_local)
        assert shapes["model.layers.0.mlp.shared_expert.gate_up_proj.weight"] == (
            2 * shared_local,
            64,
        )
        assert shapes["model.layers.0.mlp.shared_expert.down_proj.weight"] == (64, shared_local)
        assert shapes["model.layers.1.mlp.down_proj.weight"] == (
            64,
            SHAPE["intermediate_size"] // 2,
        )


class TestQwen2MoeFamily(FamilySuite):
    """The checks every family's comparison with transformers makes (`family_suite`)."""

    vocab_size = VOCAB_SIZE
