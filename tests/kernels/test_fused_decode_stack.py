"""`DecodeLayerStack`: a fused decode step without LoRA rows is one extension call that chains `decode_layer` over
every layer from weights gathered and checked once. It must give what one `decode_layer` / `decode_layer_quantized`
call per layer gives, bit for bit (dense bfloat16, int8 with a bfloat16 bias the stack keeps a float32 copy of, GGUF
K-quants in float32, a sliding window), and a weight update copied into the parameters after the stack was
built must show in its next step (the stack holds the parameters themselves); a swapped kernel module (A/B of two
builds) gets its own stack."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import load_model
from kvflow.models.quantization.gguf_writer import write_gguf
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from tests.kernels.quant_static import static_quant_plans  # noqa: F401
from tests.kernels.test_fused_decode_layer import _drive
from tests.kernels.test_fused_decode_quantized import SHAPE  # rows whole K-quant blocks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused_stack")
    return {
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2", seed=21, **SHAPE),
        "qwen2-bf16": make_tiny_checkpoint(
            root / "qwen2-bf16", "qwen2", seed=22, dtype="bfloat16", **SHAPE
        ),
        # every layer slides over 8 positions: the drive's sequences outgrow the window
        "mistral-bf16": make_tiny_checkpoint(
            root / "mistral-bf16", "mistral", seed=23, dtype="bfloat16", sliding_window=8, **SHAPE
        ),
    }


def _load(checkpoints: dict[str, Path], tmp_path: Path, case: str) -> LlamaForCausalLM:
    """A freshly loaded model of `case` with its fused path ("<checkpoint>/<how>")."""
    name, how = case.split("/")
    path = checkpoints[name]
    load: dict[str, Any] = {"attention_backend": "cpu"}
    if how == "Q4_K_M":
        path = write_gguf(path, tmp_path / f"{name}.gguf", "Q4_K_M")
    elif how == "int8":
        load["quantization"] = "int8"
    else:
        load["dtype"] = "bfloat16"
    model = load_model(path, **load)
    assert isinstance(model, LlamaForCausalLM) and model.fused_decode is not None
    return model


def _drive_once(model: LlamaForCausalLM) -> tuple[list[torch.Tensor], int]:
    """`_drive`'s logits and fused step count, with the model's own `forward` and `run` back afterwards (`_drive`
    wraps them per instance), so that the model can be driven again."""
    _, logits, num_fused, _ = _drive(model)
    del model.forward
    if model.fused_decode is not None:
        del model.fused_decode.run
    return logits, num_fused


CASES = ["qwen2/Q4_K_M", "qwen2-bf16/int8", "qwen2-bf16/dense", "mistral-bf16/dense"]


@pytest.mark.parametrize("case", CASES)
def test_the_one_call_stack_equals_the_per_layer_calls_bit_for_bit(
    ops: ModuleType, checkpoints: dict[str, Path], tmp_path: Path, case: str
) -> None:
    if case.endswith("/dense") and not ops.has_avx512():  # type: ignore[attr-defined]
        pytest.skip("the bfloat16 fused decode_layer runs on AVX-512 machines only")
    stacked = _load(checkpoints, tmp_path, case)
    stacked_outputs, stacked_logits, num_stacked, stacked_rows = _drive(stacked)
    per_layer = _load(checkpoints, tmp_path, case)
    per_layer.fused_decode.use_stack = False
    per_layer_outputs, per_layer_logits, num_per_layer, _ = _drive(per_layer)
    assert stacked.fused_decode._stack is not None and per_layer.fused_decode._stack is None
    assert stacked.fused_decode._stack.num_layers == stacked.num_layers
    assert num_stacked == num_per_layer >= 10 and max(stacked_rows) == 3
    if case.startswith("mistral"):
        assert [stacked.config.layer_sliding_window(i) for i in range(stacked.num_layers)] == [8, 8]
    assert stacked_outputs == per_layer_outputs
    for step, (one_call, per_call) in enumerate(zip(stacked_logits, per_layer_logits, strict=True)):
        assert torch.equal(one_call, per_call), f"step {step}"


@pytest.mark.parametrize("case", ["qwen2-bf16/int8", "qwen2-bf16/dense"])
def test_a_weight_update_after_the_stack_is_built_shows_in_its_next_step(
    ops: ModuleType, checkpoints: dict[str, Path], tmp_path: Path, case: str
) -> None:
    """The update brings a layer's q weight and bias (bfloat16: the int8 stack's float32 copy is refreshed) and a
    down weight; the stack's next steps equal the per-op path's on the updated model, and differ from before."""
    if case.endswith("/dense") and not ops.has_avx512():  # type: ignore[attr-defined]
        pytest.skip("the bfloat16 fused decode_layer runs on AVX-512 machines only")
    model = _load(checkpoints, tmp_path, case)
    before_logits, num_fused = _drive_once(model)
    stack = model.fused_decode._stack
    assert stack is not None and num_fused >= 10
    generator = torch.Generator().manual_seed(9)
    update = {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16) * scale
        for name, shape, scale in (
            ("model.layers.1.self_attn.q_proj.weight", (256, 256), 0.2),
            ("model.layers.1.self_attn.q_proj.bias", (256,), 2.0),
            ("model.layers.0.mlp.down_proj.weight", (256, 512), 0.2),
        )
    }
    model.load_weights(update.items(), strict=False)
    after_logits, num_fused = _drive_once(model)
    assert (
        model.fused_decode._stack is stack and num_fused >= 10
    )  # the same stack, not a rebuilt one
    fused_decode = model.fused_decode
    model.fused_decode = None
    per_op_logits, _ = _drive_once(model)
    model.fused_decode = fused_decode
    assert not all(
        torch.equal(before, after)
        for before, after in zip(before_logits, after_logits, strict=True)
    )
    for step, (fused, per_op) in enumerate(zip(after_logits, per_op_logits, strict=True)):
        assert torch.equal(fused, per_op), f"step {step}"


def test_the_stack_checks_its_weights_once_and_each_steps_shapes(ops: ModuleType) -> None:
    """Built checks refuse a weight of the wrong shape or dtype; `run` refuses a step whose hidden size, cache or
    window groups do not match the layers."""
    hidden, heads, kv_heads, head_dim, intermediate = 64, 4, 2, 16, 128
    stack = ops.DecodeLayerStack(torch.float32, hidden, heads, kv_heads, head_dim, 1e-5, 0.25, 0)
    norm = torch.ones(hidden)
    qkv_rows = (heads + 2 * kv_heads) * head_dim
    dense = {
        "qkv": torch.zeros(qkv_rows, hidden),
        "qkv_bias": None,
        "o": torch.zeros(hidden, heads * head_dim),
        "o_bias": None,
        "gate_up": torch.zeros(2 * intermediate, hidden),
        "gate_up_bias": None,
        "down": torch.zeros(hidden, intermediate),
        "down_bias": None,
    }
    with pytest.raises(RuntimeError, match="qkv must be contiguous"):
        stack.add_dense_layer(
            norm,
            norm,
            None,
            None,
            **{**dense, "qkv": torch.zeros(qkv_rows + 1, hidden)},
            window_group=0,
        )
    with pytest.raises(RuntimeError, match="post_norm must have dtype"):
        stack.add_dense_layer(norm, norm.bfloat16(), None, None, **dense, window_group=0)
    with pytest.raises(RuntimeError, match="numbered in order"):
        stack.add_dense_layer(norm, norm, None, None, **dense, window_group=1)
    stack.add_dense_layer(norm, norm, None, None, **dense, window_group=0)
    assert stack.num_layers == 1
    rows, blocks, block_size = 2, 4, 4
    kv_cache = torch.zeros(1, 2, kv_heads, blocks, block_size, head_dim)
    step = {
        "cos": torch.ones(rows, 1, head_dim // 2),
        "sin": torch.zeros(rows, 1, head_dim // 2),
        "kv_cache": kv_cache,
        "slot_mapping": torch.tensor([0, 4]),
        "block_tables": [torch.tensor([[0], [1]], dtype=torch.int32)],
        "seq_lens": [torch.tensor([1, 1], dtype=torch.int32)],
        "windows": [0],
    }
    out, residual = stack.run(torch.ones(rows, hidden), **step)
    assert out.shape == residual.shape == (rows, hidden)
    torch.testing.assert_close(
        residual, torch.ones(rows, hidden)
    )  # zero o weights: the stream unchanged
    with pytest.raises(RuntimeError, match=rf"hidden must be contiguous \[rows, {hidden}\]"):
        stack.run(torch.ones(rows, hidden + 1), **step)
    with pytest.raises(RuntimeError, match="one entry per window group"):
        stack.run(torch.ones(rows, hidden), **{**step, "windows": [0, 8]})
    with pytest.raises(RuntimeError, match="kv_cache must be contiguous"):
        stack.run(torch.ones(rows, hidden), **{**step, "kv_cache": kv_cache[..., :8].contiguous()})
    with pytest.raises(RuntimeError, match="slot_mapping has a slot outside"):
        stack.run(torch.ones(rows, hidden), **{**step, "slot_mapping": torch.tensor([0, 99])})


def test_swapping_the_kernel_module_builds_the_stack_again(
    ops: ModuleType, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A/B measurements of two kernel builds swap `FusedDecodeLayers._ops`: the next step must run a stack of the
    swapped-in module, not the one the first module built."""
    model = _load(checkpoints, tmp_path, "qwen2-bf16/int8")
    first_logits, _ = _drive_once(model)
    first_stack = model.fused_decode._stack
    other_build = SimpleNamespace(**vars(ops))  # stands for another build: another module object
    model.fused_decode._ops = other_build
    second_logits, num_fused = _drive_once(model)
    assert num_fused >= 10
    assert model.fused_decode._stack is not first_stack
    assert model.fused_decode._stack_ops is other_build
    for step, (first, second) in enumerate(zip(first_logits, second_logits, strict=True)):
        assert torch.equal(first, second), f"step {step}"
