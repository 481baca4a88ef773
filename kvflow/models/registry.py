"""Which model class runs which architecture: one `LazyRegistry` table, architecture -> "module:Class".

A checkpoint's architecture is the Hugging Face name its config.json lists. Each model family has its own module
under `kvflow.models` (Llama, Mistral, Qwen2 and Qwen3: `llama`, whose differences, such as q/k/v bias, q/k norm and
sliding windows, come from the parsed config); adding a family is its module plus its lines in this table, and,
where its config.json reads differently from Llama's, its entry in `hf_config.ARCHITECTURE_RULES`. The table's
checkpoint architectures are the ones kvflow accepts (`SUPPORTED_ARCHITECTURES`). `HASH_MODEL_ARCHITECTURE` names
the hash model, which has no checkpoint.

Invariants: this module imports no model (the table holds import paths, resolved on lookup), so any module may
import it without a cycle; every registered class has `build(model_config, model_info, device, tp)`, which makes a
ready-to-run model (a checkpoint model loads its weights, this rank's shard of them under tensor parallelism; the
hash model has none and runs replicated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.builtin_models import HASH_LOGITS_MODEL_ARCHITECTURE, HASH_MODEL_ARCHITECTURE
from kvflow.registry import LazyRegistry

if TYPE_CHECKING:
    import torch

    from kvflow.config import ModelConfig
    from kvflow.distributed import TensorParallelGroup
    from kvflow.model_info import ModelInfo
    from kvflow.models.interface import RunnerModel

_LLAMA = "kvflow.models.llama:LlamaForCausalLM"
_DECODER_CLASSIFIER = "kvflow.models.llama:LlamaForSequenceClassification"

MODEL_REGISTRY: LazyRegistry[type[RunnerModel]] = LazyRegistry(
    "model architecture",
    {
        "LlamaForCausalLM": _LLAMA,
        "Qwen2ForCausalLM": _LLAMA,
        "Qwen3ForCausalLM": _LLAMA,
        "MistralForCausalLM": _LLAMA,
        "Phi3ForCausalLM": "kvflow.models.phi3:Phi3ForCausalLM",
        "Gemma2ForCausalLM": "kvflow.models.gemma2:Gemma2ForCausalLM",
        "Gemma3ForCausalLM": "kvflow.models.gemma3:Gemma3ForCausalLM",
        "MixtralForCausalLM": "kvflow.models.mixtral:MixtralForCausalLM",
        "Qwen2MoeForCausalLM": "kvflow.models.qwen_moe:Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM": "kvflow.models.qwen_moe:Qwen3MoeForCausalLM",
        # Pooling models (runner "pooling"): decoder embedders and classifiers, BERT-style encoders.
        "LlamaModel": _LLAMA,
        "Qwen2Model": _LLAMA,
        "Qwen3Model": _LLAMA,
        "LlamaForSequenceClassification": _DECODER_CLASSIFIER,
        "Qwen2ForSequenceClassification": _DECODER_CLASSIFIER,
        "Qwen3ForSequenceClassification": _DECODER_CLASSIFIER,
        "BertModel": "kvflow.models.bert:BertEncoderModel",
        "XLMRobertaModel": "kvflow.models.bert:BertEncoderModel",
        "BertForSequenceClassification": "kvflow.models.bert:BertForSequenceClassification",
        "XLMRobertaForSequenceClassification": "kvflow.models.bert:XLMRobertaForSequenceClassification",
        HASH_MODEL_ARCHITECTURE: "kvflow.models.hash_model:HashModel",
        HASH_LOGITS_MODEL_ARCHITECTURE: "kvflow.models.hash_model:HashLogitsModel",
    },
)

# The architectures a checkpoint may name (the hash model has no checkpoint).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(
    name
    for name in MODEL_REGISTRY.names()
    if name not in (HASH_MODEL_ARCHITECTURE, HASH_LOGITS_MODEL_ARCHITECTURE)
)

__all__ = [
    "HASH_MODEL_ARCHITECTURE",
    "MODEL_REGISTRY",
    "SUPPORTED_ARCHITECTURES",
    "build_model",
    "get_model_class",
    "unsupported_architecture_error",
]


def get_model_class(architectures: list[str]) -> type[RunnerModel]:
    """The model class for the first supported checkpoint architecture in a config's `architectures` list."""
    for architecture in architectures:
        if architecture in SUPPORTED_ARCHITECTURES:
            return MODEL_REGISTRY.get(architecture)
    raise unsupported_architecture_error(architectures)


def build_model(
    model_config: ModelConfig,
    model_info: ModelInfo,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
) -> RunnerModel:
    """The model `model_info.architecture` names, built on `device` by its class's `build` (this rank's shard of
    it under tensor parallelism `tp`)."""
    if model_info.architecture not in MODEL_REGISTRY:
        raise unsupported_architecture_error([model_info.architecture])
    model_class = MODEL_REGISTRY.get(model_info.architecture)
    return model_class.build(model_config, model_info, device, tp)


def unsupported_architecture_error(architectures: list[str]) -> ValueError:
    """The error for a checkpoint none of whose architectures kvflow runs, listing the ones it does."""
    named = ", ".join(repr(name) for name in architectures) or "none"
    return ValueError(
        f"unsupported model architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
