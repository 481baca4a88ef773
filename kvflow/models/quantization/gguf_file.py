"""Reading llama.cpp's GGUF files: the model's configuration, its tensors under Hugging Face names, its tokenizer.

`GGUFCheckpoint(path)` memory-maps the file (the `gguf` package's reader). `hf_config()` is the `TransformerConfig`
the file's metadata describes (architectures `llama`, which also covers Mistral, `qwen2`, `qwen3`, `gemma2`,
`gemma3` and `phi3`); `tensor_infos()` maps each tensor to its Hugging Face name, its type and its `(rows,
columns)` shape, and raises on a type kvflow does not read, naming the tensor and the type; `iterate_weights()`
yields `(Hugging Face name, tensor)`: float tensors (F32, F16, BF16) as torch tensors, quantized ones as
`GGUFTensor`s holding the file's blocks (Q5_0 / Q5_K ones converted to Q8_0 blocks: see `kvflow.models.
quantization.gguf_plan`).

What llama.cpp's converter changed is undone here, so the model sees its Hugging Face checkpoint:
* `llama`: q/k rows are put back from llama.cpp's interleaved rotary layout into Hugging Face's half-split one (a
  permutation of whole rows, so it applies to blocks as it does to floats).
* `gemma2` / `gemma3`: llama.cpp stores every RMSNorm weight with Gemma's `+ 1` added (its norm multiplies by the
  weight); kvflow's `GemmaRMSNorm` multiplies by `1 + weight`, so 1 is subtracted again. The attention scale is not
  in the file: llama.cpp uses `head_dim ** -0.5`, or `(hidden_size / heads) ** -0.5` for the 27B models (46 Gemma 2
  layers, 62 Gemma 3 layers), and so does kvflow (`query_pre_attn_scalar`). Sliding layers follow
  `attention.sliding_window_pattern` (a per-layer list, or every n-th layer full), else llama.cpp's default (every
  2nd layer full for Gemma 2, every 6th for Gemma 3).
* `phi3`: the fused `attn_qkv` and `ffn_up` (gate rows, then up rows) tensors are split by rows into Hugging Face's
  q / k / v and gate / up names (whole rows: blocks split as floats do); LongRoPE's `rope_factors_long` /
  `rope_factors_short` tensors become the config's `long_factor` / `short_factor`; a `rope.dimension_count` below
  the head size (Phi-4-mini) is `partial_rotary_factor`.
* Mixture of experts (`llama` with `expert_count`: Mixtral; `qwen2moe`; `qwen3moe`): each `[experts, rows,
  columns]` tensor (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`) is yielded per expert under its Hugging Face
  name as the file's blocks (`FusedMoE.quantize_experts` keeps them, see `gguf_plan`); the router (`ffn_gate_inp`)
  and Qwen2-MoE's shared-expert gate (`ffn_gate_inp_shexp`) are dequantized to float32 as they load; the shared
  expert (`ffn_*_shexp`) keeps its blocks as any MLP. Layers without a router are dense (`mlp_only_layers`); top-k
  weights are renormalised as llama.cpp's graph does (Mixtral and Qwen3-MoE: yes, Qwen2-MoE: no).

Invariants: a quantized tensor's rows are a whole number of ggml blocks (`kvflow.kernels.quant.GGML_BLOCK_SIZES`).
Name mapping is `layer_names(architecture)` / `GGUF_GLOBAL_NAMES`, shared with the writer (`kvflow.models.
quantization.gguf_writer`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvflow.kernels.quant import GGML_BLOCK_SIZES, dequantize_reference
from kvflow.models.hf_config import TransformerConfig, parse_hf_config
from kvflow.models.quantization import gguf_tokenizer
from kvflow.models.quantization.ggml_quantize import dequantize as dequantize_5_bit
from kvflow.models.quantization.ggml_quantize import to_q8_0

GGUF_SUFFIX = ".gguf"
# general.architecture -> the Hugging Face architecture kvflow builds.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# A `llama` file with experts (`llama.expert_count`) is Mixtral.
_LLAMA_WITH_EXPERTS = "MixtralForCausalLM"
_QWEN_MOE_ARCHITECTURES = frozenset({"qwen2moe", "qwen3moe"})
GEMMA_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
# Architectures whose q/k rows llama.cpp's converter permutes to its interleaved rotary layout.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
QUANTIZED_TYPES = tuple(GGML_BLOCK_SIZES)
# File types kvflow converts when it reads them: the 5-bit ones run as Q8_0 (see gguf_plan's docstring).
CONVERTED_TYPES = {"Q5_0": "Q8_0", "Q5_K": "Q8_0"}
READ_TYPES = (*FLOAT_TYPES, *GGML_BLOCK_SIZES, *CONVERTED_TYPES)
# llama.cpp's tensor names inside `blk.N.` -> the Hugging Face names inside `model.layers.N.`.
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 2 / 3: four norms per layer; llama.cpp's `ffn_norm` is the norm before the MLP.
_GEMMA_LAYER_NAMES = {
    **{name: hf for name, hf in GGUF_LAYER_NAMES.items() if name != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3: the checkpoint's fused q/k/v and gate/up tensors under llama.cpp's `attn_qkv` and `ffn_up`.
_PHI3_LAYER_NAMES = {
    **{name: hf for name, hf in GGUF_LAYER_NAMES.items() if name != "ffn_up.weight"},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# Mixture-of-experts layers: the router, Qwen2-MoE's shared expert and its gate.
_MIXTRAL_LAYER_NAMES = {**GGUF_LAYER_NAMES, "ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
_QWEN_MOE_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# llama.cpp's stacked `[experts, rows, columns]` tensors -> each expert's Hugging Face name (`{expert}`).
_MIXTRAL_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{expert}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{expert}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{expert}.w2.weight",
}
_QWEN_MOE_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
}
# Tensors kvflow holds in float whatever the file's type (parameters outside any `Linear`).
_FLOAT_LOADED = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
# Fused Hugging Face tensors (inside `model.layers.N.`) -> the parts kvflow loads, in row order.
FUSED_PARTS = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = (
    "rope_freqs.weight"  # Llama 3.1+ files: per-frequency divisors instead of scaling metadata
)
ROPE_FACTORS_LONG = "rope_factors_long.weight"  # Phi-3 LongRoPE: the long / short factor lists
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
_ROPE_TENSORS = frozenset({ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT})
# llama.cpp's Gemma attention scale uses hidden_size / heads instead of head_dim for the 27B models, which it
# recognises by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's default sliding pattern: every n-th layer attends fully.
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}


def is_gguf_file(path: str | os.PathLike[str] | None) -> bool:
    """Whether `path` is an existing file named *.gguf."""
    return path is not None and Path(path).suffix == GGUF_SUFFIX and Path(path).is_file()


def layer_names(architecture: str) -> dict[str, str]:
    """llama.cpp's tensor names inside `blk.N.` -> the Hugging Face names inside `model.layers.N.`, for one GGUF
    architecture."""
    if architecture in GEMMA_ARCHITECTURES:
        return _GEMMA_LAYER_NAMES
    if architecture == "phi3":
        return _PHI3_LAYER_NAMES
    if architecture in _QWEN_MOE_ARCHITECTURES:
        return _QWEN_MOE_LAYER_NAMES
    if architecture == "llama":
        return _MIXTRAL_LAYER_NAMES
    return GGUF_LAYER_NAMES


def expert_names(architecture: str) -> dict[str, str]:
    """llama.cpp's stacked expert tensors inside `blk.N.` -> each expert's Hugging Face name inside
    `model.layers.N.` (with `{expert}`); empty for an architecture without experts."""
    if architecture in _QWEN_MOE_ARCHITECTURES:
        return _QWEN_MOE_EXPERT_NAMES
    if architecture == "llama":
        return _MIXTRAL_EXPERT_NAMES
    return {}


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None when kvflow has no parameter for it (a stacked
    expert tensor's name holds `{expert}`)."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    block, _, rest = gguf_name.partition(".")
    if block != "blk":
        return None
    layer, _, suffix = rest.partition(".")
    hf_suffix = layer_names(architecture).get(suffix) or expert_names(architecture).get(suffix)
    if not layer.isdigit() or hf_suffix is None:
        return None
    return f"model.layers.{layer}.{hf_suffix}"


def gemma_query_pre_attn_scalar(
    architecture: str, num_layers: int, hidden_size: int, num_heads: int, head_dim: int
) -> int:
    """The `query_pre_attn_scalar` llama.cpp's Gemma graph uses (its files do not store one): `hidden_size /
    heads` for the 27B models, recognised by their layer count, else `head_dim`."""
    return hidden_size // num_heads if num_layers == _GEMMA_27B_LAYERS[architecture] else head_dim


def gemma_sliding_layers(
    architecture: str, num_layers: int, has_window: bool, pattern: int | list[bool] | None = None
) -> list[bool]:
    """Which layers slide in llama.cpp's Gemma graph: `pattern` (`attention.sliding_window_pattern`: one flag per
    layer, or every n-th layer full), else its default; none without a window (Gemma 3; Gemma 2 always slides)."""
    if not has_window and architecture == "gemma3":
        return [False] * num_layers
    if pattern is None:
        pattern = _GEMMA_SLIDING_PATTERN[architecture]
    if isinstance(pattern, list):
        return [bool(is_sliding) for is_sliding in pattern][:num_layers]
    period = int(pattern)
    return [period == 0 or layer % period < period - 1 for layer in range(num_layers)]


def interleaved_rows_to_half_split(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: `hf_rows = gguf_rows[order]`."""
    head_rows = num_rows // num_heads
    return torch.arange(num_rows).reshape(num_heads, head_rows // 2, 2).transpose(1, 2).reshape(-1)


@dataclass(frozen=True)
class GGUFTensor:
    """A quantized GGUF tensor: `data` is uint8 `[rows, row_bytes]`, each row `columns // block elements` ggml
    blocks of type `qtype`; `shape` is `(rows, columns)` as the model sees it.

    Indexing with `(rows slice)` or `(rows slice, columns slice)` (what tensor-parallel weight loaders pass) cuts
    whole rows, or columns on block boundaries (ValueError naming the type otherwise)."""

    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]

    def __getitem__(self, index: tuple[slice, ...]) -> GGUFTensor:
        rows, columns = self.shape
        data = self.data
        if index and index[0] != slice(None):
            row_range = range(rows)[index[0]]
            data, rows = data[index[0]], len(row_range)
        if len(index) > 1 and index[1] != slice(None):
            elements, block_bytes = GGML_BLOCK_SIZES[self.qtype]
            column_range = range(columns)[index[1]]
            start, stop = column_range.start, column_range.stop
            if column_range.step != 1 or start % elements or stop % elements:
                raise ValueError(
                    f"{self.qtype} columns {start}:{stop} do not fall on its {elements}-element block "
                    "boundaries: this tensor-parallel split cannot cut the file's blocks"
                )
            data = data[:, start // elements * block_bytes : stop // elements * block_bytes]
            columns = len(column_range)
        return GGUFTensor(self.qtype, data, (rows, columns))


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor as kvflow loads it: llama.cpp's name, the type it loads as (gguf's `GGMLQuantizationType` names),
    its `(rows, columns)` (`(n,)` for a vector), and the type in the file. A part of a fused file tensor (Phi-3's
    `attn_qkv`, `ffn_up`) is its rows `[row_start, row_start + rows)`; one expert of a stacked expert tensor is its
    slice `expert`."""

    gguf_name: str
    qtype: str
    shape: tuple[int, ...]
    num_bytes: int
    file_qtype: str
    row_start: int = 0
    expert: int | None = None


class GGUFCheckpoint:
    """A memory-mapped GGUF file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            import gguf
        except ImportError as error:  # an optional dependency, needed only for GGUF files
            raise ImportError(
                "reading GGUF files needs the 'gguf' package: pip install gguf"
            ) from error
        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(self.path), "c")  # copy-on-write: writable arrays
        except (ValueError, OSError) as error:
            raise ValueError(f"{self.path}: not a readable GGUF file ({error})") from error
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self.architecture = str(self._field("general.architecture"))

    # ------------------------------------------------------------------------------------------ metadata
    def _field(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return default if value is None else value

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.architecture}.{key}", default)

    def _required(self, key: str) -> Any:
        value = self._arch_field(key)
        if value is None:
            raise ValueError(f"{self.path}: metadata lacks {self.architecture}.{key}")
        return value

    def hf_config(self) -> TransformerConfig:
        """The model the metadata describes, as a `TransformerConfig` (float32 activations by default, as
        llama.cpp computes)."""
        self._check_architecture()
        num_heads = int(self._required("attention.head_count"))
        num_kv_heads = self._arch_field("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list):  # per-layer counts: kvflow needs them uniform
            if len(set(num_kv_heads)) != 1:
                raise ValueError(f"{self.path}: per-layer KV head counts {num_kv_heads} differ")
            num_kv_heads = num_kv_heads[0]
        hidden_size = int(self._required("embedding_length"))
        head_dim = int(self._arch_field("attention.key_length", hidden_size // num_heads))
        rope_dim = int(self._arch_field("rope.dimension_count", head_dim))
        if rope_dim != head_dim and self.architecture != "phi3":
            raise ValueError(
                f"{self.path}: rope.dimension_count {rope_dim} != head dim {head_dim} (partial rotary is "
                "supported for phi3 files only)"
            )
        raw: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[self.architecture]],
            "vocab_size": self._vocab_size(),
            "hidden_size": hidden_size,
            "intermediate_size": int(self._required("feed_forward_length")),
            "num_hidden_layers": int(self._required("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(num_kv_heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_field("context_length", 2048)),
            "sliding_window": None,
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        rope_scaling = self._rope_scaling(head_dim)
        if rope_scaling is not None:
            raw["rope_scaling"] = rope_scaling
        raw.update(self._expert_fields(raw))
        if self.architecture in GEMMA_ARCHITECTURES:
            raw.update(self._gemma_fields(raw))
        elif self.architecture == "phi3":
            window = int(self._arch_field("attention.sliding_window", 0))
            raw["sliding_window"] = window or None
            if rope_dim != head_dim:  # Phi-4-mini: RoPE on the first rope_dim dims of each head
                raw["partial_rotary_factor"] = rope_dim / head_dim
        return parse_hf_config(raw)

    def _check_architecture(self) -> None:
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; kvflow reads "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )

    def _expert_fields(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The mixture-of-experts config keys (see the module docstring); none for a dense file."""
        num_experts = int(self._arch_field("expert_count", 0))
        if not num_experts:
            return {}
        fields: dict[str, Any] = {"num_experts_per_tok": int(self._required("expert_used_count"))}
        if self.architecture == "llama":
            return {
                **fields,
                "architectures": [_LLAMA_WITH_EXPERTS],
                "num_local_experts": num_experts,
            }
        num_layers = raw["num_hidden_layers"]
        fields.update(
            num_experts=num_experts,
            moe_intermediate_size=int(self._required("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(
                self._arch_field("expert_shared_feed_forward_length", 0)
            ),
            norm_topk_prob=self.architecture == "qwen3moe",
            decoder_sparse_step=1,
            mlp_only_layers=[
                layer
                for layer in range(num_layers)
                if f"blk.{layer}.ffn_gate_inp.weight" not in self._tensors
            ],
        )
        return fields

    def _gemma_fields(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Gemma 2 / 3's config keys from llama.cpp's metadata (see the module docstring)."""
        num_layers = raw["num_hidden_layers"]
        fields: dict[str, Any] = {
            "query_pre_attn_scalar": gemma_query_pre_attn_scalar(
                self.architecture,
                num_layers,
                raw["hidden_size"],
                raw["num_attention_heads"],
                raw["head_dim"],
            ),
        }
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = self._arch_field(key)
            if value is not None:
                fields[key] = float(value)
            elif self.architecture == "gemma3":
                fields[key] = None
        window = int(self._arch_field("attention.sliding_window", 0))
        if not window and self.architecture == "gemma2":
            window = 4096  # llama.cpp's Gemma 2 default
        pattern = self._arch_field("attention.sliding_window_pattern")
        sliding = gemma_sliding_layers(self.architecture, num_layers, bool(window), pattern)
        fields["sliding_window"] = window if any(sliding) else None
        fields["layer_types"] = [
            "sliding_attention" if is_sliding else "full_attention" for is_sliding in sliding
        ]
        if self.architecture == "gemma3":
            full = {"rope_theta": raw.pop("rope_theta"), "rope_type": "default"}
            full.update(raw.pop("rope_scaling", None) or {})
            local_theta = float(self._arch_field("rope.freq_base_swa", 10000.0))
            fields["rope_parameters"] = {
                "full_attention": full,
                "sliding_attention": {"rope_theta": local_theta, "rope_type": "default"},
            }
        return fields

    def _vocab_size(self) -> int:
        """The embedding's rows (llama.cpp's Gemma 3 converter drops the rows past the tokenizer's vocabulary, so
        they may be fewer than config.json's vocab_size), else the metadata's vocab_size."""
        embedding = self._tensors.get("token_embd.weight")
        if embedding is not None:
            return int(embedding.shape[1])  # ggml's shape is (columns, rows)
        vocab_size = self._arch_field("vocab_size")
        if vocab_size is None:
            raise ValueError(f"{self.path}: no token_embd.weight tensor")
        return int(vocab_size)

    def _rope_scaling(self, head_dim: int) -> dict[str, Any] | None:
        scaling_type = self._arch_field("rope.scaling.type")
        factors = self._tensors.get(ROPE_FREQS)
        if factors is not None:
            values = np.asarray(factors.data, dtype=np.float32).reshape(-1).tolist()
            return {"rope_type": "freq_factors", "factors": values}
        if self.architecture == "phi3" and ROPE_FACTORS_LONG in self._tensors:
            return self._longrope_scaling()
        if scaling_type in (None, "none"):
            return None
        if scaling_type == "linear":
            return {"rope_type": "linear", "factor": float(self._required("rope.scaling.factor"))}
        raise ValueError(
            f"{self.path}: rope scaling {scaling_type!r} is not supported (kvflow reads 'linear' and "
            "llama.cpp's rope_freqs)"
        )

    def _longrope_scaling(self) -> dict[str, Any]:
        """Phi-3 LongRoPE from llama.cpp's factor tensors, original context length and attention factor (left to
        kvflow's default, `sqrt(1 + ln(s) / ln(original))`, when the file's float32 value is that one)."""

        def factors(name: str) -> list[float]:
            tensor = self._tensors.get(name)
            if tensor is None:
                raise ValueError(f"{self.path}: LongRoPE needs both {ROPE_FACTORS_LONG} and {name}")
            return np.asarray(tensor.data, dtype=np.float32).reshape(-1).tolist()

        original = int(self._required("rope.scaling.original_context_length"))
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": factors(ROPE_FACTORS_LONG),
            "short_factor": factors(ROPE_FACTORS_SHORT),
            "original_max_position_embeddings": original,
        }
        attention_factor = self._arch_field("rope.scaling.attn_factor")
        scale = int(self._arch_field("context_length", original)) / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if attention_factor is not None and abs(float(attention_factor) - default) > 1e-6 * default:
            scaling["attention_factor"] = float(attention_factor)
        return scaling

    # ------------------------------------------------------------------------------------------ tensors
    @cached_property
    def _infos(self) -> dict[str, GGUFTensorInfo]:
        config = self.hf_config()  # also refuses an architecture kvflow does not read
        infos = {}
        unsupported = []
        for name, tensor in self._tensors.items():
            hf_name = hf_tensor_name(name, self.architecture)
            if hf_name is None:
                if name not in _ROPE_TENSORS:
                    unsupported.append(f"{name} (no kvflow parameter)")
                continue
            file_qtype = tensor.tensor_type.name
            if file_qtype not in READ_TYPES:
                unsupported.append(f"{name} of type {file_qtype}")
                continue
            qtype = CONVERTED_TYPES.get(file_qtype, file_qtype)
            if name.endswith(_FLOAT_LOADED):
                qtype = "F32"
            shape = tuple(
                int(n) for n in reversed(tensor.shape.tolist())
            )  # ggml lists columns first
            if hf_name.endswith("shared_expert_gate.weight"):
                shape = (1, shape[-1])  # llama.cpp's is a vector, transformers' a one-row matrix
            info = GGUFTensorInfo(name, qtype, shape, int(tensor.n_bytes), file_qtype)
            if "{expert}" in hf_name:
                infos.update(_split_experts(hf_name, info))
            else:
                infos.update(_split_fused(hf_name, info, config))
        if unsupported:
            raise ValueError(
                f"{self.path}: cannot load {', '.join(unsupported)}; kvflow reads tensor types "
                f"{', '.join(READ_TYPES)}"
            )
        return infos

    def tensor_infos(self) -> dict[str, GGUFTensorInfo]:
        """Hugging Face name -> the file's tensor (ValueError naming every tensor kvflow cannot read)."""
        return dict(self._infos)

    def tensor_bytes(self) -> int:
        """The bytes of every tensor in the file (what a loaded model should hold, give or take float casts)."""
        return sum(int(tensor.n_bytes) for tensor in self._tensors.values())

    def iterate_weights(self) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
        """(Hugging Face name, tensor) for every tensor: float ones as torch tensors (their file dtype), quantized
        ones as `GGUFTensor`s over the memory-mapped blocks; q/k rows in Hugging Face's order."""
        config = self.hf_config()
        for hf_name, info in self._infos.items():
            tensor = self._load(info)
            if self.architecture in GEMMA_ARCHITECTURES and hf_name.endswith("norm.weight"):
                assert isinstance(tensor, torch.Tensor)
                tensor = (
                    tensor.to(torch.float32) - 1.0
                )  # llama.cpp stored 1 + w; GemmaRMSNorm adds the 1
            if self.architecture in _PERMUTED_QK_ARCHITECTURES:
                heads = _permuted_heads(hf_name, config)
                if heads is not None:
                    tensor = _reorder_rows(
                        tensor, interleaved_rows_to_half_split(info.shape[0], heads)
                    )
            yield hf_name, tensor

    def _load(self, info: GGUFTensorInfo) -> torch.Tensor | GGUFTensor:
        """One tensor (or fused part) from the mapped file: a float tensor, or blocks of `info.qtype`."""
        tensor = self._tensors[info.gguf_name]
        data = np.asarray(tensor.data)
        if info.expert is not None:  # [experts, rows, columns or row_bytes]
            data = data.reshape(int(tensor.shape[-1]), info.shape[0], -1)[info.expert]
        elif len(info.shape) == 2:  # this part's rows (floats or blocks)
            file_rows = int(tensor.shape[1])  # ggml's shape is (columns, rows)
            data = data.reshape(file_rows, -1)[info.row_start : info.row_start + info.shape[0]]
        if info.qtype in FLOAT_TYPES and info.file_qtype not in FLOAT_TYPES:
            return _dequantized(info.file_qtype, data.reshape(info.shape[0], -1)).reshape(
                info.shape
            )
        if info.file_qtype in CONVERTED_TYPES:
            data = to_q8_0(info.file_qtype, data)
        torch_data = torch.from_numpy(np.ascontiguousarray(data))
        if info.file_qtype not in FLOAT_TYPES:
            return GGUFTensor(info.qtype, torch_data, info.shape)  # type: ignore[arg-type]
        if info.file_qtype == "BF16":
            torch_data = torch_data.view(torch.bfloat16)
        return torch_data.reshape(info.shape)

    # ------------------------------------------------------------------------------------------ tokenizer
    def tokenizer_folder(self, cache_root: Path | None = None) -> Path:
        """A tokenizer folder made from the file's own tokenizer: `tokenizer.huggingface.json` whole, else rebuilt
        from a "gpt2" file's `tokenizer.ggml.*` keys (see `kvflow.models.quantization.gguf_tokenizer`), with the
        chat template and the BOS / EOS / padding tokens; cached by content. ValueError naming `--tokenizer` when
        the file holds no tokenizer kvflow can rebuild."""
        return gguf_tokenizer.tokenizer_folder(self._field, self.path, cache_root)

    def tokenizer_source(self) -> str:
        """Where a model loaded from this file without a tokenizer argument takes its tokenizer: the folder holding
        the file when a tokenizer.json sits beside it, else `tokenizer_folder()`."""
        if (self.path.parent / "tokenizer.json").is_file():
            return str(self.path.parent)
        return str(self.tokenizer_folder())


def _permuted_heads(hf_name: str, config: TransformerConfig) -> int | None:
    """The head count whose rows llama.cpp interleaved in this tensor (q: query heads, k: KV heads), else None."""
    if ".self_attn.q_proj." in hf_name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in hf_name:
        return config.num_key_value_heads
    return None


def _reorder_rows(
    tensor: torch.Tensor | GGUFTensor, order: torch.Tensor
) -> torch.Tensor | GGUFTensor:
    if isinstance(tensor, GGUFTensor):
        return GGUFTensor(tensor.qtype, tensor.data.index_select(0, order), tensor.shape)
    return tensor.index_select(0, order)


def _split_fused(
    hf_name: str, info: GGUFTensorInfo, config: TransformerConfig
) -> dict[str, GGUFTensorInfo]:
    """A fused tensor's parts under their own names, each its rows of the file's tensor; else the tensor."""
    prefix, _, suffix = hf_name.rpartition(".layers.")
    layer, _, local_name = suffix.partition(".")
    if local_name not in FUSED_PARTS:
        return {hf_name: info}
    kv_rows = config.num_key_value_heads * config.head_dim
    sizes = (
        (config.num_attention_heads * config.head_dim, kv_rows, kv_rows)
        if local_name.startswith("self_attn.")
        else (config.intermediate_size, config.intermediate_size)
    )
    if sum(sizes) != info.shape[0]:
        raise ValueError(f"{info.gguf_name} has {info.shape[0]} rows, the config's parts {sizes}")
    parts = {}
    row_start = 0
    for part, rows in zip(FUSED_PARTS[local_name], sizes, strict=True):
        num_bytes = info.num_bytes * rows // info.shape[0]
        parts[f"{prefix}.layers.{layer}.{part}"] = dataclasses.replace(
            info, shape=(rows, *info.shape[1:]), num_bytes=num_bytes, row_start=row_start
        )
        row_start += rows
    return parts


def _split_experts(hf_name: str, info: GGUFTensorInfo) -> dict[str, GGUFTensorInfo]:
    """A stacked `[experts, rows, columns]` tensor as one `[rows, columns]` info per expert, of the file's type
    (blocks: `GGUFTensor`s that FusedMoE keeps, or dequantizes where the plan leaves the experts in float)."""
    num_experts, rows, columns = info.shape
    return {
        hf_name.format(expert=expert): dataclasses.replace(
            info,
            shape=(rows, columns),
            num_bytes=info.num_bytes // num_experts,
            expert=expert,
        )
        for expert in range(num_experts)
    }


def _dequantized(qtype: str, data: np.ndarray) -> torch.Tensor:
    """Quantized rows (uint8 `[rows, row_bytes]`) as a float32 `[rows, columns]` tensor."""
    if qtype in CONVERTED_TYPES:
        return torch.from_numpy(dequantize_5_bit(qtype, data))
    return dequantize_reference(qtype, torch.from_numpy(np.ascontiguousarray(data)))
