"""The build-and-load path every checkpoint model takes: `load_model` and `CheckpointModel`.

`load_model` reads the config (a checkpoint folder's config.json or a GGUF file's metadata), builds the class the
registry names for its architecture, and loads the weights through the generic name mapping of
`kvflow.models.weight_loading` (each parameter's `weight_loader` cuts, places and casts its part). Quantized weights
plug in at that seam; no family-specific code runs here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvflow.kernels.build import cpu_feature_flags
from kvflow.models.attention import resolve_attention_backend
from kvflow.models.checkpoint_files import (
    INDEX_FILE,
    SINGLE_FILE,
    TensorSelector,
    iterate_safetensors_weights,
    safetensors_files,
)
from kvflow.models.hf_config import load_hf_config
from kvflow.models.registry import get_model_class
from kvflow.models.weight_loading import (
    EMBEDDING,
    IGNORED_SUFFIXES,
    LM_HEAD,
    PackedNames,
    checkpoint_index,
    load_weights,
)

if TYPE_CHECKING:
    from kvflow.config import ModelConfig
    from kvflow.distributed import TensorParallelGroup
    from kvflow.model_info import ModelInfo
    from kvflow.models.encoder_config import EncoderConfig
    from kvflow.models.hf_config import TransformerConfig
    from kvflow.models.quantization import QuantizationPlan

logger = logging.getLogger(__name__)

__all__ = [  # the file reading (checkpoint_files) and name mapping (weight_loading) stay importable here
    "EMBEDDING",
    "IGNORED_SUFFIXES",
    "INDEX_FILE",
    "LM_HEAD",
    "SINGLE_FILE",
    "CheckpointModel",
    "PackedNames",
    "TensorSelector",
    "checkpoint_index",
    "iterate_safetensors_weights",
    "load_model",
    "load_weights",
    "pooling_auto_dtype",
    "resolve_dtype",
    "resolve_runner_dtype",
    "safetensors_files",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
}


# CPU feature flags (/proc/cpuinfo) of native bfloat16 arithmetic: AVX512_BF16's dot products, AMX's tiles.
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str, config: TransformerConfig | EncoderConfig) -> torch.dtype:
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


def pooling_auto_dtype(
    checkpoint_dtype: torch.dtype, device_type: str, cpu_native_bf16: bool
) -> torch.dtype:
    """The dtype the pooling runner serves a checkpoint in under `dtype="auto"` (vLLM's downcast for pooling
    models), given the checkpoint's dtype, the device type ("cpu", "cuda") and whether the CPU has native bfloat16
    arithmetic (`cpu_has_native_bf16`).

    The rule: a float32 checkpoint runs in float16 on CUDA and in bfloat16 on a CPU with native bfloat16 (AVX512_BF16
    or AMX), and stays float32 on a CPU without it (bfloat16 there is widened in software, slower than float32). A
    checkpoint already in a 16-bit dtype keeps it. The generation runner never calls this: its "auto" is the
    checkpoint's dtype.
    """
    if checkpoint_dtype is not torch.float32:
        return checkpoint_dtype
    if device_type == "cuda":
        return torch.float16
    return torch.bfloat16 if device_type == "cpu" and cpu_native_bf16 else torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU's feature flags name native bfloat16 arithmetic (AVX512_BF16 or AMX-BF16)."""
    return bool(cpu_feature_flags() & _NATIVE_BF16_FLAGS)


def resolve_runner_dtype(
    dtype: str,
    config: TransformerConfig | EncoderConfig,
    runner: str,
    device: torch.device | str,
) -> torch.dtype:
    """The torch dtype a model of `runner` ("generate" or "pooling") is built in: `resolve_dtype`, except that the
    pooling runner's "auto" follows `pooling_auto_dtype` (logged at INFO when the checkpoint is float32)."""
    checkpoint_dtype = resolve_dtype(dtype, config)
    if dtype != "auto" or runner != "pooling" or checkpoint_dtype is not torch.float32:
        return checkpoint_dtype
    device_type = torch.device(device).type
    native_bf16 = device_type == "cpu" and cpu_has_native_bf16()
    chosen = pooling_auto_dtype(checkpoint_dtype, device_type, native_bf16)
    if device_type == "cuda":
        why = "pooling runner on CUDA"
    elif native_bf16:
        why = "pooling runner, native bf16 on this CPU"
    else:
        why = "pooling runner, this CPU has no native bf16 arithmetic"
    logger.info(
        "dtype auto: float32 checkpoint served in %s (%s)%s",
        str(chosen).removeprefix("torch."),
        why,
        "; pass dtype='float32' for full precision" if chosen is not torch.float32 else "",
    )
    return chosen


def load_model(
    model_path: str | Path,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    attention_backend: str = "auto",
    tp: TensorParallelGroup | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    runner: str = "generate",
) -> CheckpointModel:
    """Read the config, build the registered model class, load the weights, and return it in eval mode.

    `model_path` is a Hugging Face checkpoint folder or a GGUF file (its weights stay in their ggml blocks:
    `kvflow.models.quantization`). `quantization="int8"` quantizes a folder's linear layers as they load
    (`quantize_lm_head`: the LM head too). `attention_backend` "auto" is the C++ decode backend ("cpu") on a CPU with
    the kernels, else "torch". With `tp` of several ranks the model holds this rank's shard of every tensor and only
    that shard is read (a GGUF file is memory-mapped and each rank copies its part). `runner` "pooling" resolves
    `dtype="auto"` by `pooling_auto_dtype` (`resolve_runner_dtype`); "generate" keeps the checkpoint's dtype.
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
    torch_dtype = resolve_runner_dtype(dtype, config, runner, device)
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
        """The checkpoint folder's model with its weights (this rank's shards), in `model_config.dtype` (for the
        pooling runner, "auto" as `resolve_runner_dtype` says)."""
        assert model_info.path is not None, f"model {model_info.name!r} has no checkpoint folder"
        return load_model(
            model_info.path,
            dtype=model_config.dtype,
            device=device,
            tp=tp,
            quantization=model_config.quantization,
            quantize_lm_head=model_config.quantize_lm_head,
            runner=model_config.runner,
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
