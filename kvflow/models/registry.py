"""Which model runs which architecture, and how the worker builds it.

A checkpoint's architecture is the Hugging Face name its config.json lists; every supported one shares
`kvflow.models.llama.LlamaForCausalLM` (the differences, such as q/k/v bias, q/k norm and sliding windows, come from
the parsed config) and is built by loading the checkpoint. `HASH_MODEL_ARCHITECTURE` names the hash model, which has
no checkpoint and is built from its `ModelInfo` alone.

Under tensor parallelism (`tp` of several ranks) a checkpoint model holds and reads only its rank's shard of every
tensor; the hash model has no weights and runs replicated: every rank computes the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvflow.config import ModelConfig
    from kvflow.distributed import TensorParallelGroup
    from kvflow.model_info import ModelInfo
    from kvflow.models.interface import RunnerModel

    ModelBuilder = Callable[
        [ModelConfig, ModelInfo, torch.device, TensorParallelGroup | None], RunnerModel
    ]

HASH_MODEL_ARCHITECTURE = "HashModel"

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)


def get_model_class(architectures: list[str]) -> type:
    """The kvflow model class for the first supported checkpoint architecture in a config's `architectures` list."""
    for architecture in architectures:
        if architecture in SUPPORTED_ARCHITECTURES:
            from kvflow.models.llama import LlamaForCausalLM

            return LlamaForCausalLM
    raise unsupported_architecture_error(architectures)


def build_model(
    model_config: ModelConfig,
    model_info: ModelInfo,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
) -> RunnerModel:
    """The model `model_info.architecture` names, built on `device` the way the registry says (this rank's shard
    of it under tensor parallelism `tp`)."""
    builder = _MODEL_BUILDERS.get(model_info.architecture)
    if builder is None:
        raise unsupported_architecture_error([model_info.architecture])
    return builder(model_config, model_info, device, tp)


def _build_hash_model(
    model_config: ModelConfig,
    model_info: ModelInfo,
    device: torch.device,
    tp: TensorParallelGroup | None,
) -> RunnerModel:
    """The hash model over `model_info`'s vocabulary (it has no weights; the runner moves its cache to `device`).
    Replicated under tensor parallelism: it needs no collective, and every rank samples the same tokens."""
    from kvflow.models.hash_model import HashModel

    return HashModel(model_info.vocab_size)


def _load_checkpoint(
    model_config: ModelConfig,
    model_info: ModelInfo,
    device: torch.device,
    tp: TensorParallelGroup | None,
) -> RunnerModel:
    """The checkpoint folder's model with its weights (this rank's shards), in `model_config.dtype`."""
    from kvflow.models.loader import load_model

    assert model_info.path is not None, f"model {model_info.name!r} has no checkpoint folder"
    return load_model(model_info.path, dtype=model_config.dtype, device=device, tp=tp)


_MODEL_BUILDERS: dict[str, ModelBuilder] = {
    HASH_MODEL_ARCHITECTURE: _build_hash_model,
    **dict.fromkeys(SUPPORTED_ARCHITECTURES, _load_checkpoint),
}


def unsupported_architecture_error(architectures: list[str]) -> ValueError:
    """The error for a checkpoint none of whose architectures kvflow runs, listing the ones it does."""
    named = ", ".join(repr(name) for name in architectures) or "none"
    return ValueError(
        f"unsupported model architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
