"""`quantization="int8"`: weight-only int8 with one scale per output channel, quantized as each shard loads.

The oracle is the float32 checkpoint whose linear weights are replaced by their int8 round trip (`q * scale` from
`int8_quantize`, per Hugging Face projection: a fused layer quantizes each projection's rows on their own, so the
round trip per projection is exactly what the engine holds): greedy decoding must be equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM
from kvflow.kernels.quant import QUANT_GEMV_MAX_ROWS, int8_quantize
from kvflow.models.loader import load_model
from kvflow.models.quantization.int8 import Int8Head, Int8Linear
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from tests.kernels.quant_static import static_quant_plans  # noqa: F401
from tests.models.greedy import GREEDY, PROMPTS, greedy_tokens

LINEAR_SUFFIXES = tuple(
    f"{name}.weight"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)


def round_trip(weight: torch.Tensor) -> torch.Tensor:
    qweight, scale = int8_quantize(weight)
    return qweight.float() * scale[:, None]


def int8_reference(checkpoint: Path, out: Path, *, head: bool) -> Path:
    """`checkpoint` with its linear weights (and, with `head`, its LM head, untied) replaced by their int8 round
    trip, in float32."""
    out.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    result = {
        name: round_trip(t) if name.endswith(LINEAR_SUFFIXES) else t.float()
        for name, t in tensors.items()
    }
    if head:
        lm_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        result["lm_head.weight"] = round_trip(lm_head)
        config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    save_file(result, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int8_checkpoints")
    return {
        "llama": make_tiny_checkpoint(root / "llama", "llama"),
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2", dtype="bfloat16"),
    }


@pytest.mark.parametrize(("arch", "head"), [("llama", False), ("qwen2", True)])
def test_int8_decodes_like_the_float_model_of_its_round_tripped_weights(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str, head: bool
) -> None:
    """llama float32; qwen2 (biases, tied head) from a bfloat16 checkpoint with the head quantized too. Steps of
    at most `QUANT_GEMV_MAX_ROWS` tokens keep every product weight-only (float activations), where the float model
    of the round-tripped weights is an exact oracle; larger steps quantize activations per row on AVX-512 VNNI CPUs
    (W8A8, checked by the kernel tests and the default model's perplexity bound)."""
    reference = int8_reference(checkpoints[arch], tmp_path / "reference", head=head)
    small_steps = {"max_num_batched_tokens": QUANT_GEMV_MAX_ROWS}
    options = {"dtype": "float32", "quantization": "int8", "quantize_lm_head": head}
    assert greedy_tokens(checkpoints[arch], **options, **small_steps) == greedy_tokens(
        reference, **small_steps
    )


def test_int8_layers_hold_int8_rows_and_a_scale_per_output_channel(
    checkpoints: dict[str, Path],
) -> None:
    model = load_model(checkpoints["qwen2"], quantization="int8")
    float_model = load_model(checkpoints["qwen2"])
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Int8Linear)
    assert qkv.weight.dtype is torch.int8 and qkv.weight_scale.shape == (qkv.weight.shape[0],)
    assert (
        qkv.bias is not None and qkv.bias.dtype is torch.bfloat16
    )  # biases stay in the model dtype
    # Each row within half a quantization step of the checkpoint's (the fused layer's shards on their own scales).
    float_rows = float_model.model.layers[0].self_attn.qkv_proj.weight.float()
    error = (qkv.weight.float() * qkv.weight_scale[:, None] - float_rows).abs()
    assert bool((error <= qkv.weight_scale[:, None] / 2 + 1e-6).all())
    # The embedding and the (tied) head stay in the model dtype unless asked.
    assert model.model.embed_tokens.weight.dtype is torch.bfloat16
    assert model.lm_head.quant_method is None
    linear_bytes = sum(
        module.weight.numel() for module in model.modules() if hasattr(module, "weight_scale")
    )
    float_bytes = sum(
        module.weight.numel() * 2
        for name, module in float_model.named_modules()
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    )
    assert linear_bytes * 2 == float_bytes  # int8: half of bfloat16's bytes


def test_weight_updates_are_quantized_as_they_load(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A state-dict update re-quantizes the rows it brings; an update of the embedding re-quantizes the tied
    int8 head. The result decodes like a model loaded from the updated checkpoint."""
    source = checkpoints["qwen2"]
    tensors = load_file(str(source / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    update = {
        name: (torch.randn(tensors[name].shape, generator=generator) * 0.2).to(torch.bfloat16)
        for name in ("model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight")
    }
    updated = tmp_path / "updated"
    updated.mkdir()
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (updated / file.name).write_bytes(file.read_bytes())
    save_file({**tensors, **update}, str(updated / "model.safetensors"))
    options = {"quantization": "int8", "quantize_lm_head": True}
    llm = LLM(str(source), skip_tokenizer_init=True, disable_log_stats=True, **options)
    try:
        llm.pause_generation()
        llm.update_weights(update)
        llm.resume_generation()
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        got = [list(output.outputs[0].token_ids) for output in outputs]
        head = llm.run_in_engine(
            lambda core: type(core.executor.worker.model.lm_head.quant_method).__name__
        )
    finally:
        llm.shutdown()
    assert head == Int8Head.__name__
    assert got == greedy_tokens(updated, **options)


def test_bad_quantization_options_are_errors_naming_them(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(checkpoints["llama"]), quantization="int4")
    with pytest.raises(ValueError, match="quantize_lm_head applies to quantization='int8'"):
        LLM(str(checkpoints["llama"]), quantize_lm_head=True)
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a \.gguf file"):
        LLM(str(checkpoints["llama"]), quantization="gguf")
