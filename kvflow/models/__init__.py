"""Real models: the Llama-family implementation, its config parser, the architecture registry and the loader."""

from __future__ import annotations

from kvflow.models.hf_config import TransformerConfig, load_hf_config
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import iterate_safetensors_weights, load_model, resolve_dtype
from kvflow.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "TransformerConfig",
    "get_model_class",
    "iterate_safetensors_weights",
    "load_hf_config",
    "load_model",
    "resolve_dtype",
]
