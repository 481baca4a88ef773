"""Writing GGUF files from kvflow / Hugging Face checkpoint folders (`tools/convert_to_gguf.py`; tests and
benchmarks make their files with it too).

`write_gguf(checkpoint_dir, out_path, tensor_type=...)` writes what llama.cpp's own converter writes for the Llama
family (`llama`, which also covers Mistral, `qwen2`, `qwen3`), Gemma 2 (`gemma2`), Gemma 3 text (`gemma3`) and
Phi-3 (`phi3`): the architecture's metadata, every tensor under llama.cpp's name (`kvflow.models.quantization.
gguf_file.layer_names` read backwards), and the tokenizer; `kvflow.models.quantization.gguf_file` reads it back.

* Matrices are stored as `tensor_type` says: a type name (`F32`, `F16`, `BF16`, `Q8_0`, `Q4_0`, `Q5_0`, `Q4_K`,
  `Q5_K`, `Q6_K`) for every matrix, `"Q4_K_M"` for llama.cpp's mix (see `q4_k_m_type`), or a function `(gguf name,
  (rows, columns)) -> type`. Quantized blocks come from `kvflow.models.quantization.ggml_quantize.quantize`
  (gguf-py's quantizer for Q8_0 / Q4_0 / Q5_0, kvflow's NumPy one for the K-quants). 1-D tensors (norms, biases)
  are float32, as llama.cpp's converter stores them.
* `llama` q/k rows are permuted from Hugging Face's half-split rotary layout to llama.cpp's interleaved one; Llama 3
  rope scaling is written as llama.cpp does, a `rope_freqs.weight` tensor of per-frequency divisors.
* Gemma: every RMSNorm weight is stored plus 1 (llama.cpp's norm multiplies by the weight), the soft-caps, the
  sliding window (and `attention.sliding_window_pattern` as a per-layer list where the layers differ from
  llama.cpp's default pattern), Gemma 3's local RoPE base (`rope.freq_base_swa`) and linear scaling; the head is
  the embedding. llama.cpp derives the attention scale from the head size (see `gguf_file`): a checkpoint whose
  `query_pre_attn_scalar` differs is refused rather than written to load differently.
* Phi-3: the fused `qkv_proj` / `gate_up_proj` tensors as `attn_qkv` / `ffn_up`; LongRoPE as `rope_factors_long` /
  `rope_factors_short` tensors with the original context length and the attention factor.
* Mixture of experts (Mixtral as `llama`, `qwen2moe`, `qwen3moe`): each layer's per-expert tensors stacked into
  llama.cpp's `[experts, rows, columns]` `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, the router
  (`ffn_gate_inp`) and Qwen2-MoE's shared-expert gate kept float32 as llama.cpp keeps them, the expert counts and
  sizes. llama.cpp renormalises the top-k weights of Qwen3-MoE and never of Qwen2-MoE: a checkpoint whose
  `norm_topk_prob` says otherwise is refused.
* The tokenizer, as llama.cpp's converter writes it (`tokenizer.ggml.*`: model "gpt2" for byte-level BPE, "llama"
  for sentencepiece-style vocabularies, the special token ids, `add_bos_token`, the chat template; see
  `kvflow.models.quantization.gguf_tokenizer`), and the whole tokenizer.json (`tokenizer.huggingface.json`, which
  kvflow reads when no tokenizer folder is given) unless `embed_hf_tokenizer=False`: the files serve alone. A
  checkpoint without tokenizer.json gets model "none" (enough for llama-bench, not for text).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from kvflow.models.hf_config import (
    SLIDING_ATTENTION,
    TransformerConfig,
    parse_hf_config,
    rope_settings,
)
from kvflow.models.layers.rotary import rope_inverse_frequencies
from kvflow.models.quantization.ggml_quantize import quantize
from kvflow.models.quantization.gguf_file import (
    GEMMA_ARCHITECTURES,
    GGUF_GLOBAL_NAMES,
    ROPE_FACTORS_LONG,
    ROPE_FACTORS_SHORT,
    expert_names,
    gemma_query_pre_attn_scalar,
    gemma_sliding_layers,
    layer_names,
)
from kvflow.models.quantization.gguf_tokenizer import (  # noqa: F401 (detect_tokenizer_pre: re-exported)
    HF_TOKENIZER_KEY,
    detect_tokenizer_pre,
    ggml_vocabulary,
)

logger = logging.getLogger(__name__)

# config.json model_type -> GGUF general.architecture.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
}
# Tensors llama.cpp keeps in float32 whatever the file type (its converter's and llama-quantize's rule).
_FLOAT32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
# The Llama-family architectures (rope scaling as llama.cpp's `rope_freqs`).
_LLAMA_FAMILY = frozenset({"llama", "qwen2", "qwen3"})
GLOBAL_TENSOR_NAMES = {hf: name for name, hf in GGUF_GLOBAL_NAMES.items()}
_LAYER_PATTERN = re.compile(r"model\.layers\.(\d+)\.(.+)")
# llama.cpp's Q4_K_M falls back to Q5_0 / Q8_0 where a row is not a whole number of 256-element blocks. kvflow's
# files take Q4_0 there: kvflow reads Q5_0 but holds it as Q8_0 (gguf_plan), 1.55x its bytes, and the default
# model's 384-wide rows would then be mostly Q8_0 in memory. `LLAMA_CPP_K_QUANT_FALLBACK` writes llama.cpp's mix.
_K_QUANT_FALLBACK = {"Q4_K": "Q4_0", "Q6_K": "Q8_0"}
LLAMA_CPP_K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
TensorType = str | Callable[[str, tuple[int, int]], str]


def gguf_tensor_name(hf_name: str, architecture: str = "llama") -> str | None:
    """llama.cpp's name for a Hugging Face parameter of a GGUF `architecture`; None for tensors llama.cpp does not
    load (rotary caches)."""
    if hf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[hf_name]
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    names = {hf: name for name, hf in layer_names(architecture).items()}
    match = _LAYER_PATTERN.fullmatch(hf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(
            f"tensor {hf_name!r} has no llama.cpp name (not a parameter of a {architecture} model)"
        )
    layer, rest = match.groups()
    return f"blk.{layer}.{names[rest]}"


def expert_slot(hf_name: str, architecture: str) -> tuple[str, int] | None:
    """(llama.cpp's stacked tensor name, expert index) of one expert's Hugging Face tensor; None for any other."""
    match = _LAYER_PATTERN.fullmatch(hf_name)
    if match is None:
        return None
    layer, rest = match.groups()
    for name, pattern in expert_names(architecture).items():
        before, _, after = pattern.partition("{expert}")
        index = rest.removeprefix(before).removesuffix(after)
        if rest.startswith(before) and rest.endswith(after) and index.isdigit():
            return f"blk.{layer}.{name}", int(index)
    return None


class _ExpertStacker:
    """Collects each layer's per-expert tensors and hands back a stacked `[experts, rows, columns]` tensor once every
    expert of it has arrived (checkpoints store experts in any order, possibly across files)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.pending: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, name: str, expert: int, tensor: torch.Tensor) -> torch.Tensor | None:
        experts = self.pending.setdefault(name, {})
        experts[expert] = tensor
        if len(experts) < self.num_experts:
            return None
        del self.pending[name]
        return torch.stack([experts[index] for index in range(self.num_experts)])

    def check_done(self) -> None:
        if self.pending:
            name, experts = next(iter(self.pending.items()))
            raise ValueError(
                f"{name}: the checkpoint has {len(experts)} of {self.num_experts} experts"
            )


def permute_for_interleaved_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows (or bias entries) from Hugging Face's rotary layout (first half, second half) to
    llama.cpp's `llama` layout (pairs of adjacent rows), as llama.cpp's converter does."""
    head_rows = weight.shape[0] // num_heads
    return (
        weight.reshape(num_heads, 2, head_rows // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def q4_k_m_type(
    num_layers: int, fallback: dict[str, str] | None = None
) -> Callable[[str, tuple[int, int]], str]:
    """llama.cpp's Q4_K_M mix: Q6_K for the output matrix (the token embedding when tied) and for attn_v and ffn_down
    in the layers llama.cpp gives more bits (the first and last eighth, and every third between), Q4_K elsewhere;
    each falls back (`fallback`, default `_K_QUANT_FALLBACK`) where the row length is not a multiple of 256."""
    fallback = fallback or _K_QUANT_FALLBACK

    def more_bits(layer: int) -> bool:
        return (
            layer < num_layers // 8
            or layer >= 7 * num_layers // 8
            or (layer - num_layers // 8) % 3 == 2
        )

    def choose(name: str, shape: tuple[int, int]) -> str:
        qtype = "Q4_K"
        if name == "output.weight":
            qtype = "Q6_K"
        elif name.startswith("blk.") and name.endswith(("attn_v.weight", "ffn_down.weight")):
            qtype = "Q6_K" if more_bits(int(name.split(".")[1])) else "Q4_K"
        return qtype if shape[1] % 256 == 0 else fallback[qtype]

    return choose


def _type_chooser(
    tensor_type: TensorType, num_layers: int, tied: bool
) -> Callable[[str, tuple[int, int]], str]:
    """`tensor_type` as a function of (gguf name, shape); under Q4_K_M a tied embedding is the output matrix."""
    if callable(tensor_type):
        return tensor_type
    if tensor_type != "Q4_K_M":
        return lambda name, shape: tensor_type
    mix = q4_k_m_type(num_layers)

    def choose(name: str, shape: tuple[int, int]) -> str:
        return mix("output.weight" if tied and name == "token_embd.weight" else name, shape)

    return choose


def iterate_checkpoint(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every *.safetensors file of the checkpoint, one at a time."""
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {checkpoint_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is no dict)
                yield name, reader.get_tensor(name)


def _encode(tensor: torch.Tensor, qtype: str, gguf: Any) -> tuple[np.ndarray, Any]:
    """(array, raw GGML type or None for float32) of a tensor in `qtype` (a stacked `[experts, rows, columns]`
    tensor quantized row by row, as a matrix is)."""
    if tensor.dim() <= 1 or qtype == "F32":
        return tensor.to(torch.float32).contiguous().numpy(), None
    if qtype == "BF16":
        bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view("uint16")
        return bits, gguf.GGMLQuantizationType.BF16
    if qtype == "F16":  # a float16 array carries its own type
        return tensor.to(torch.float16).contiguous().numpy(), None
    matrix = tensor.to(torch.float32).contiguous().reshape(-1, tensor.shape[-1]).numpy()
    blocks = quantize(qtype, matrix)
    return blocks.reshape(*tensor.shape[:-1], -1), gguf.GGMLQuantizationType[qtype]


def write_tokenizer(
    writer: Any,
    gguf: Any,
    checkpoint_dir: Path,
    config: dict[str, Any],
    tokenizer_pre: str | None,
    embed_hf_tokenizer: bool = True,
) -> None:
    """llama.cpp's `tokenizer.ggml.*` keys and the chat template from the checkpoint's tokenizer files (see
    `kvflow.models.quantization.gguf_tokenizer`), tokenizer.json whole as `tokenizer.huggingface.json` when
    `embed_hf_tokenizer`; a placeholder vocabulary without tokenizer.json."""
    tokenizer_path = checkpoint_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        logger.warning("no tokenizer.json: writing a placeholder vocabulary (llama-bench only)")
        writer.add_tokenizer_model("none")
        return
    text = tokenizer_path.read_text(encoding="utf-8")
    tokenizer_config_path = checkpoint_dir / "tokenizer_config.json"
    tokenizer_config = (
        json.loads(tokenizer_config_path.read_text()) if tokenizer_config_path.is_file() else {}
    )
    keys = ggml_vocabulary(
        json.loads(text), tokenizer_config, config, int(config["vocab_size"]), tokenizer_pre
    )
    writer.add_tokenizer_model(keys["model"])
    if "pre" in keys:
        writer.add_tokenizer_pre(keys["pre"])
    writer.add_token_list(keys["tokens"])
    writer.add_token_types([gguf.TokenType(kind) for kind in keys["token_type"]])
    if "merges" in keys:
        writer.add_token_merges(keys["merges"])
    if "scores" in keys:
        writer.add_token_scores(keys["scores"])
    for name in ("bos", "eos", "padding", "unknown"):
        if f"{name}_token_id" in keys:
            writer.add_uint32(f"tokenizer.ggml.{name}_token_id", keys[f"{name}_token_id"])
    for name in ("add_bos_token", "add_eos_token"):
        if name in keys:
            writer.add_bool(f"tokenizer.ggml.{name}", keys[name])
    chat_template = tokenizer_config.get("chat_template")
    template_file = checkpoint_dir / "chat_template.jinja"
    if not isinstance(chat_template, str) and template_file.is_file():
        chat_template = template_file.read_text(encoding="utf-8")
    if isinstance(chat_template, str):
        writer.add_chat_template(chat_template)
    if embed_hf_tokenizer:
        writer.add_string(HF_TOKENIZER_KEY, text)


def _llama3_rope_freqs(config: dict[str, Any], head_dim: int) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` for Llama 3 scaling (plain inverse frequencies / scaled ones); None without
    scaling; ValueError for a scaling llama.cpp's `llama` files do not express. Reads either spelling of the RoPE
    keys (transformers 4's `rope_scaling`, 5's `rope_parameters`)."""
    theta, scaling = rope_settings(config)
    if scaling is None:
        return None
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"rope_scaling {scaling} is not supported by this converter")
    plain = rope_inverse_frequencies(head_dim, theta, None)
    scaled = rope_inverse_frequencies(head_dim, theta, scaling)
    return (plain / scaled).numpy().astype(np.float32)


def write_hparams(
    writer: Any,
    gguf: Any,
    config: dict[str, Any],
    file_type: Any,
    rope_theta: float | None = None,
    rotary_dim: int | None = None,
) -> None:
    """The architecture block: what llama.cpp's loader reads to shape the graph (`rope_theta`: the full-attention
    layers' base where config.json's RoPE keys are per layer type, as Gemma 3's are; `rotary_dim`: the rotated
    dims of each head under partial rotary, else the head size)."""
    num_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // num_heads)
    writer.add_name(config.get("_name_or_path") or config["model_type"])
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_context_length(int(config.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or num_heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim if rotary_dim is None else rotary_dim)
    writer.add_rope_freq_base(rope_settings(config)[0] if rope_theta is None else rope_theta)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_file_type(int(file_type))


def write_gemma_hparams(writer: Any, gguf: Any, arch: str, parsed: TransformerConfig) -> None:
    """Gemma 2 / 3's keys past the common block (see the module docstring); ValueError for what llama.cpp's Gemma
    files cannot say."""
    expected = gemma_query_pre_attn_scalar(
        arch,
        parsed.num_hidden_layers,
        parsed.hidden_size,
        parsed.num_attention_heads,
        parsed.head_dim,
    )
    if parsed.query_pre_attn_scalar is not None and parsed.query_pre_attn_scalar != expected:
        raise ValueError(
            f"query_pre_attn_scalar {parsed.query_pre_attn_scalar:g}: llama.cpp's {arch} scales attention by "
            f"{expected} ** -0.5 (it derives the scale from the head size), so this file would load differently"
        )
    if parsed.attn_logit_softcapping is not None:
        if arch == "gemma3":
            raise ValueError("attn_logit_softcapping: llama.cpp's gemma3 has no attention soft-cap")
        writer.add_attn_logit_softcapping(parsed.attn_logit_softcapping)
    if parsed.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(parsed.final_logit_softcapping)
    sliding = [layer_type == SLIDING_ATTENTION for layer_type in parsed.layer_types]
    if parsed.sliding_window is not None:
        writer.add_sliding_window(parsed.sliding_window)
    if sliding != gemma_sliding_layers(arch, parsed.num_hidden_layers, bool(parsed.sliding_window)):
        writer.add_sliding_window_pattern(sliding)
    scaling = parsed.rope_scaling
    if arch == "gemma3":
        if parsed.sliding_rope_theta is not None:
            writer.add_rope_freq_base_swa(parsed.sliding_rope_theta)
        if scaling is not None and scaling["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(scaling["factor"]))
            scaling = None
    if scaling is not None:
        raise ValueError(f"rope_scaling {scaling} is not written for {arch} files")


def write_expert_hparams(writer: Any, arch: str, parsed: TransformerConfig) -> None:
    """The mixture-of-experts keys (nothing for a dense model); ValueError for a routing llama.cpp's graph does not
    compute."""
    if not parsed.num_experts:
        return
    writer.add_expert_count(parsed.num_experts)
    writer.add_expert_used_count(parsed.num_experts_per_tok)
    if arch == "llama":
        return
    renormalised = arch == "qwen3moe"
    if parsed.norm_topk_prob != renormalised:
        raise ValueError(
            f"norm_topk_prob {parsed.norm_topk_prob}: llama.cpp's {arch} "
            f"{'always' if renormalised else 'never'} renormalises the top-k expert weights"
        )
    writer.add_expert_feed_forward_length(parsed.moe_intermediate_size)
    if parsed.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(parsed.shared_expert_intermediate_size)


def write_phi3_hparams(
    writer: Any, gguf: Any, config: dict[str, Any], parsed: TransformerConfig
) -> None:
    """Phi-3's keys past the common block and its LongRoPE factor tensors (as llama.cpp's converter writes them)."""
    scaling = parsed.rope_scaling or {}
    original = int(
        scaling.get("original_max_position_embeddings")
        or config.get("original_max_position_embeddings")
        or parsed.max_position_embeddings
    )
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(parsed.sliding_window or 0)
    rope_type = scaling.get("rope_type", "default")
    if (
        rope_type == "default"
    ):  # plain RoPE, on the whole head or (Phi-4-mini) its first rotary dims
        return
    if rope_type not in ("longrope", "su"):
        raise ValueError(f"rope_scaling {scaling} is not written for phi3 files")
    scale = parsed.max_position_embeddings / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    attention_factor = scaling.get("attention_factor")
    writer.add_rope_scaling_attn_factors(default if attention_factor is None else attention_factor)
    writer.add_tensor(ROPE_FACTORS_LONG, np.asarray(scaling["long_factor"], dtype=np.float32))
    writer.add_tensor(ROPE_FACTORS_SHORT, np.asarray(scaling["short_factor"], dtype=np.float32))


_FILE_TYPES = {
    "F32": "ALL_F32",
    "F16": "MOSTLY_F16",
    "BF16": "MOSTLY_BF16",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q5_0": "MOSTLY_Q5_0",
    "Q5_K": "MOSTLY_Q5_K_S",
    "Q4_K": "MOSTLY_Q4_K_S",
    "Q6_K": "MOSTLY_Q6_K",
    "Q4_K_M": "MOSTLY_Q4_K_M",
}


def write_gguf(
    checkpoint_dir: str | Path,
    out_path: str | Path,
    tensor_type: TensorType = "BF16",
    *,
    tokenizer_pre: str | None = None,
    embed_hf_tokenizer: bool = True,
) -> Path:
    """Write `out_path` from `checkpoint_dir` (see the module docstring); returns `out_path`. Raises ValueError
    naming the field or tensor that cannot be written."""
    import gguf

    checkpoint_dir, out_path = Path(checkpoint_dir), Path(out_path)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[model_type]
    parsed = parse_hf_config(config)
    tied = parsed.tie_word_embeddings
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // num_heads)
    choose = _type_chooser(tensor_type, int(config["num_hidden_layers"]), tied)
    file_type_name = tensor_type if isinstance(tensor_type, str) else "F32"
    rope_freqs = _llama3_rope_freqs(config, head_dim) if arch in _LLAMA_FAMILY else None
    if rope_freqs is not None and arch != "llama":
        raise ValueError(f"rope_scaling is only written for llama files, not {arch}")

    writer = gguf.GGUFWriter(str(out_path), arch)
    file_type = gguf.LlamaFileType[_FILE_TYPES[file_type_name]]
    partial = float((parsed.rope_scaling or {}).get("partial_rotary_factor", 1.0))
    write_hparams(
        writer, gguf, config, file_type, parsed.rope_theta, int(parsed.head_dim * partial)
    )
    if arch in GEMMA_ARCHITECTURES:
        write_gemma_hparams(writer, gguf, arch, parsed)
    elif arch == "phi3":
        write_phi3_hparams(writer, gguf, config, parsed)
    write_expert_hparams(writer, arch, parsed)
    write_tokenizer(writer, gguf, checkpoint_dir, config, tokenizer_pre, embed_hf_tokenizer)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    experts = _ExpertStacker(parsed.num_experts)
    for hf_name, tensor in iterate_checkpoint(checkpoint_dir):
        slot = expert_slot(hf_name, arch)
        if slot is not None:
            stacked = experts.add(slot[0], slot[1], tensor)
            if stacked is not None:
                rows, columns = stacked.shape[1:]
                array, raw_dtype = _encode(stacked, choose(slot[0], (rows, columns)), gguf)
                writer.add_tensor(slot[0], array, raw_dtype=raw_dtype)
            continue
        name = gguf_tensor_name(hf_name, arch)
        if name is None or (tied and name == "output.weight"):
            continue
        if arch in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            tensor = (
                tensor.to(torch.float32) + 1.0
            )  # llama.cpp's Gemma norm multiplies by the weight
        if arch == "llama" and ".attn_q." in name:
            tensor = permute_for_interleaved_rope(tensor, num_heads)
        elif arch == "llama" and ".attn_k." in name and "_norm" not in name:
            tensor = permute_for_interleaved_rope(tensor, num_kv_heads)
        qtype = "F32"
        if tensor.dim() == 2 and not name.endswith(_FLOAT32_TENSORS):
            qtype = choose(name, tuple(tensor.shape))  # type: ignore[arg-type]
        array, raw_dtype = _encode(tensor, qtype, gguf)
        writer.add_tensor(
            name, array, raw_dtype=raw_dtype
        )  # a quantized byte shape is converted by gguf
    experts.check_done()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
