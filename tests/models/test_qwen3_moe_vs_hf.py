"""kvflow's Qwen3-MoE against transformers (float32) on a tiny random checkpoint made with `Qwen3MoeForCausalLM`.

The checkpoint: 3 layers, the first dense (`mlp_only_layers`), the others 8 experts with top-4 routing renormalised
(`norm_topk_prob`), per-head q/k RMSNorm, no bias, a sliding window of 16 on every layer (`use_sliding_window`).
Router weights are scaled up so routing is decided by clear margins and differs between tokens (checked here).
Everything runs through the real paged layout (`paged_model_driver`) and `LLM` (`family_suite`); the experts and
the dense layer load as transformers holds them.
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
from kvflow.models.hf_config import load_hf_config, parse_hf_config
from kvflow.models.layers.fused_moe import FusedMoE, softmax_topk
from kvflow.models.layers.mlp import GatedMLP
from kvflow.models.loader import iterate_safetensors_weights, load_model
from kvflow.models.qwen_moe import Qwen3MoeForCausalLM, SharedExpertMoE
from kvflow.testing.hf_checkpoints import hf_greedy, load_hf_model
from kvflow.testing.tensor_parallel import parameter_shapes

VOCAB_SIZE = 384
NUM_EXPERTS = 8
TOP_K = 4
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
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}


def make_qwen3_moe_checkpoint(path: Path, *, seed: int = 13) -> Path:
    """A tiny float32 Qwen3-MoE checkpoint: norms (q/k norms too) perturbed, router weights x4, final norm x4."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        **SHAPE,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
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
        scaled=lambda name: name.endswith("mlp.gate.weight"),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_qwen3_moe_checkpoint(tmp_path_factory.mktemp("qwen3_moe"))
    return Checkpoint(path, load_hf_model(path))


@pytest.fixture(scope="module")
def model(checkpoint: Checkpoint) -> Qwen3MoeForCausalLM:
    loaded = load_model(checkpoint.path, attention_backend="torch")
    assert isinstance(loaded, Qwen3MoeForCausalLM)
    return loaded


def _raw(**overrides: Any) -> dict[str, Any]:
    return {"architectures": ["Qwen3MoeForCausalLM"], **SHAPE, **overrides}


def test_config_parsing(checkpoint: Checkpoint) -> None:
    """Qwen3MoeConfig's defaults for omitted keys; the expert count under transformers 4's `num_experts` (Hub
    checkpoints) or transformers 5's `num_local_experts` (what `save_pretrained` writes now); the sliding window
    only with `use_sliding_window`, then on every layer."""
    bare = {key: SHAPE[key] for key in ("vocab_size", "hidden_size", "intermediate_size")}
    config = parse_hf_config(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            **bare,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "sliding_window": 8,
        }
    )
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        128,
        8,
        768,
    )
    assert (config.norm_topk_prob, config.shared_expert_intermediate_size) == (False, 0)
    assert (config.qk_norm, config.attention_bias, config.sliding_window) == (True, False, None)
    config = parse_hf_config(_raw(use_sliding_window=True, sliding_window=8, attention_bias=True))
    assert [config.layer_sliding_window(i) for i in range(3)] == [8, 8, 8]
    assert config.attention_bias and config.o_proj_bias
    renamed = _raw()
    renamed["num_local_experts"] = renamed.pop("num_experts")
    assert parse_hf_config(renamed).num_experts == NUM_EXPERTS
    saved = load_hf_config(checkpoint.path)
    assert (saved.num_experts, saved.norm_topk_prob, saved.mlp_only_layers) == (8, True, (0,))
    assert [saved.layer_has_experts(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize(
    ("decoder_sparse_step", "mlp_only_layers"), [(1, [0]), (2, []), (2, [1]), (4, [])]
)
def test_layers_with_experts_match_transformers(
    decoder_sparse_step: int, mlp_only_layers: list[int]
) -> None:
    """Which layers hold experts (`decoder_sparse_step`, `mlp_only_layers`): the same as transformers builds."""
    import transformers

    settings = {"num_hidden_layers": 4, "decoder_sparse_step": decoder_sparse_step}
    hf_config = transformers.Qwen3MoeConfig(
        **{**SHAPE, **settings}, mlp_only_layers=mlp_only_layers
    )
    reference = transformers.AutoModelForCausalLM.from_config(hf_config)
    config = parse_hf_config(_raw(**settings, mlp_only_layers=mlp_only_layers))
    ours = Qwen3MoeForCausalLM(config, dtype=torch.float32)
    expected = [
        type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in reference.model.layers
    ]
    assert [isinstance(layer.mlp, FusedMoE) for layer in ours.model.layers] == expected
    assert [isinstance(layer.mlp, GatedMLP) for layer in ours.model.layers] == [
        not has_experts for has_experts in expected
    ]
    assert not any(isinstance(layer.mlp, SharedExpertMoE) for layer in ours.model.layers)


def test_experts_and_dense_layer_load(checkpoint: Checkpoint, model: Qwen3MoeForCausalLM) -> None:
    """The router and the stacked experts, the dense layer's MLP and the q/k norms hold transformers' tensors."""
    reference = checkpoint.reference.model.layers
    moe = model.model.layers[2].mlp
    hf_moe = reference[2].mlp
    assert type(moe) is FusedMoE
    assert torch.equal(moe.gate.weight, hf_moe.gate.weight)
    assert torch.equal(moe.w13_weight, hf_moe.experts.gate_up_proj)
    assert torch.equal(moe.w2_weight, hf_moe.experts.down_proj)
    dense = model.model.layers[0].mlp
    hf_dense = reference[0].mlp
    assert isinstance(dense, GatedMLP)
    assert torch.equal(
        dense.gate_up_proj.weight, torch.cat([hf_dense.gate_proj.weight, hf_dense.up_proj.weight])
    )
    assert torch.equal(dense.down_proj.weight, hf_dense.down_proj.weight)
    attention = model.model.layers[1].self_attn
    assert torch.equal(attention.q_norm.weight, reference[1].self_attn.q_norm.weight)
    assert torch.equal(attention.k_norm.weight, reference[1].self_attn.k_norm.weight)


def test_missing_expert_is_reported(checkpoint: Checkpoint) -> None:
    model = Qwen3MoeForCausalLM(load_hf_config(checkpoint.path), dtype=torch.float32)
    weights = [
        (name, tensor)
        for name, tensor in iterate_safetensors_weights(checkpoint.path)
        if name != "model.layers.1.mlp.experts.5.down_proj.weight"
    ]
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.w2_weight\[5, 0\]"):
        model.load_weights(weights)


def test_routing_varies_and_fused_decode_declines(
    checkpoint: Checkpoint, model: Qwen3MoeForCausalLM
) -> None:
    """Tokens of one prompt pick different expert sets; the Llama fused decode path declines a model with
    experts."""
    embeddings = checkpoint.reference.model.embed_tokens.weight[random_prompt(1, 40, VOCAB_SIZE)]
    router = model.model.layers[1].mlp.gate.weight
    _, ids = softmax_topk(embeddings @ router.T, TOP_K)
    assert len({tuple(sorted(row)) for row in ids.tolist()}) >= 6
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


def test_moe_block_matches_transformers(checkpoint: Checkpoint, model: Qwen3MoeForCausalLM) -> None:
    """The block against transformers' `Qwen3MoeSparseMoeBlock`, to float32 rounding (the experts may run in the
    C++ kernel, whose sums are not torch's)."""
    hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        reference = checkpoint.reference.model.layers[1].mlp(hidden[None])[0]
    torch.testing.assert_close(model.model.layers[1].mlp(hidden), reference, atol=1e-5, rtol=1e-5)


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM: hidden_act 'gelu_pytorch_tanh'"):
        Qwen3MoeForCausalLM(
            parse_hf_config(_raw(hidden_act="gelu_pytorch_tanh")), dtype=torch.float32
        )
    with pytest.raises(ValueError, match="decoder_sparse_step -1"):
        parse_hf_config(_raw(decoder_sparse_step=-1))


@pytest.mark.parametrize("sliced", [False, True])
def test_tensor_parallel_rank_loads_its_part(checkpoint: Checkpoint, sliced: bool) -> None:
    """Rank 1 of 2 holds the second half of every expert's intermediate dimension (rows of gate and up, columns of
    down) and of the dense layer's (as `GatedMLP`), and the whole router, whether it cuts whole checkpoint tensors
    or reads just its parts (`checkpoint_index`)."""
    model = Qwen3MoeForCausalLM(
        load_hf_config(checkpoint.path), dtype=torch.float32, tp=TensorParallelGroup(rank=1, size=2)
    )
    select = model.checkpoint_index if sliced else None
    model.load_weights(iterate_safetensors_weights(checkpoint.path, select), sliced=sliced)
    moe, hf_moe = model.model.layers[2].mlp, checkpoint.reference.model.layers[2].mlp
    half = SHAPE["moe_intermediate_size"] // 2
    gate_up, down = hf_moe.experts.gate_up_proj, hf_moe.experts.down_proj
    assert torch.equal(moe.gate.weight, hf_moe.gate.weight)
    assert torch.equal(
        moe.w13_weight, torch.cat([gate_up[:, half : 2 * half], gate_up[:, 3 * half :]], dim=1)
    )
    assert torch.equal(moe.w2_weight, down[:, :, half:])
    dense, hf_dense = model.model.layers[0].mlp, checkpoint.reference.model.layers[0].mlp
    half = SHAPE["intermediate_size"] // 2
    assert torch.equal(
        dense.gate_up_proj.weight,
        torch.cat([hf_dense.gate_proj.weight[half:], hf_dense.up_proj.weight[half:]]),
    )
    assert torch.equal(dense.down_proj.weight, hf_dense.down_proj.weight[:, half:])


def test_two_ranks_greedy_tokens_equal_transformers(checkpoint: Checkpoint) -> None:
    """`LLM(tensor_parallel_size=2)` with the multiprocess executor (gloo on CPU): chunked prefill (a prompt longer
    than the step budget) and batched decode give transformers' greedy tokens; each rank holds half of every
    expert and of the dense MLP, and the whole router."""
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
    local = SHAPE["moe_intermediate_size"] // 2
    for shapes in rank_shapes:
        assert shapes["model.layers.1.mlp.gate.weight"] == (NUM_EXPERTS, 64)
        assert shapes["model.layers.1.mlp.w13_weight"] == (NUM_EXPERTS, 2 * local, 64)
        assert shapes["model.layers.1.mlp.w2_weight"] == (NUM_EXPERTS, 64, local)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (
            64,
            SHAPE["intermediate_size"] // 2,
        )


class TestQwen3MoeFamily(FamilySuite):
    """The checks every family's comparison with transformers makes (`family_suite`)."""

    vocab_size = VOCAB_SIZE
