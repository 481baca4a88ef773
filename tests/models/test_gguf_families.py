"""GGUF files of the Gemma 2, Gemma 3, Phi-3 and mixture-of-experts families, and the 5-bit types Q5_0 / Q5_K.

Each family's file is written by kvflow's converter (`write_gguf`, the layout llama.cpp's own converter writes: Gemma
norms stored plus 1, Phi-3's fused `attn_qkv` / `ffn_up` and LongRoPE factor tensors) from the tiny random
checkpoints of the family's comparison with transformers, and read back by kvflow's GGUF loader. F32 files decode
token for token like the safetensors checkpoint; Q8_0 files agree with it on most teacher-forced argmaxes. Q5_0 / Q5_K
tensors run as Q8_0 blocks (`gguf_plan`'s docstring): a file holding them decodes exactly like its own weights
dequantized to float32 (`dequantized_checkpoint`). Mixture-of-experts files (Mixtral as `llama`, `qwen2moe`,
`qwen3moe`) stack each layer's experts into llama.cpp's `[experts, rows, columns]` tensors; here the down projections
are float32 (48 columns: no whole blocks), so kvflow loads these experts dequantized to float32 and a quantized file
decodes exactly like its dequantized weights too (experts on their blocks: tests/models/test_moe_quantized.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from paged_model_driver import PagedDriver
from safetensors.torch import load_file
from test_gemma2_vs_hf import make_gemma2_checkpoint
from test_gemma3_vs_hf import make_gemma3_checkpoint
from test_mixtral_vs_hf import make_mixtral_checkpoint
from test_phi3_vs_hf import LONGROPE, PHI4_MINI, make_phi3_checkpoint
from test_qwen2_moe_vs_hf import make_qwen2_moe_checkpoint
from test_qwen3_moe_vs_hf import make_qwen3_moe_checkpoint

from kvflow.models.hf_config import load_hf_config
from kvflow.models.loader import load_model
from kvflow.models.quantization import ggml_quantize
from kvflow.models.quantization.gguf_file import GGUFCheckpoint
from kvflow.models.quantization.gguf_plan import GGUFLinear
from kvflow.models.quantization.gguf_writer import (
    LLAMA_CPP_K_QUANT_FALLBACK,
    q4_k_m_type,
    write_gguf,
)
from kvflow.testing.gguf_files import dequantized_checkpoint
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from tests.kernels.quant_static import static_quant_plans  # noqa: F401
from tests.models.greedy import greedy_tokens

FAMILIES = ("gemma2", "gemma3", "phi3", "phi4_mini")
VOCAB_SIZE = 384
# Teacher-forced argmax agreement of a Q8_0 file with its float checkpoint (tiny random models have narrow margins).
Q8_0_AGREEMENT = 0.85


def _llama_cpp_scale(path: Path) -> Path:
    """llama.cpp's Gemma files carry no `query_pre_attn_scalar` (it uses `head_dim`): the makers' 24 is set to it."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["query_pre_attn_scalar"] = config["head_dim"]
    config_file.write_text(json.dumps(config, indent=2))
    return path


MAKERS: dict[str, Callable[[Path], Path]] = {
    "gemma2": lambda path: _llama_cpp_scale(make_gemma2_checkpoint(path)),
    "gemma3": lambda path: _llama_cpp_scale(make_gemma3_checkpoint(path)),
    "phi3": lambda path: make_phi3_checkpoint(path, **LONGROPE),
    # partial rotary (12 of 16 dims), LongRoPE factor lists of 6, an explicit attention factor, tied embeddings
    "phi4_mini": lambda path: make_phi3_checkpoint(path, seed=9, **PHI4_MINI),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_families")
    return {family: MAKERS[family](root / family) for family in FAMILIES}


def _fields(path: Path) -> dict[str, Any]:
    return {name: field.contents() for name, field in gguf.GGUFReader(str(path)).fields.items()}


def _prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()


def _teacher_forced_argmax(model: Any, prompt: list[int]) -> torch.Tensor:
    """Prefilled 8 tokens a step: Q8_0 products of that few rows quantize x per 32 elements, as its decode steps do
    (larger ones per row, as llama.cpp's prefill does: `kvflow.kernels.quant.quantizes_activation_rows`)."""
    driver = PagedDriver(model, block_size=4, seed=1)
    driver.add_request("a", prompt)
    return driver.prompt_logits("a", [8] * (len(prompt) // 8)).argmax(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_f32_file_decodes_token_for_token_like_the_checkpoint(
    checkpoints: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """Gemma 2: attention and final soft-caps, alternating sliding layers; Gemma 3: q/k norms, a custom sliding
    pattern, local and global RoPE bases, linear scaling; Phi-3: fused tensors split, LongRoPE (long factors)."""
    path = write_gguf(checkpoints[family], tmp_path / f"{family}.gguf", "F32")
    assert greedy_tokens(path) == greedy_tokens(checkpoints[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_q8_0_file_agrees_with_the_checkpoints_teacher_forced_argmax(
    checkpoints: dict[str, Path], tmp_path: Path, family: str
) -> None:
    path = write_gguf(checkpoints[family], tmp_path / f"{family}.gguf", "Q8_0")
    model = load_model(path)
    qkv = model.model.layers[0].self_attn.qkv_proj.quant_method
    assert isinstance(qkv, GGUFLinear) and [run.qtype for run in qkv.runs] == ["Q8_0"]
    reference = load_model(checkpoints[family])
    agreement = []
    for seed in range(3):
        prompt = _prompt(seed, 40)
        same = _teacher_forced_argmax(model, prompt) == _teacher_forced_argmax(reference, prompt)
        agreement.append(float(same.float().mean()))
    assert min(agreement) >= Q8_0_AGREEMENT, agreement


def test_gemma_metadata_and_norms_are_written_as_llama_cpp_reads_them(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    gemma2 = write_gguf(checkpoints["gemma2"], tmp_path / "gemma2.gguf", "F32")
    fields = _fields(gemma2)
    assert fields["general.architecture"] == "gemma2"
    assert fields["gemma2.attn_logit_softcapping"] == pytest.approx(5.0)
    assert fields["gemma2.final_logit_softcapping"] == pytest.approx(4.0)
    assert fields["gemma2.attention.sliding_window"] == 8
    assert (
        "gemma2.attention.sliding_window_pattern" not in fields
    )  # llama.cpp's default: every 2nd layer full
    reader = gguf.GGUFReader(str(gemma2))
    tensors = {tensor.name: np.asarray(tensor.data) for tensor in reader.tensors}
    assert "output.weight" not in tensors  # tied
    original = load_file(str(checkpoints["gemma2"] / "model.safetensors"))
    for gguf_name, hf_name in (
        ("blk.1.post_attention_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
        ("blk.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight"),
        ("blk.1.post_ffw_norm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ):
        np.testing.assert_array_equal(tensors[gguf_name], (original[hf_name] + 1).numpy())

    gemma3 = write_gguf(checkpoints["gemma3"], tmp_path / "gemma3.gguf", "F32")
    fields = _fields(gemma3)
    assert fields["gemma3.final_logit_softcapping"] == pytest.approx(6.0)
    assert "gemma3.attn_logit_softcapping" not in fields
    assert fields["gemma3.attention.sliding_window_pattern"] == [True, False, True, True]
    assert fields["gemma3.rope.freq_base"] == pytest.approx(1e6)
    assert fields["gemma3.rope.freq_base_swa"] == pytest.approx(10.0)
    assert fields["gemma3.rope.scaling.type"] == "linear"
    assert fields["gemma3.rope.scaling.factor"] == pytest.approx(4.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_read_back_is_the_checkpoints(
    checkpoints: dict[str, Path], tmp_path: Path, family: str
) -> None:
    path = write_gguf(checkpoints[family], tmp_path / f"{family}.gguf", "Q8_0")
    read = GGUFCheckpoint(path).hf_config()
    original = load_hf_config(checkpoints[family])
    for field in (
        "architecture",
        "vocab_size",
        "num_hidden_layers",
        "head_dim",
        "layer_types",
        "sliding_window",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rope_theta",
        "sliding_rope_theta",
        "tie_word_embeddings",
        "hidden_act",
    ):
        assert getattr(read, field) == getattr(original, field), field
    if family.startswith("phi"):
        scaling, expected = read.rope_scaling or {}, original.rope_scaling or {}
        assert (
            scaling["original_max_position_embeddings"]
            == expected["original_max_position_embeddings"]
        )
        assert scaling.get("partial_rotary_factor", 1.0) == expected.get(
            "partial_rotary_factor", 1.0
        )
        assert scaling.get("attention_factor") == pytest.approx(expected.get("attention_factor"))
        for key in ("long_factor", "short_factor"):
            np.testing.assert_allclose(scaling[key], expected[key], rtol=1e-7)
    else:
        assert read.rope_scaling == original.rope_scaling


def test_phi3_fused_tensors_and_longrope_are_written_as_llama_cpp_names_them(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = write_gguf(checkpoints["phi3"], tmp_path / "phi3.gguf", "F32")
    fields = _fields(path)
    assert (
        "phi3.rope.scaling.type" not in fields
    )  # llama.cpp's phi3 files say LongRoPE by the factor tensors
    assert fields["phi3.rope.scaling.original_context_length"] == 32
    assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx(
        (1 + np.log(128 / 32) / np.log(32)) ** 0.5
    )
    assert fields["phi3.attention.sliding_window"] == 0
    reader = gguf.GGUFReader(str(path))
    tensors = {tensor.name: np.asarray(tensor.data) for tensor in reader.tensors}
    original = load_file(str(checkpoints["phi3"] / "model.safetensors"))
    np.testing.assert_array_equal(
        tensors["blk.0.attn_qkv.weight"], original["model.layers.0.self_attn.qkv_proj.weight"]
    )
    np.testing.assert_array_equal(
        tensors["blk.0.ffn_up.weight"], original["model.layers.0.mlp.gate_up_proj.weight"]
    )
    assert tensors["rope_factors_long.weight"].shape == (8,)
    infos = GGUFCheckpoint(path).tensor_infos()
    assert infos["model.layers.0.self_attn.k_proj.weight"].row_start == 64
    assert infos["model.layers.0.mlp.up_proj.weight"].shape == (128, 64)


def test_a_gemma_attention_scale_llama_cpp_cannot_express_is_refused(tmp_path: Path) -> None:
    checkpoint = make_gemma2_checkpoint(
        tmp_path / "gemma2"
    )  # query_pre_attn_scalar 24, head_dim 16
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar 24.*16 \*\* -0\.5"):
        write_gguf(checkpoint, tmp_path / "gemma2.gguf", "F32")


def test_an_architecture_kvflow_does_not_read_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "starcoder2.gguf"
    writer = gguf.GGUFWriter(str(path), "starcoder2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = r"GGUF architecture 'starcoder2' is not supported; kvflow reads llama, .*gemma2, gemma3, phi3"
    with pytest.raises(ValueError, match=message):
        GGUFCheckpoint(path).hf_config()
    with pytest.raises(ValueError, match=message):
        load_model(path)


# ------------------------------------------------------------------------------------------ Q5_0 and Q5_K
@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_K"])
def test_5_bit_round_trip_matches_gguf_py_and_its_error_bound(qtype: str) -> None:
    """kvflow's decoding equals gguf-py's (ggml's reference) bit for bit. Each weight is within one step of the
    original for Q5_0 (max |w| / 16 of its 32-weight block: the side opposite the largest weight clips at +15) and
    within about half a step for Q5_K (its 256-weight block's range / 31, plus the 6-bit scale rounding); the RMS
    error is under 5 % of the weights' RMS."""
    generator = np.random.default_rng(0)
    scales = generator.uniform(0.01, 1, (16, 1))
    weights = (generator.standard_normal((16, 512)) * scales).astype(np.float32)
    blocks = ggml_quantize.quantize(qtype, weights)
    decoded = ggml_quantize.dequantize(qtype, blocks)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(decoded, reference.reshape(weights.shape))
    if qtype == "Q5_0":
        error = np.abs(decoded - weights).reshape(-1, 32)
        bound = np.abs(weights.reshape(-1, 32)).max(axis=1, keepdims=True) / 16
    else:
        error = np.abs(decoded - weights).reshape(-1, 256)
        bound = 0.6 * np.ptp(weights.reshape(-1, 256), axis=1, keepdims=True) / 31
    assert np.all(error <= bound + 1e-6)
    rms = np.sqrt(np.mean((decoded - weights) ** 2) / np.mean(weights**2))
    assert rms < 0.05, rms


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_K"])
def test_5_bit_blocks_become_q8_0_blocks_exactly_or_within_half_a_q8_0_step(qtype: str) -> None:
    """Q5_0 -> Q8_0 is exact; Q5_K's requantized weights are within half a Q8_0 step (max |w| / 127 of the 32-weight
    block) plus the fp16 rounding of the Q8_0 scale."""
    generator = np.random.default_rng(1)
    weights = generator.standard_normal((8, 256)).astype(np.float32)
    blocks = ggml_quantize.quantize(qtype, weights)
    decoded = ggml_quantize.dequantize(qtype, blocks)
    q8 = ggml_quantize.to_q8_0(qtype, blocks)
    as_q8 = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).reshape(weights.shape)
    if qtype == "Q5_0":
        np.testing.assert_array_equal(as_q8, decoded)
    else:
        step = np.abs(decoded.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(as_q8 - decoded).reshape(-1, 32) <= 0.55 * step)


@pytest.mark.parametrize("tensor_type", ["Q5_0", "Q5_K"])
def test_a_5_bit_file_loads_as_q8_0_and_decodes_like_its_weights_dequantized(
    tmp_path: Path, tensor_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLOW_Q8_0_ACTIVATIONS", "float32")  # the float32-x Q8_0 GEMV: exact
    checkpoint = make_tiny_checkpoint(
        tmp_path / "llama", "llama", hidden_size=256, intermediate_size=512, head_dim=64
    )
    path = write_gguf(checkpoint, tmp_path / f"{tensor_type}.gguf", tensor_type)
    infos = GGUFCheckpoint(path).tensor_infos()
    down = infos["model.layers.0.mlp.down_proj.weight"]
    assert (down.file_qtype, down.qtype) == (tensor_type, "Q8_0")
    model = load_model(path)
    gate_up = model.model.layers[0].mlp.gate_up_proj.quant_method
    assert isinstance(gate_up, GGUFLinear) and gate_up.kernel_names == ["ggml_linear_Q8_0_kernel"]
    dequantized = dequantized_checkpoint(path, checkpoint, tmp_path / "dequantized")
    assert greedy_tokens(path) == greedy_tokens(dequantized)


def test_a_q4_k_m_file_with_short_rows_falls_back_to_q5_0_as_llama_cpp_does(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64-column rows are no whole 256-element block: llama.cpp's mix stores Q5_0 (and Q8_0 for its Q6_K
    tensors) there; the Gemma 2 file loads and decodes like its weights dequantized."""
    monkeypatch.setenv("KVFLOW_Q8_0_ACTIVATIONS", "float32")  # the float32-x Q8_0 GEMV: exact
    mix = q4_k_m_type(4, LLAMA_CPP_K_QUANT_FALLBACK)
    path = write_gguf(checkpoints["gemma2"], tmp_path / "mix.gguf", mix)
    file_types = {info.file_qtype for info in GGUFCheckpoint(path).tensor_infos().values()}
    assert {"Q5_0", "Q8_0"} <= file_types
    dequantized = dequantized_checkpoint(path, checkpoints["gemma2"], tmp_path / "dequantized")
    assert greedy_tokens(path) == greedy_tokens(dequantized)


# ------------------------------------------------------------------------------------------ mixture of experts
def _without_sliding_window(path: Path) -> Path:
    """llama.cpp's `llama` / `qwen2moe` / `qwen3moe` graphs attend to the whole sequence: the makers' window off."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(use_sliding_window=False, sliding_window=None)
    config.pop("layer_types", None)
    config_file.write_text(json.dumps(config, indent=2))
    return path


MOE_MAKERS: dict[str, Callable[[Path], Path]] = {
    "mixtral": lambda path: _without_sliding_window(make_mixtral_checkpoint(path)),
    "qwen2moe": lambda path: _without_sliding_window(make_qwen2_moe_checkpoint(path)),
    "qwen3moe": lambda path: _without_sliding_window(make_qwen3_moe_checkpoint(path)),
}


def _q8_0_where_blocks_fit(name: str, shape: tuple[int, int]) -> str:
    """Q8_0, but float32 for the 48-column expert down projections (no whole 32-element blocks)."""
    return "Q8_0" if shape[1] % 32 == 0 else "F32"


@pytest.mark.parametrize("family", list(MOE_MAKERS))
def test_a_mixture_of_experts_file_decodes_like_the_checkpoint_and_its_weights(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixtral: router and w1/w3/w2 per expert under `llama`; Qwen2-MoE: the shared expert and its gate, a dense
    layer (`mlp_only_layers`: no router in the file), top-k not renormalised; Qwen3-MoE: renormalised, q/k norms. F32:
    token for token the checkpoint; Q8_0 (experts dequantized at load, the shared expert on its blocks): token for
    token the float32 model of the file's weights."""
    monkeypatch.setenv("KVFLOW_Q8_0_ACTIVATIONS", "float32")  # the float32-x Q8_0 GEMV: exact
    checkpoint = MOE_MAKERS[family](tmp_path / family)
    path = write_gguf(checkpoint, tmp_path / f"{family}.gguf", "F32")
    assert greedy_tokens(path) == greedy_tokens(checkpoint)
    read, original = GGUFCheckpoint(path).hf_config(), load_hf_config(checkpoint)
    for field in ("architecture", "num_experts", "num_experts_per_tok", "norm_topk_prob"):
        assert getattr(read, field) == getattr(original, field), field
    assert [read.layer_has_experts(i) for i in range(read.num_hidden_layers)] == [
        original.layer_has_experts(i) for i in range(original.num_hidden_layers)
    ]
    quantized = write_gguf(checkpoint, tmp_path / f"{family}-q8.gguf", _q8_0_where_blocks_fit)
    fields = _fields(quantized)
    arch = fields["general.architecture"]
    assert fields[f"{arch}.expert_count"] == read.num_experts
    tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(str(quantized)).tensors}
    last = read.num_hidden_layers - 1  # a layer with experts in every maker's checkpoint
    router = tensors[f"blk.{last}.ffn_gate_inp.weight"]
    assert router.tensor_type.name == "F32"  # as llama.cpp keeps routers
    gate_exps = tensors[f"blk.{last}.ffn_gate_exps.weight"]
    assert gate_exps.tensor_type.name == "Q8_0"
    assert int(gate_exps.shape[2]) == read.num_experts  # ggml's [columns, rows, experts]
    dequantized = dequantized_checkpoint(quantized, checkpoint, tmp_path / "dequantized")
    assert greedy_tokens(quantized) == greedy_tokens(dequantized)


def test_a_routing_llama_cpp_does_not_compute_is_refused(tmp_path: Path) -> None:
    checkpoint = make_qwen2_moe_checkpoint(tmp_path / "qwen2moe")
    config_file = checkpoint / "config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "norm_topk_prob": True})
    )
    with pytest.raises(
        ValueError, match=r"norm_topk_prob True: llama.cpp's qwen2moe never renormalises"
    ):
        write_gguf(checkpoint, tmp_path / "qwen2moe.gguf", "F32")
