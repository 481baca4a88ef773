"""Convert a kvflow Llama / Qwen2 checkpoint (safetensors, config.json, tokenizer.json) to GGUF for llama.cpp.

Usage: `python tools/convert_to_gguf.py CHECKPOINT_DIR OUT.gguf [--dtype bf16|f32] [--tokenizer-pre NAME]`

This exists for `benchmarks/latency.py`'s comparison with llama.cpp on the same weights; it is not part of kvflow and
needs the optional `gguf` package (`pip install gguf`). It writes:
  * the architecture's metadata (`llama` or `qwen2`: context length, embedding length, block count, feed-forward
    length, head counts, key/value length, rope dimension and frequency base, RMS-norm epsilon, file type);
  * every tensor under llama.cpp's name (`token_embd`, `blk.N.attn_q/k/v` (+ biases), `attn_output`, `attn_norm`,
    `ffn_gate/up/down`, `ffn_norm`, `output_norm`, and `output` only when the embeddings are untied). Matrices are
    stored in `--dtype` (bf16 by default, as kvflow runs the benchmark); norms and biases in float32, as llama.cpp's
    own converter stores 1-D tensors. For `llama`, q/k rows are permuted from Hugging Face's half-split rotary layout
    to llama.cpp's interleaved one (llama.cpp runs `qwen2` with the half-split layout, so its q/k stay as they are);
  * the tokenizer from tokenizer.json (byte-level BPE only: `tokenizer.ggml.model` "gpt2", tokens, token types,
    merges, bos / eos / pad ids, add-bos flag). A checkpoint without tokenizer.json (such as the random-weight
    benchmark checkpoints) gets `tokenizer.ggml.model` "none" with `vocab_size` placeholder tokens, which is enough
    for `llama-bench`, not for text generation.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

logger = logging.getLogger("convert_to_gguf")

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
# Hugging Face parameter name (inside `model.layers.N.`) -> llama.cpp tensor name (inside `blk.N.`).
LAYER_TENSOR_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_TENSOR_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_PATTERN = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as error:  # the converter's only optional dependency
        raise SystemExit(
            "tools/convert_to_gguf.py needs the 'gguf' package (llama.cpp's GGUF writer): pip install gguf"
        ) from error
    return gguf


def gguf_tensor_name(hf_name: str) -> str | None:
    """llama.cpp's name for a Hugging Face parameter; None for tensors llama.cpp does not load (rotary caches)."""
    if hf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[hf_name]
    match = _LAYER_PATTERN.fullmatch(hf_name)
    if match is None:
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        raise ValueError(
            f"tensor {hf_name!r} has no llama.cpp name (not a Llama / Qwen2 parameter)"
        )
    layer, rest = match.groups()
    if rest.endswith("rotary_emb.inv_freq"):
        return None
    if rest not in LAYER_TENSOR_NAMES:
        raise ValueError(
            f"tensor {hf_name!r} has no llama.cpp name (not a Llama / Qwen2 parameter)"
        )
    return f"blk.{layer}.{LAYER_TENSOR_NAMES[rest]}"


def permute_for_interleaved_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows (or bias entries) from Hugging Face's rotary layout (first half, second half) to
    llama.cpp's `llama` layout (pairs of adjacent rows), as llama.cpp's converter does."""
    head_rows = weight.shape[0] // num_heads
    return (
        weight.reshape(num_heads, 2, head_rows // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def iterate_checkpoint(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every *.safetensors file of the checkpoint, one at a time."""
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {checkpoint_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is no dict)
                yield name, reader.get_tensor(name)


def _numpy_for_gguf(tensor: torch.Tensor, dtype: str, gguf: Any) -> tuple[Any, Any]:
    """(array, raw GGML type or None): matrices in `dtype`, 1-D tensors (norms, biases) in float32."""
    if tensor.dim() <= 1 or dtype == "f32":
        return tensor.to(torch.float32).contiguous().numpy(), None
    bf16_bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view("uint16")
    return bf16_bits, gguf.GGMLQuantizationType.BF16


def detect_tokenizer_pre(tokenizer: dict[str, Any]) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer.json: GPT-2's regex split ('gpt-2') is the one
    recognised; others need --tokenizer-pre (see llama.cpp's src/llama-vocab.cpp for the names)."""
    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    raise ValueError(
        f"unrecognised pre_tokenizer {json.dumps(pre)[:200]}; pass --tokenizer-pre (e.g. qwen2, llama-bpe)"
    )


def write_tokenizer(
    writer: Any,
    gguf: Any,
    checkpoint_dir: Path,
    config: dict[str, Any],
    tokenizer_pre: str | None,
) -> None:
    """The vocabulary from tokenizer.json (byte-level BPE), or a placeholder vocabulary without one."""
    vocab_size = int(config["vocab_size"])
    tokenizer_path = checkpoint_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        logger.warning("no tokenizer.json: writing a placeholder vocabulary (llama-bench only)")
        writer.add_tokenizer_model("none")
        return
    tokenizer = json.loads(tokenizer_path.read_text())
    model = tokenizer["model"]
    if model.get("type") != "BPE":
        raise ValueError(
            f"tokenizer.json model.type is {model.get('type')!r}; only BPE is supported"
        )
    tokens = [f"[PAD{index}]" for index in range(vocab_size)]
    token_types = [gguf.TokenType.UNUSED] * vocab_size
    for text, index in model["vocab"].items():
        tokens[index], token_types[index] = text, gguf.TokenType.NORMAL
    for added in tokenizer.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        special = added.get("special", False)
        token_types[added["id"]] = (
            gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
        )
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre or detect_tokenizer_pre(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("pad_token_id", writer.add_pad_token_id),
    ):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            add(int(value))
    tokenizer_config_path = checkpoint_dir / "tokenizer_config.json"
    if tokenizer_config_path.is_file():
        tokenizer_config = json.loads(tokenizer_config_path.read_text())
        if "add_bos_token" in tokenizer_config:
            writer.add_add_bos_token(bool(tokenizer_config["add_bos_token"]))


def write_hparams(writer: Any, gguf: Any, config: dict[str, Any], dtype: str) -> None:
    """The architecture block: what llama.cpp's loader reads to shape the graph."""
    num_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // num_heads)
    writer.add_name(config.get("_name_or_path") or config["model_type"])
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_context_length(int(config.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads", num_heads)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    file_type = gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bf16" else gguf.LlamaFileType.ALL_F32
    writer.add_file_type(int(file_type))
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope_scaling {scaling} is not supported by this converter")


def convert(
    checkpoint_dir: Path, out_path: Path, dtype: str = "bf16", tokenizer_pre: str | None = None
) -> Path:
    """Write `out_path` from `checkpoint_dir`; returns `out_path`. Raises ValueError naming the field or tensor
    that this converter cannot map."""
    gguf = _import_gguf()
    if dtype not in ("bf16", "f32"):
        raise ValueError(f"dtype must be 'bf16' or 'f32', got {dtype!r}")
    config = json.loads((checkpoint_dir / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[model_type]
    tied = bool(config.get("tie_word_embeddings", False))
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads", num_heads))

    writer = gguf.GGUFWriter(str(out_path), arch)
    write_hparams(writer, gguf, config, dtype)
    write_tokenizer(writer, gguf, checkpoint_dir, config, tokenizer_pre)
    for hf_name, tensor in iterate_checkpoint(checkpoint_dir):
        name = gguf_tensor_name(hf_name)
        if name is None or (tied and name == "output.weight"):
            continue
        if arch == "llama" and ".attn_q." in name:
            tensor = permute_for_interleaved_rope(tensor, num_heads)
        elif arch == "llama" and ".attn_k." in name:
            tensor = permute_for_interleaved_rope(tensor, num_kv_heads)
        array, raw_dtype = _numpy_for_gguf(tensor, dtype, gguf)
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    parser.add_argument(
        "--tokenizer-pre", default=None, help="llama.cpp pre-tokenizer name (auto: gpt-2 regex)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = convert(args.checkpoint_dir, args.out, args.dtype, args.tokenizer_pre)
    print(out)


if __name__ == "__main__":
    sys.exit(main())
