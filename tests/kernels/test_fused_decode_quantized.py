"""`decode_layer_quantized`: the fused decode path for quantized weights (GGUF blocks, int8). A decode-only step of
such a model runs each decoder layer as one C++ call chaining the kernels its per-op layers call (the GGUF / int8
products of `kvflow.kernels.quant`, the norms, rotary, paged attention), so every step's logits must equal the
per-op path's bit for bit: float32 activations (GGUF files: Q8_0, Q4_0, a Q4_K_M mix with Q4_K and Q6_K runs inside
one fused QKV, Qwen2's biases sliced per run, Qwen3's per-head q/k norms) and bfloat16 ones (int8 on a bfloat16
checkpoint, bias converted per call). A layer with a float run, or products on the PyTorch reference, keeps the
per-op path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import kernels
from kvflow.kernels import quant
from kvflow.models.fused_decode import FusedDecodeLayers
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import load_model
from kvflow.models.quantization.gguf_writer import write_gguf
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from tests.kernels.quant_static import static_quant_plans  # noqa: F401
from tests.kernels.test_fused_decode_layer import _drive

# Row lengths multiples of 256 so that every K-quant applies.
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused_quantized")
    return {
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2", seed=11, **SHAPE),
        "llama-bf16": make_tiny_checkpoint(
            root / "llama-bf16", "llama", seed=12, dtype="bfloat16", **SHAPE
        ),
        "qwen2-bf16": make_tiny_checkpoint(
            root / "qwen2-bf16", "qwen2", seed=13, dtype="bfloat16", **SHAPE
        ),
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3", seed=14, **SHAPE),
        "qwen3-bf16": make_tiny_checkpoint(
            root / "qwen3-bf16", "qwen3", seed=15, dtype="bfloat16", **SHAPE
        ),
    }


def _per_op_and_fused(model_path: Path, **load: Any) -> None:
    """Drive the model fused, then a fresh copy per-op; equal outputs and logits, bit for bit."""
    fused_model = load_model(model_path, attention_backend="cpu", **load)
    assert isinstance(fused_model, LlamaForCausalLM)
    assert fused_model.fused_decode is not None and fused_model.fused_decode.is_quantized
    fused_outputs, fused_logits, num_fused, fused_rows = _drive(fused_model)
    per_op_model = load_model(model_path, attention_backend="cpu", **load)
    per_op_model.fused_decode = None
    per_op_outputs, per_op_logits, _, _ = _drive(per_op_model)
    assert 0 < num_fused < len(fused_logits) and num_fused >= 10
    assert max(fused_rows) == 3  # the three requests decode together
    assert fused_outputs == per_op_outputs
    for step, (fused, per_op) in enumerate(zip(fused_logits, per_op_logits, strict=True)):
        assert torch.equal(fused, per_op), f"step {step}"


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_K_M"])
def test_gguf_fused_decode_equals_the_per_op_path_bit_for_bit(
    ops: object, checkpoints: dict[str, Path], tmp_path: Path, tensor_type: str
) -> None:
    path = write_gguf(checkpoints["qwen2"], tmp_path / f"{tensor_type}.gguf", tensor_type)
    if (
        tensor_type == "Q4_K_M"
    ):  # Q4_K and Q6_K runs inside one fused QKV: both kinds of run in one product
        runs = load_model(path).model.layers[1].self_attn.qkv_proj.quant_method.runs
        assert [run.qtype for run in runs] == ["Q4_K", "Q6_K"]
    _per_op_and_fused(path)


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_K_M"])
def test_qwen3_gguf_fused_decode_equals_the_per_op_path_bit_for_bit(
    ops: object, checkpoints: dict[str, Path], tmp_path: Path, tensor_type: str
) -> None:
    """Qwen3's per-head q/k norms in float32: the per-op norms run on the C++ kernel the fused layer calls."""
    path = write_gguf(checkpoints["qwen3"], tmp_path / f"{tensor_type}.gguf", tensor_type)
    model = load_model(path, attention_backend="cpu")
    assert model.fused_decode is not None
    assert model.model.layers[0].self_attn.q_norm.float32_kernel
    assert model.model.layers[0].self_attn.k_norm.float32_kernel
    _per_op_and_fused(path)


@pytest.mark.parametrize("checkpoint", ["llama-bf16", "qwen2-bf16", "qwen2", "qwen3-bf16", "qwen3"])
def test_int8_fused_decode_equals_the_per_op_path_bit_for_bit(
    ops: object, checkpoints: dict[str, Path], checkpoint: str
) -> None:
    """int8 with bfloat16 activations (the outputs rounded to bfloat16 as `.to(x.dtype)` does; Qwen2's bfloat16
    bias converted per call) and with float32 ones."""
    _per_op_and_fused(checkpoints[checkpoint], quantization="int8")


def test_the_row_limit_stops_where_the_per_op_products_leave_the_kernels(
    ops: object, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Q8_0 products take torch's GEMM (or W8A8) above QUANT_TILED_MAX_ROWS rows, so a Q8_0 model's fused steps
    stop there; the integer products (Q4_0, Q4_K, Q6_K: per-block x quants at every M) and int8 (up to
    INT8_TILED_MAX_ROWS) reach the extension's own limit."""
    limit = ops.MAX_DECODE_LAYER_ROWS  # type: ignore[attr-defined]
    q8_0 = load_model(write_gguf(checkpoints["qwen2"], tmp_path / "q8.gguf", "Q8_0"))
    q4_0 = load_model(write_gguf(checkpoints["qwen2"], tmp_path / "q4.gguf", "Q4_0"))
    q4_k_m = load_model(write_gguf(checkpoints["qwen2"], tmp_path / "q4km.gguf", "Q4_K_M"))
    int8 = load_model(checkpoints["qwen2-bf16"], quantization="int8")
    assert q8_0.fused_decode.max_rows == min(limit, quant.QUANT_TILED_MAX_ROWS)
    assert q4_0.fused_decode.max_rows == limit
    assert q4_k_m.fused_decode.max_rows == limit
    assert int8.fused_decode.max_rows == min(limit, quant.INT8_TILED_MAX_ROWS)


def test_a_float_run_or_the_reference_products_keep_the_per_op_path(
    ops: object, checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def mixed(name: str, shape: tuple[int, int]) -> str:
        return "F16" if name.endswith("ffn_up.weight") else "Q8_0"

    with_float_run = load_model(write_gguf(checkpoints["qwen2"], tmp_path / "mixed.gguf", mixed))
    assert with_float_run.fused_decode is None
    # Norms of a model without the fused path stay torch's (bit for bit with transformers in float32).
    assert not with_float_run.model.layers[0].input_layernorm.float32_kernel
    fused = load_model(write_gguf(checkpoints["qwen2"], tmp_path / "q8.gguf", "Q8_0"))
    assert isinstance(fused.fused_decode, FusedDecodeLayers)
    assert fused.model.layers[0].input_layernorm.float32_kernel
    # The final norm too (outside the fused layers, fewer torch ops a step), and it is the kernel's RMSNorm.
    assert fused.model.norm.float32_kernel
    hidden = torch.randn(3, fused.model.norm.weight.numel())
    normed, _ = fused.model.norm.forward_with_residual(hidden, None)
    expected, _ = kernels.add_rms_norm(
        hidden, None, fused.model.norm.weight, fused.model.norm.eps, float32=True
    )
    assert torch.equal(normed, expected)
    monkeypatch.setattr(
        quant, "_kernel_ops", lambda: None
    )  # products chosen at load: the reference
    reference = load_model(checkpoints["qwen2-bf16"], quantization="int8")
    assert reference.fused_decode is None
