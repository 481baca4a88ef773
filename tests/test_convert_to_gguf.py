"""tools/convert_to_gguf.py: kvflow checkpoints written as llama.cpp reads them, read back with gguf's own reader.

The converter needs the `gguf` package (in the dev extra, so CI has it). Checked: metadata,
llama.cpp's tensor names and types, the q/k row order llama.cpp's `llama` rotary layout expects (and `qwen2`'s
unchanged), tied embeddings written once, and the byte-level BPE vocabulary from the default model's tokenizer.json
(tests/test_gguf_tokenizer.py checks the tokenizer keys further).
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import load_file

from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO / "kvflow" / "default_model" / "checkpoint"
LAYER_TENSORS = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)


def load_converter():  # type: ignore[no-untyped-def]
    return importlib.import_module("tools.convert_to_gguf")


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata by key, tensors by name as (GGML type name, torch tensor in PyTorch's dimension order))."""
    reader = gguf.GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {}
    for tensor in reader.tensors:
        shape = tuple(reversed([int(dim) for dim in tensor.shape]))
        if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
            data = torch.frombuffer(bytearray(tensor.data.tobytes()), dtype=torch.bfloat16)
        else:
            data = torch.from_numpy(tensor.data.copy()).flatten()
        tensors[tensor.name] = (tensor.tensor_type.name, data.reshape(shape))
    return fields, tensors


def test_llama_metadata_names_types_and_rotary_row_order(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "llama", "llama")  # untied, float32
    out = load_converter().convert(checkpoint, tmp_path / "llama.gguf")
    fields, tensors = read_gguf(out)
    assert fields["general.architecture"] == "llama"
    expected_metadata = {
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.context_length": 1024,
        "llama.rope.dimension_count": 16,
        "llama.vocab_size": 384,
    }
    assert {key: fields[key] for key in expected_metadata} == expected_metadata
    assert fields["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert (
        fields["tokenizer.ggml.model"] == "none"
    )  # no tokenizer.json: llama-bench-only vocabulary
    expected_names = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{layer}.{name}" for layer in range(2) for name in LAYER_TENSORS
    }
    assert set(tensors) == expected_names
    for name, (type_name, data) in tensors.items():
        assert type_name == ("BF16" if data.dim() == 2 else "F32"), name

    original = load_file(str(checkpoint / "model.safetensors"))
    head_dim = 16
    for gguf_name, hf_name, num_heads in (
        ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", 4),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", 2),
    ):
        converted = tensors[gguf_name][1].reshape(num_heads, head_dim, -1)
        source = original[hf_name].to(torch.bfloat16).reshape(num_heads, head_dim, -1)
        half = head_dim // 2
        # llama.cpp rotates adjacent row pairs (2i, 2i+1); Hugging Face rotates rows i and i + head_dim / 2.
        assert torch.equal(converted[:, 0::2], source[:, :half])
        assert torch.equal(converted[:, 1::2], source[:, half:])
    assert torch.equal(
        tensors["blk.0.attn_v.weight"][1],
        original["model.layers.0.self_attn.v_proj.weight"].to(torch.bfloat16),
    )
    assert torch.equal(tensors["output.weight"][1], original["lm_head.weight"].to(torch.bfloat16))


def test_qwen2_keeps_rows_writes_biases_ties_embeddings_and_the_bpe_vocabulary(
    tmp_path: Path,
) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_CHECKPOINT / name, checkpoint / name)
    out = load_converter().convert(checkpoint, tmp_path / "qwen2.gguf", dtype="f32")
    fields, tensors = read_gguf(out)
    assert fields["general.architecture"] == "qwen2"
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    original = load_file(str(checkpoint / "model.safetensors"))
    for projection in ("q", "k", "v"):
        for kind in ("weight", "bias"):
            type_name, data = tensors[f"blk.0.attn_{projection}.{kind}"]
            assert type_name == "F32"
            assert torch.equal(data, original[f"model.layers.0.self_attn.{projection}_proj.{kind}"])

    tokenizer = json.loads((DEFAULT_CHECKPOINT / "tokenizer.json").read_text())
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 4096
    assert all(tokens[index] == text for text, index in tokenizer["model"]["vocab"].items())
    assert tokens[4092] == "<|begin_of_text|>"
    types = fields["tokenizer.ggml.token_type"]
    assert types[4092] == gguf.TokenType.CONTROL and types[0] == gguf.TokenType.NORMAL
    merges = fields["tokenizer.ggml.merges"]
    assert merges[:2] == [" ".join(pair) for pair in tokenizer["model"]["merges"][:2]]
    assert len(merges) == len(tokenizer["model"]["merges"])
    # tokenizer_config.json's tokens before config.json's ids (1 and 2 here), as llama.cpp's converter reads them.
    assert tokens[fields["tokenizer.ggml.bos_token_id"]] == "<|begin_of_text|>"
    assert tokens[fields["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert (
        fields["tokenizer.huggingface.json"] == (DEFAULT_CHECKPOINT / "tokenizer.json").read_text()
    )


def test_unsupported_checkpoints_are_refused_naming_the_field(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "llama", "llama")
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "model_type": "starcoder2"}))
    with pytest.raises(ValueError, match="model_type 'starcoder2'"):
        load_converter().convert(checkpoint, tmp_path / "starcoder2.gguf")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    config.pop("rope_parameters", None)  # transformers 5's spelling would take precedence
    config_file.write_text(json.dumps({**config, "rope_scaling": yarn}))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_converter().convert(checkpoint, tmp_path / "yarn.gguf")
