"""Quantized experts in whole models: GGUF mixture-of-experts files keep their experts on the file's blocks
(`gguf_plan`, `FusedMoE.quantize_experts`), and `quantization="int8"` quantizes the experts too.

Files are written by kvflow's converter (`write_gguf`) from tiny random Qwen3-MoE and Qwen2-MoE checkpoints whose
expert rows are whole 256-element blocks (hidden 256, expert intermediate 256), so Q4_K_M keeps its K-quants there;
Mixtral (`llama` with experts) takes the same path. A Q8_0 file decodes token for token like the float32 model of
its own weights (`dequantized_checkpoint`): Q8_0 products of decode-sized groups keep fp32 activations. Q4_K_M
quantizes activations per block (as llama.cpp does), so it is held to teacher-forced argmax agreement with that
float model; int8 experts likewise against the float checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from paged_model_driver import PagedDriver
from test_mixtral_vs_hf import make_mixtral_checkpoint
from test_qwen3_moe_vs_hf import make_qwen3_moe_checkpoint

from kvflow.distributed.parallel_state import TensorParallelGroup
from kvflow.models.layers.fused_moe import FusedMoE
from kvflow.models.loader import load_model
from kvflow.models.quantization.gguf_writer import write_gguf
from kvflow.testing.gguf_files import dequantized_checkpoint
from tests.models.greedy import greedy_tokens

VOCAB_SIZE = 384
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.08,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
# Teacher-forced argmax agreement bounds (tiny random models have narrow margins between their top tokens).
Q4_K_M_AGREEMENT = 0.8
INT8_AGREEMENT = 0.85


def make_checkpoint(path: Path, family: str, seed: int = 5) -> Path:
    """A tiny float32 Qwen3-MoE (renormalised top-k) or Qwen2-MoE (shared expert and its gate, biases) checkpoint,
    every layer with experts; router weights x4 so that tokens pick different experts."""
    import transformers

    if family == "qwen3moe":
        config = transformers.Qwen3MoeConfig(**SHAPE, norm_topk_prob=True)
    else:
        config = transformers.Qwen2MoeConfig(
            **SHAPE, shared_expert_intermediate_size=256, norm_topk_prob=False
        )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    param.add_(torch.randn_like(param) * 0.2)
                if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    param.mul_(4.0)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(path, safe_serialization=True)
    config_file = path / "config.json"
    saved = json.loads(config_file.read_text())
    saved.update(use_sliding_window=False, sliding_window=None)
    config_file.write_text(json.dumps(saved, indent=2))
    return path


def _experts(model: torch.nn.Module) -> list[FusedMoE]:
    return [module for module in model.modules() if isinstance(module, FusedMoE)]


def _file_expert_bytes(path: Path) -> int:
    return sum(
        int(tensor.n_bytes)
        for tensor in gguf.GGUFReader(str(path)).tensors
        if "_exps." in tensor.name
    )


def _teacher_forced_argmax(model: Any, prompt: list[int]) -> torch.Tensor:
    driver = PagedDriver(model, block_size=4, seed=1)
    driver.add_request("a", prompt)
    return driver.prompt_logits("a", [8] * (len(prompt) // 8)).argmax(-1)


def _agreement(model: Any, reference: Any) -> float:
    """The lowest teacher-forced argmax agreement over three 40-token prompts."""
    agreement = []
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, VOCAB_SIZE, (40,), generator=generator).tolist()
        same = _teacher_forced_argmax(model, prompt) == _teacher_forced_argmax(reference, prompt)
        agreement.append(float(same.float().mean()))
    return min(agreement)


@pytest.fixture(scope="module", params=["qwen3moe", "qwen2moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_a_q8_0_file_keeps_its_experts_on_blocks_and_decodes_like_its_weights(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLOW_Q8_0_ACTIVATIONS", "float32")  # the float32-x Q8_0 GEMV: exact
    path = write_gguf(checkpoint, tmp_path / "q8.gguf", "Q8_0")
    model = load_model(path)
    layers = _experts(model)
    assert len(layers) == SHAPE["num_hidden_layers"]
    for layer in layers:
        assert (layer.w13_type, layer.w2_type) == ("Q8_0", "Q8_0")
        assert layer.w13_weight.dtype == torch.uint8 and layer.w2_weight.dtype == torch.uint8
    assert sum(layer.expert_weight_bytes() for layer in layers) == _file_expert_bytes(path)
    dequantized = dequantized_checkpoint(path, checkpoint, tmp_path / "dequantized")
    assert greedy_tokens(path) == greedy_tokens(dequantized)


def test_a_q4_k_m_file_keeps_k_quant_experts_and_agrees_with_its_weights(
    checkpoint: Path, tmp_path: Path
) -> None:
    path = write_gguf(checkpoint, tmp_path / "q4km.gguf", "Q4_K_M")
    model = load_model(path)
    layers = _experts(model)
    for layer in layers:
        assert layer.w13_type == "Q4_K" and layer.w2_type in ("Q4_K", "Q6_K")
    assert sum(layer.expert_weight_bytes() for layer in layers) == _file_expert_bytes(path)
    reference = load_model(dequantized_checkpoint(path, checkpoint, tmp_path / "dequantized"))
    assert _agreement(model, reference) >= Q4_K_M_AGREEMENT


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe"])
def test_int8_quantizes_the_experts_and_agrees_with_the_float_model(
    tmp_path: Path, family: str
) -> None:
    maker = make_mixtral_checkpoint if family == "mixtral" else make_qwen3_moe_checkpoint
    checkpoint = maker(tmp_path / family)
    model = load_model(checkpoint, quantization="int8")
    layers = _experts(model)
    assert layers
    for layer in layers:
        assert (layer.w13_type, layer.w2_type) == ("int8", "int8")
        assert layer.w13_weight.dtype == torch.int8 and layer.w2_weight.dtype == torch.int8
        assert layer.gate.weight.dtype == torch.float32  # the router stays float
    assert _agreement(model, load_model(checkpoint)) >= INT8_AGREEMENT


def test_tensor_parallel_gguf_experts_need_whole_blocks_per_rank() -> None:
    """Rank 1 of 2 holds 128 of each expert's 256 intermediate columns: whole Q8_0 blocks (the down projection's
    columns split on them), not whole Q4_K / Q6_K ones: refused, naming the cause."""
    layer = FusedMoE(
        4,
        2,
        256,
        256,
        dtype=torch.float32,
        device=torch.device("cpu"),
        tp=TensorParallelGroup(rank=1, size=2),
    )
    with pytest.raises(ValueError, match=r"whole blocks.*fewer ranks"):
        layer.quantize_experts("Q4_K", "Q6_K")
    layer.quantize_experts("Q8_0", "Q8_0")
    assert layer.w2_weight.shape == (4, 256, 128 // 32 * 34)


@pytest.mark.slow
def test_tensor_parallel_q8_0_experts_decode_like_one_rank(
    checkpoint: Path, tmp_path: Path
) -> None:
    path = write_gguf(checkpoint, tmp_path / "tp.gguf", "Q8_0")
    assert greedy_tokens(path, tensor_parallel_size=2) == greedy_tokens(path)


def test_q5_0_experts_run_as_q8_0_blocks_like_dense_layers(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q5_0 experts convert to Q8_0 blocks as they load (exactly: the same fp16 scale, q - 16), as dense Q5_0
    layers do; the file then decodes like its own weights dequantized."""
    monkeypatch.setenv("KVFLOW_Q8_0_ACTIVATIONS", "float32")  # the float32-x Q8_0 GEMV: exact
    path = write_gguf(
        checkpoint,
        tmp_path / "q5.gguf",
        lambda name, shape: "Q5_0" if "_exps" in name else "Q8_0",
    )
    layers = _experts(load_model(path))
    assert all((layer.w13_type, layer.w2_type) == ("Q8_0", "Q8_0") for layer in layers)
    dequantized = dequantized_checkpoint(path, checkpoint, tmp_path / "dequantized")
    assert greedy_tokens(path) == greedy_tokens(dequantized)


def test_a_mixtral_q8_0_file_keeps_its_experts_on_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixtral (`llama` with experts; w1 / w3 / w2 through the model's checkpoint_target) as the Qwen files."""
    monkeypatch.setenv("KVFLOW_Q8_0_ACTIVATIONS", "float32")  # the float32-x Q8_0 GEMV: exact
    checkpoint = make_mixtral_checkpoint(tmp_path / "mixtral")
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    config.update(sliding_window=None)  # llama.cpp's `llama` graph attends to the whole sequence
    config_file.write_text(json.dumps(config, indent=2))
    path = write_gguf(checkpoint, tmp_path / "mixtral.gguf", "Q8_0")
    layers = _experts(load_model(path))
    assert layers and all((layer.w13_type, layer.w2_type) == ("Q8_0", "Q8_0") for layer in layers)
    assert sum(layer.expert_weight_bytes() for layer in layers) == _file_expert_bytes(path)
    dequantized = dequantized_checkpoint(path, checkpoint, tmp_path / "dequantized")
    assert greedy_tokens(path) == greedy_tokens(dequantized)
