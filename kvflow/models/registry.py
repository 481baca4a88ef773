"""Which model class runs which Hugging Face architecture."""

from __future__ import annotations

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)


def get_model_class(architectures: list[str]) -> type:
    """The kvflow model class for the first supported name in a config's `architectures` list.

    Every supported architecture shares one implementation (`kvflow.models.llama.LlamaForCausalLM`); the differences
    (q/k/v bias, q/k norm, sliding window) come from the parsed config.
    """
    for architecture in architectures:
        if architecture in SUPPORTED_ARCHITECTURES:
            from kvflow.models.llama import LlamaForCausalLM

            return LlamaForCausalLM
    named = ", ".join(repr(name) for name in architectures) or "none"
    raise ValueError(
        f"unsupported model architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
