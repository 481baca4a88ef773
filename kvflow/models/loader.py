"""Loading a Hugging Face safetensors checkpoint folder into a kvflow model.

`load_model` reads the config, builds the registered model class and loads the weights; `load_weights` is the
generic weight loading every model delegates to. It maps each checkpoint name to a parameter (through the model's
`packed_modules_mapping`: `q_proj` loads into shard 0 of `qkv_proj`, and so on) and calls that parameter's
`weight_loader`, which cuts this rank's part, places it and casts it (`kvflow.models.layers.weights`). Quantized
weights plug in at that seam.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvflow.models.attention import resolve_attention_backend
from kvflow.models.checkpoint_files import (
    INDEX_FILE,
    SINGLE_FILE,
    TensorSelector,
    iterate_safetensors_weights,
    safetensors_files,
)
from kvflow.models.hf_config import load_hf_config
from kvflow.models.layers.weights import RankPart, WeightShapeError, default_weight_loader
from kvflow.models.registry import get_model_class

if TYPE_CHECKING:
    from kvflow.config import ModelConfig
    from kvflow.distributed import TensorParallelGroup
    from kvflow.model_info import ModelInfo
    from kvflow.models.hf_config import TransformerConfig
    from kvflow.models.quantization import QuantizationPlan

logger = logging.getLogger(__name__)

__all__ = [  # the checkpoint folder's reading lives in checkpoint_files; its names stay importable here
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointModel",
    "PackedNames",
    "TensorSelector",
    "checkpoint_index",
    "iterate_safetensors_weights",
    "load_model",
    "load_weights",
    "resolve_dtype",
    "safetensors_files",
]

# Checkpoint tensors no parameter holds: RoPE frequencies (kvflow computes them from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The Hugging Face names of the LM head and the token embedding it falls back to when a checkpoint has no head.
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
}


def resolve_dtype(dtype: str, config: TransformerConfig) -> torch.dtype:
    """The torch dtype for `dtype`: "auto" is the checkpoint's `torch_dtype` (float32 when it has none)."""
    name = dtype
    if dtype == "auto":
        name = (config.torch_dtype or "float32").removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        if name not in _DTYPES:
            raise ValueError(
                f"dtype 'auto': the checkpoint's torch_dtype {config.torch_dtype!r} is not supported; "
                f"pass dtype as one of {', '.join(_DTYPES)}"
            )
        return _DTYPES[name]
    if name not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def load_model(
    model_path: str | Path,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    attention_backend: str = "auto",
    tp: TensorParallelGroup | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> CheckpointModel:
    """Read the config, build the registered model class, load the weights, and return it in eval mode.

    `model_path` is a Hugging Face checkpoint folder or a GGUF file (its weights stay in their ggml blocks:
    `kvflow.models.quantization`). `quantization="int8"` quantizes a folder's linear layers as they load
    (`quantize_lm_head`: the LM head too). `attention_backend` "auto" is the C++ decode backend ("cpu") on a CPU with
    the kernels, else "torch". With `tp` of several ranks the model holds this rank's shard of every tensor and only
    that shard is read (a GGUF file is memory-mapped and each rank copies its part).
    """
    from kvflow.models.quantization import QUANTIZATION_METHODS, check_quantization
    from kvflow.models.quantization.gguf_file import GGUFCheckpoint, is_gguf_file

    started = time.perf_counter()
    attention_backend = resolve_attention_backend(attention_backend, torch.device(device))
    is_gguf = is_gguf_file(model_path)
    check_quantization(quantization, is_gguf=is_gguf, quantize_lm_head=quantize_lm_head)
    sharded = tp is not None and tp.size > 1
    weights: Iterable[tuple[str, Any]]
    plan: QuantizationPlan | None = None
    if is_gguf:
        checkpoint = GGUFCheckpoint(model_path)
        config = checkpoint.hf_config()
        plan = QUANTIZATION_METHODS.get("gguf")(checkpoint.tensor_infos())  # type: ignore[call-arg]
        weights, sliced, bytes_in_file = (
            checkpoint.iterate_weights(),
            False,
            checkpoint.tensor_bytes(),
        )
    else:
        config = load_hf_config(model_path)
        if quantization is not None:
            plan = QUANTIZATION_METHODS.get(quantization)(quantize_lm_head=quantize_lm_head)  # type: ignore[call-arg]
        weights, sliced, bytes_in_file = None, sharded, 0
    model_class = get_model_class([config.architecture])
    torch_dtype = resolve_dtype(dtype, config)
    model = model_class(
        config,
        dtype=torch_dtype,
        device=device,
        attention_backend=attention_backend,
        tp=tp,
        quantization=plan,
    )
    num_tensors = 0
    num_bytes = 0

    def counted(tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        nonlocal num_tensors, num_bytes
        for name, tensor in tensors:
            num_tensors += 1
            num_bytes += (
                tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            )
            yield name, tensor

    if weights is None:
        weights = iterate_safetensors_weights(
            model_path, model.checkpoint_index if sharded else None
        )
    model.load_weights(counted(weights), sliced=sliced)
    model.eval()
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    logger.info(
        "loaded %s (%s%s) from %s: %d tensors, %.1f MiB read, %.1f MiB of weights held as %s on %s in %.2fs",
        config.architecture,
        attention_backend,
        "" if plan is None else f", {plan.name}",
        model_path,
        num_tensors,
        (bytes_in_file or num_bytes) / 2**20,
        held / 2**20,
        torch_dtype,
        device,
        time.perf_counter() - started,
    )
    return model


class CheckpointModel(nn.Module):
    """A model whose weights come from a Hugging Face checkpoint folder: what the worker, the registry and tensor
    parallelism need of it, on top of `RunnerModel`, implemented once here.

    Invariants: a subclass is built as `cls(config, *, dtype, device, attention_backend, tp, quantization)` (as
    `load_model` does), sets `self.tp` (its `TensorParallelGroup`) and `self.quantization` (the plan it applied to
    its layers before any weight loaded, or None), and names in `packed_modules_mapping` the checkpoint
    projections each of its fused modules stacks, in shard order; every parameter carries a `weight_loader`.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    tp: TensorParallelGroup
    quantization: QuantizationPlan | None = None

    @classmethod
    def build(
        cls,
        model_config: ModelConfig,
        model_info: ModelInfo,
        device: torch.device,
        tp: TensorParallelGroup | None = None,
    ) -> CheckpointModel:
        """The checkpoint folder's model with its weights (this rank's shards), in `model_config.dtype`."""
        assert model_info.path is not None, f"model {model_info.name!r} has no checkpoint folder"
        return load_model(
            model_info.path,
            dtype=model_config.dtype,
            device=device,
            tp=tp,
            quantization=model_config.quantization,
            quantize_lm_head=model_config.quantize_lm_head,
        )

    def checkpoint_index(self, checkpoint_name: str) -> tuple[slice, ...]:
        """The part of checkpoint tensor `checkpoint_name` this rank loads: `()` for all of it (always, with one
        rank) or slices of its rows or columns (`checkpoint_index`)."""
        return () if self.tp.size == 1 else checkpoint_index(self, checkpoint_name)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        strict: bool = True,
        sliced: bool = False,
    ) -> None:
        """Copy Hugging Face-named tensors in (fusing the packed ones, casting to the model's dtype): see
        `load_weights`. `strict` (a whole checkpoint) requires every parameter; `strict=False` updates just the
        tensors given (a weight update); `sliced` says they are already this rank's parts. The quantization plan's
        `after_loading` runs after every load."""
        load_weights(self, weights, strict=strict, sliced=sliced)
        if self.quantization is not None:
            self.quantization.after_loading(self)


class PackedNames:
    """Checkpoint names <-> (parameter, shard) under a model's `packed_modules_mapping`.

    `packed_modules_mapping` maps a fused module to the checkpoint modules it stacks, in shard order (e.g.
    `{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}`): `...q_proj.weight` loads into shard 0 of `...qkv_proj.weight`.
    Any other name is the parameter's own, shard None (the whole parameter).
    """

    def __init__(self, packed_modules_mapping: Mapping[str, Sequence[str]]) -> None:
        self._parts = {
            f".{part}.": (f".{packed}.", shard)
            for packed, parts in packed_modules_mapping.items()
            for shard, part in enumerate(parts)
        }
        self._num_shards = {
            f".{packed}.": len(parts) for packed, parts in packed_modules_mapping.items()
        }

    def target(self, checkpoint_name: str) -> tuple[str, int | None]:
        """The parameter and shard a checkpoint tensor loads into."""
        for part, (packed, shard) in self._parts.items():
            if part in checkpoint_name:
                return checkpoint_name.replace(part, packed), shard
        return checkpoint_name, None

    def shards(self, param_name: str) -> tuple[int | None, ...]:
        """The shards a whole checkpoint fills in `param_name`: (0, 1, ...) for a packed one, else (None,)."""
        for packed, num_shards in self._num_shards.items():
            if packed in param_name:
                return tuple(range(num_shards))
        return (None,)

    def checkpoint_name(self, param_name: str, shard: int | None) -> str:
        """The checkpoint-side name of shard `shard` of `param_name` (what the file should hold)."""
        for part, (packed, part_shard) in self._parts.items():
            if part_shard == shard and packed in param_name:
                return param_name.replace(packed, part)
        return param_name


def checkpoint_index(model: nn.Module, checkpoint_name: str) -> tuple[slice, ...]:
    """The part of checkpoint tensor `checkpoint_name` `model`'s rank holds (`()`: all of it), as the layer owning
    the parameter says (its `checkpoint_index(param_name, shard)`). Names the model does not know are read whole, so
    `load_weights` reports them."""
    name, shard = PackedNames(getattr(model, "packed_modules_mapping", {})).target(checkpoint_name)
    module_name, _, param_name = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return ()
    index = getattr(module, "checkpoint_index", None)
    return () if index is None else index(param_name, shard)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    strict: bool = True,
    sliced: bool = False,
) -> None:
    """Copy Hugging Face-named tensors into `model`'s parameters through their `weight_loader`s.

    `weights` are whole checkpoint tensors (each weight loader cuts this rank's part), or, with `sliced`, already
    this rank's parts (as `iterate_safetensors_weights(path, model.checkpoint_index)` reads them). `rotary_emb.
    inv_freq` is skipped; a checkpoint `lm_head.weight` is ignored when the head is tied to the embedding, and a
    whole checkpoint (`strict`) without one ties it (as transformers does). Raises one ValueError naming every
    unexpected name, shape mismatch and (when `strict`) missing tensor; `strict=False` updates just the tensors given.
    """
    names = PackedNames(getattr(model, "packed_modules_mapping", {}))
    params = dict(model.named_parameters())  # a tied head shares the embedding's entry
    expected = {(name, shard) for name in params for shard in names.shards(name)}
    loaded: set[tuple[str, int | None]] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    saw_lm_head = False
    for checkpoint_name, tensor in weights:
        if checkpoint_name.endswith(IGNORED_SUFFIXES):
            continue
        if checkpoint_name == LM_HEAD and LM_HEAD not in params:
            saw_lm_head = True  # tied: the embedding provides it
            continue
        name, shard = names.target(checkpoint_name)
        param = params.get(name)
        if param is None:
            unexpected.append(checkpoint_name)
            continue
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, RankPart(tensor) if sliced else tensor, shard)
        except WeightShapeError as error:
            mismatched.append(f"{checkpoint_name}: {error}")
            continue
        filled = names.shards(name) if shard is None else (shard,)  # None: the whole parameter
        loaded.update((name, filled_shard) for filled_shard in filled)
    if strict:
        _tie_if_lm_head_absent(model, expected, loaded)
    missing = sorted(expected - loaded, key=str) if strict else []
    _raise_on_load_errors(
        unexpected, mismatched, [names.checkpoint_name(name, shard) for name, shard in missing]
    )
    if saw_lm_head:
        logger.debug("tie_word_embeddings: ignored the checkpoint's lm_head.weight")


def _tie_if_lm_head_absent(
    model: nn.Module,
    expected: set[tuple[str, int | None]],
    loaded: set[tuple[str, int | None]],
) -> None:
    """A checkpoint without `lm_head.weight` ties the head to the embedding (as transformers does)."""
    lm_head = (LM_HEAD, None)
    if lm_head in expected and lm_head not in loaded and (EMBEDDING, None) in loaded:
        logger.warning("checkpoint has no lm_head.weight: tying the LM head to the token embedding")
        model.get_submodule("lm_head").tie(model.get_submodule("model.embed_tokens"))
        expected.discard(lm_head)


def _raise_on_load_errors(unexpected: list[str], mismatched: list[str], missing: list[str]) -> None:
    problems = []
    if unexpected:
        problems.append(f"unexpected parameters: {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(mismatched)}")
    if missing:
        problems.append(f"missing parameters: {', '.join(missing)}")
    if problems:
        raise ValueError("cannot load checkpoint weights: " + " | ".join(problems))
