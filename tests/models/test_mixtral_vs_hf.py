"""kvflow's Mixtral against transformers (float32) on a tiny random checkpoint made with `MixtralForCausalLM`.

The checkpoint: 2 layers, 4 experts, top-2 routing, a sliding window of 16 on every layer, router weights scaled
up so routing is decided by clear margins and differs between tokens (checked here). Everything runs through the
real paged layout (`paged_model_driver`): chunked prefill, batched decodes mixed with prefill chunks, prefix blocks
shared between requests; then through `LLM` (sync and async scheduling, both runner protocols). `FusedMoE` itself:
a token's output is the same alone as in any batch, and the checkpoint's per-expert tensors load into the stacked
parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_suite import Checkpoint, FamilySuite, random_prompt, save_random_checkpoint

from kvflow.distributed import TensorParallelGroup
from kvflow.models.fused_decode import FusedDecodeLayers
from kvflow.models.hf_config import load_hf_config, parse_hf_config
from kvflow.models.layers.fused_moe import FusedMoE, softmax_topk
from kvflow.models.loader import load_model
from kvflow.models.mixtral import MixtralForCausalLM
from kvflow.testing.hf_checkpoints import load_hf_model
from tests.kernels.conftest import kernels_disabled

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
    return save_random_checkpoint(
        path,
        lambda: transformers.AutoModelForCausalLM.from_config(config),
        seed=seed,
        scaled=lambda name: "gate.weight" in name,
    )


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
    return random_prompt(seed, length, VOCAB_SIZE)


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


def test_tensor_parallel_rank_loads_its_part_of_each_expert(checkpoint: Checkpoint) -> None:
    """Rank 1 of 2 holds the second half of every expert's intermediate dimension (rows of w1 and w3, columns of
    w2) and the whole router, whether it cuts whole checkpoint tensors or reads just its part (`checkpoint_index`)."""
    from kvflow.models.loader import iterate_safetensors_weights

    config = load_hf_config(checkpoint.path)
    hf_layer = checkpoint.reference.model.layers[1].mlp
    half = config.intermediate_size // 2
    gate_up, down = hf_layer.experts.gate_up_proj, hf_layer.experts.down_proj
    expected_w13 = torch.cat([gate_up[:, half : 2 * half], gate_up[:, 3 * half :]], dim=1)
    for sliced in (False, True):
        model = MixtralForCausalLM(
            config, dtype=torch.float32, tp=TensorParallelGroup(rank=1, size=2)
        )
        select = model.checkpoint_index if sliced else None
        model.load_weights(iterate_safetensors_weights(checkpoint.path, select), sliced=sliced)
        moe = model.model.layers[1].mlp
        assert torch.equal(moe.gate.weight, hf_layer.gate.weight)
        assert torch.equal(moe.w13_weight, expected_w13)
        assert torch.equal(moe.w2_weight, down[:, :, half:])


def test_moe_token_alone_equals_token_in_batch(model: MixtralForCausalLM) -> None:
    """Each token's MoE output alone and in batches of 2..64 tokens: the same experts and weights, and outputs
    within 1e-5 (the experts' C++ kernel is bitwise batch-independent, tests/kernels/test_fused_moe_kernel.py, but
    the router's `F.linear` and the PyTorch experts path without the kernels run torch's float32 products, whose
    last bits vary with the number of rows (measured up to ~1e-5 here))."""
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
    # The PyTorch experts path sums as transformers does; the kernel's products sum in another order.
    with kernels_disabled():
        assert torch.equal(model.model.layers[0].mlp(hidden), reference)
    torch.testing.assert_close(model.model.layers[0].mlp(hidden), reference, atol=1e-5, rtol=1e-5)


class TestMixtralFamily(FamilySuite):
    """The checks every family's comparison with transformers makes (`family_suite`)."""

    vocab_size = VOCAB_SIZE
