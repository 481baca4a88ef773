"""Loading a Hugging Face safetensors checkpoint folder into a kvflow model."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvflow.models.attention import resolve_attention_backend
from kvflow.models.hf_config import load_hf_config
from kvflow.models.registry import get_model_class
from kvflow.models.safetensors_io import SafetensorsFile, SafetensorsFormatError

if TYPE_CHECKING:
    from kvflow.distributed import TensorParallelGroup
    from kvflow.models.hf_config import TransformerConfig
    from kvflow.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
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


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The checkpoint's weight files: the shards named by the index, else the single `model.safetensors`."""
    path = Path(model_path)
    index_file = path / INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"{str(index_file)!r} is not a safetensors index with a 'weight_map': {error}"
            ) from error
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(
                    f"shard {str(file)!r} named by {str(index_file)!r} does not exist"
                )
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no {SINGLE_FILE!r} or {INDEX_FILE!r} in {str(path)!r}")


# Which part of a named checkpoint tensor to read: `()` all of it, slices of it, or None for none of it.
TensorSelector = Callable[[str], "tuple[slice, ...] | None"]


def iterate_safetensors_weights(
    model_path: str | Path, select: TensorSelector | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of the checkpoint, file by file, on the CPU.

    Each tensor is read into memory of its own (`SafetensorsFile`: positioned reads, no memory map), so a consumer
    that copies it into a parameter and drops it holds one tensor beyond the model at any time, never a second copy
    of the checkpoint. With `select` (a tensor-parallel rank's `model.checkpoint_index`) only the part
    `select(name)` names is read (`SafetensorsFile.read(name, index)`), so a rank never materializes a whole
    sharded tensor; tensors it maps to None are skipped. A missing file raises FileNotFoundError naming it; an
    unreadable one ValueError naming it.
    """
    for file in safetensors_files(model_path):
        try:
            with SafetensorsFile(file) as handle:
                for name in handle.names():
                    index = () if select is None else select(name)
                    if index is not None:
                        yield name, handle.read(name, index)
        except SafetensorsFormatError:
            raise
        except OSError as error:
            raise ValueError(f"cannot read safetensors file {str(file)!r}: {error}") from error


def load_model(
    model_path: str | Path,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    attention_backend: str = "auto",
    tp: TensorParallelGroup | None = None,
) -> LlamaForCausalLM:
    """Read the config, build the registered model class, load the weights, and return it in eval mode.

    `attention_backend` "auto" is the C++ decode backend ("cpu") on a CPU with the kernels, else "torch". With `tp`
    of several ranks the model holds this rank's shard of every tensor and only that shard is read.
    """
    started = time.perf_counter()
    attention_backend = resolve_attention_backend(attention_backend, torch.device(device))
    config = load_hf_config(model_path)
    model_class = get_model_class([config.architecture])
    torch_dtype = resolve_dtype(dtype, config)
    model = model_class(
        config, dtype=torch_dtype, device=device, attention_backend=attention_backend, tp=tp
    )
    num_tensors = 0
    num_bytes = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal num_tensors, num_bytes
        for name, tensor in iterate_safetensors_weights(model_path, select):
            num_tensors += 1
            num_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    sharded = tp is not None and tp.size > 1
    select = model.checkpoint_index if sharded else None
    model.load_weights(counted(), sliced=sharded)
    model.eval()
    num_params = sum(param.numel() for param in model.parameters())
    logger.info(
        "loaded %s (%s) from %s: %d tensors, %.1f MiB read, %.2fM parameters as %s on %s in %.2fs",
        config.architecture,
        attention_backend,
        model_path,
        num_tensors,
        num_bytes / 2**20,
        num_params / 1e6,
        torch_dtype,
        device,
        time.perf_counter() - started,
    )
    return model
