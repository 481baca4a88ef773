"""Tiny random Hugging Face checkpoints and transformers reference outputs, for tests and benchmarks.

`make_tiny_checkpoint` writes a real `save_pretrained` folder (config.json + safetensors) for one of the supported
families; `hf_greedy` / `hf_logits` run transformers on it in float32 as the oracle for kvflow's models.
transformers is a dev dependency, imported inside the functions.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# The shape and ids every variant starts from (before the variant's settings and the caller's overrides).
_SMALL_SHAPE: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # Large weights give large logit gaps, so greedy decoding is stable under float rounding differences.
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# Per variant: the transformers config class and the settings that make it that variant.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama3": (
        "LlamaConfig",
        {
            "num_hidden_layers": 3,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"sliding_window": 12, "num_key_value_heads": 1}),
}
# Parameters transformers initialises to constants (norm weights to 1, biases to 0); perturbed so a model that
# ignored them would not match the reference.
_PERTURBED_SCALE = 0.2
# The final norm's weight is scaled up so logits spread widely (std ~6): clear greedy margins.
_FINAL_NORM_SCALE = 4.0
_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_tiny_checkpoint(
    path: str | Path,
    architecture: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a random `architecture` checkpoint ("llama", "llama3", "qwen2", "qwen3", "mistral") to `path`.

    `config_overrides` go straight to the transformers config (e.g. `hidden_size=896, num_hidden_layers=24`);
    `dtype` ("float32", "bfloat16", "float16") is the dtype the weights are saved in and the config's dtype.
    Norm weights and biases are perturbed away from their constant initial values and the final norm is scaled
    up for wide logit margins. Returns the folder.
    """
    import transformers

    if architecture not in VARIANTS:
        raise ValueError(
            f"unknown tiny checkpoint architecture {architecture!r}; known: {', '.join(VARIANTS)}"
        )
    torch_dtype = _SAVE_DTYPES.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be one of {', '.join(_SAVE_DTYPES)}, got {dtype!r}")
    config_class_name, variant = VARIANTS[architecture]
    config_kwargs = {**_SMALL_SHAPE, **variant, **config_overrides}
    config = getattr(transformers, config_class_name)(**config_kwargs)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        _perturb_constant_parameters(model, std=_PERTURBED_SCALE)
        with torch.no_grad():
            model.model.norm.weight.mul_(_FINAL_NORM_SCALE)
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(torch_dtype)  # save_pretrained records the dtype in config.json
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    logger.info(
        "wrote a %s checkpoint (%d parameters, %s) to %s",
        architecture,
        sum(param.numel() for param in model.parameters()),
        dtype,
        folder,
    )
    return folder


def _perturb_constant_parameters(model: PreTrainedModel, *, std: float) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * std)
            elif name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * std)


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The checkpoint as a transformers model (float32 unless `dtype` says otherwise) in eval mode."""
    import transformers

    dtype_kwarg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **{dtype_kwarg: dtype})
    return model.eval()


def hf_logits(
    path: str | Path, token_ids: list[int], model: PreTrainedModel | None = None
) -> torch.Tensor:
    """transformers' logits `[len(token_ids), vocab_size]` (as float32) for one sequence, in one forward.

    `model` (from `load_hf_model`) avoids reloading the checkpoint; without it a float32 model is loaded.
    """
    model = model if model is not None else load_hf_model(path)
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()


def hf_greedy(
    path: str | Path,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    model: PreTrainedModel | None = None,
) -> list[int]:
    """transformers' greedy continuation of a prompt: exactly `max_new_tokens` tokens (no EOS stop).

    Runs a float32 model loaded from `path` unless `model` (from `load_hf_model`) is given.
    """
    model = model if model is not None else load_hf_model(path)
    # transformers 5 renamed `past_key_values` to `cache` (argument and output field).
    cache_name = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    generated: list[int] = []
    with torch.no_grad():
        output = model(input_ids=torch.tensor([prompt_token_ids]), use_cache=True)
        for step in range(max_new_tokens):
            next_token = int(output.logits[0, -1].argmax())
            generated.append(next_token)
            if step + 1 < max_new_tokens:
                output = model(
                    input_ids=torch.tensor([[next_token]]),
                    use_cache=True,
                    **{cache_name: getattr(output, cache_name)},
                )
    return generated
