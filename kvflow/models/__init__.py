"""The models: the one model contract (`RunnerModel`), one module per model family (`llama`) over the shared layers
(`layers/`, `attention/`) and causal-LM shell (`decoder_lm`), the config parser (`hf_config`), the hash model (the
test oracle, a model like any other), the architecture registry and the checkpoint loader (`loader`,
`weight_loading`, `checkpoint_files`)."""

from __future__ import annotations

from kvflow.models.hash_model import HashModel
from kvflow.models.hf_config import TransformerConfig, load_hf_config
from kvflow.models.interface import RunnerModel
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import iterate_safetensors_weights, load_model, resolve_dtype
from kvflow.models.registry import (
    HASH_MODEL_ARCHITECTURE,
    MODEL_REGISTRY,
    SUPPORTED_ARCHITECTURES,
    build_model,
    get_model_class,
)

__all__ = [
    "HASH_MODEL_ARCHITECTURE",
    "MODEL_REGISTRY",
    "SUPPORTED_ARCHITECTURES",
    "HashModel",
    "LlamaForCausalLM",
    "RunnerModel",
    "TransformerConfig",
    "build_model",
    "get_model_class",
    "iterate_safetensors_weights",
    "load_hf_config",
    "load_model",
    "resolve_dtype",
]
