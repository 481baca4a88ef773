"""Reading llama.cpp's GGUF files: the model's configuration, its tensors under Hugging Face names, its tokenizer.

`GGUFCheckpoint(path)` memory-maps the file (the `gguf` package's reader). `hf_config()` is the `TransformerConfig`
the file's metadata describes (architectures `llama`, which also covers Mistral, `qwen2` and `qwen3`);
`tensor_infos()` maps each tensor to its Hugging Face name, its type and its `(rows, columns)` shape, and raises on
a type kvflow does not read, naming the tensor and the type; `iterate_weights()` yields `(Hugging Face name,
tensor)`: float tensors (F32, F16, BF16) as torch tensors, quantized ones as `GGUFTensor`s holding the file's blocks.

Invariants: a quantized tensor's rows are a whole number of ggml blocks (`kvflow.kernels.quant.GGML_BLOCK_SIZES`);
the `llama` architecture's q/k rows are put back from llama.cpp's interleaved rotary layout into Hugging Face's
half-split one (a permutation of whole rows, so it applies to blocks as it does to floats). Name mapping is
`GGUF_LAYER_NAMES` / `GGUF_GLOBAL_NAMES`, shared with the writer (`kvflow.models.quantization.gguf_writer`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvflow.kernels.quant import GGML_BLOCK_SIZES
from kvflow.models.hf_config import TransformerConfig, parse_hf_config

GGUF_SUFFIX = ".gguf"
# general.architecture -> the Hugging Face architecture kvflow builds.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose q/k rows llama.cpp's converter permutes to its interleaved rotary layout.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
QUANTIZED_TYPES = tuple(GGML_BLOCK_SIZES)
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
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = (
    "rope_freqs.weight"  # Llama 3.1+ files: per-frequency divisors instead of scaling metadata
)
_TOKENIZER_JSON_KEY = "tokenizer.huggingface.json"
_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


def is_gguf_file(path: str | os.PathLike[str] | None) -> bool:
    """Whether `path` is an existing file named *.gguf."""
    return path is not None and Path(path).suffix == GGUF_SUFFIX and Path(path).is_file()


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None when kvflow has no parameter for it."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    block, _, rest = gguf_name.partition(".")
    if block != "blk":
        return None
    layer, _, suffix = rest.partition(".")
    hf_suffix = GGUF_LAYER_NAMES.get(suffix)
    if not layer.isdigit() or hf_suffix is None:
        return None
    return f"model.layers.{layer}.{hf_suffix}"


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
    """One tensor of the file: llama.cpp's name, its type name (gguf's `GGMLQuantizationType` names) and its
    `(rows, columns)` (`(n,)` for a vector)."""

    gguf_name: str
    qtype: str
    shape: tuple[int, ...]
    num_bytes: int


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
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; kvflow reads "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        num_heads = int(self._required("attention.head_count"))
        num_kv_heads = self._arch_field("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list):  # per-layer counts: kvflow needs them uniform
            if len(set(num_kv_heads)) != 1:
                raise ValueError(f"{self.path}: per-layer KV head counts {num_kv_heads} differ")
            num_kv_heads = num_kv_heads[0]
        hidden_size = int(self._required("embedding_length"))
        head_dim = int(self._arch_field("attention.key_length", hidden_size // num_heads))
        rope_dim = int(self._arch_field("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ValueError(
                f"{self.path}: rope.dimension_count {rope_dim} != head dim {head_dim} (partial rotary is not "
                "supported)"
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
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        rope_scaling = self._rope_scaling(head_dim)
        if rope_scaling is not None:
            raw["rope_scaling"] = rope_scaling
        return parse_hf_config(raw)

    def _vocab_size(self) -> int:
        vocab_size = self._arch_field("vocab_size")
        if vocab_size is not None:
            return int(vocab_size)
        embedding = self._tensors.get("token_embd.weight")
        if embedding is None:
            raise ValueError(f"{self.path}: no token_embd.weight tensor")
        return int(embedding.shape[1])  # ggml's shape is (columns, rows)

    def _rope_scaling(self, head_dim: int) -> dict[str, Any] | None:
        scaling_type = self._arch_field("rope.scaling.type")
        factors = self._tensors.get(ROPE_FREQS)
        if factors is not None:
            values = np.asarray(factors.data, dtype=np.float32).reshape(-1).tolist()
            return {"rope_type": "freq_factors", "factors": values}
        if scaling_type in (None, "none"):
            return None
        if scaling_type == "linear":
            return {"rope_type": "linear", "factor": float(self._required("rope.scaling.factor"))}
        raise ValueError(
            f"{self.path}: rope scaling {scaling_type!r} is not supported (kvflow reads 'linear' and "
            "llama.cpp's rope_freqs)"
        )

    # ------------------------------------------------------------------------------------------ tensors
    @cached_property
    def _infos(self) -> dict[str, GGUFTensorInfo]:
        infos = {}
        unsupported = []
        for name, tensor in self._tensors.items():
            hf_name = hf_tensor_name(name)
            if hf_name is None:
                if name != ROPE_FREQS:
                    unsupported.append(f"{name} (no kvflow parameter)")
                continue
            qtype = tensor.tensor_type.name
            if qtype not in FLOAT_TYPES and qtype not in GGML_BLOCK_SIZES:
                unsupported.append(f"{name} of type {qtype}")
                continue
            shape = tuple(
                int(n) for n in reversed(tensor.shape.tolist())
            )  # ggml lists columns first
            infos[hf_name] = GGUFTensorInfo(name, qtype, shape, int(tensor.n_bytes))
        if unsupported:
            raise ValueError(
                f"{self.path}: cannot load {', '.join(unsupported)}; kvflow reads tensor types "
                f"{', '.join((*FLOAT_TYPES, *GGML_BLOCK_SIZES))}"
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
            data = torch.from_numpy(np.asarray(self._tensors[info.gguf_name].data))
            tensor: torch.Tensor | GGUFTensor
            if info.qtype in FLOAT_TYPES:
                if info.qtype == "BF16":
                    data = data.contiguous().view(torch.bfloat16)
                tensor = data.reshape(info.shape)
            else:
                tensor = GGUFTensor(info.qtype, data.reshape(info.shape[0], -1), info.shape)
            if self.architecture in _PERMUTED_QK_ARCHITECTURES:
                heads = _permuted_heads(hf_name, config)
                if heads is not None:
                    tensor = _reorder_rows(
                        tensor, interleaved_rows_to_half_split(info.shape[0], heads)
                    )
            yield hf_name, tensor

    # ------------------------------------------------------------------------------------------ tokenizer
    def tokenizer_folder(self, cache_root: Path | None = None) -> Path:
        """A tokenizer folder made from the file's own Hugging Face tokenizer (`tokenizer.huggingface.json`, with
        `tokenizer.chat_template` and the BOS/EOS tokens), cached by content; ValueError when the file holds none."""
        tokenizer_json = self._field(_TOKENIZER_JSON_KEY)
        if not tokenizer_json:
            raise ValueError(
                f"{self.path}: the GGUF file holds no Hugging Face tokenizer ({_TOKENIZER_JSON_KEY}); pass the "
                "original checkpoint's folder as tokenizer= (--tokenizer FOLDER)"
            )
        tokens = self._field("tokenizer.ggml.tokens") or []
        config: dict[str, Any] = {}
        for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
            token_id = self._field(f"tokenizer.ggml.{name}")
            if token_id is not None and 0 <= int(token_id) < len(tokens):
                config[key] = tokens[int(token_id)]
        chat_template = self._field(_CHAT_TEMPLATE_KEY)
        if chat_template:
            config["chat_template"] = chat_template
        digest = hashlib.sha256(
            (tokenizer_json + json.dumps(config, sort_keys=True)).encode()
        ).hexdigest()[:16]
        root = cache_root or Path(
            os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow")
        )
        folder = root / "gguf_tokenizers" / digest
        if not (folder / "tokenizer_config.json").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
            staging = folder / f".tokenizer_config.{os.getpid()}.json"
            staging.write_text(json.dumps(config), encoding="utf-8")
            staging.replace(folder / "tokenizer_config.json")
        return folder


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
