"""Real PEFT LoRA adapters on tiny random checkpoints, and transformers' outputs with them merged, for LoRA tests.

`make_tiny_llama` writes a tiny random Llama (`kvflow.testing.hf_checkpoints.make_tiny_checkpoint`) on the default
model's tokenizer (its 4096-token vocabulary and special tokens), so prompts can be text; `make_tiny_phi3` a tiny
Phi-3, whose checkpoint ships fused `qkv_proj` / `gate_up_proj`. `make_peft_adapter` wraps such a base with
`peft.get_peft_model` and saves the adapter PEFT writes (`adapter_config.json`, `adapter_model.safetensors`), with A
and B both random (PEFT starts B at zero, which would make the adapter a no-op). `merged_model` is the base with the
adapter merged into its weights by PEFT (`merge_and_unload`), the oracle for an engine serving the adapter:
`greedy_reference` runs it.

transformers and peft are dev dependencies, imported inside the functions.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvflow.default_model import SHIPPED_CHECKPOINT
from kvflow.testing import hf_checkpoints

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The tokenizer files every tiny base gets (the default model's byte-level BPE with ChatML special tokens).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Every linear module of a Llama / Qwen / Mistral decoder layer, in PEFT's names.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Per-entry standard deviation of the random A and B. With r=8 and lora_alpha=16 the merged delta's entries then
# have a standard deviation near the base weights' (0.2), enough to change greedy tokens.
DEFAULT_INIT_SCALE = 0.2


def _tokenizer_ids() -> dict[str, int]:
    """The vocabulary size and special token ids of the default model's tokenizer."""
    config = json.loads((SHIPPED_CHECKPOINT / "config.json").read_text())
    keys = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys}


def _copy_tokenizer(folder: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(SHIPPED_CHECKPOINT / name, folder / name)


def make_tiny_llama(folder: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """A tiny random float32 Llama checkpoint (`make_tiny_checkpoint`'s: hidden 64, 2 layers, 4 query heads on 2
    KV heads, intermediate 128, untied head) with the default model's tokenizer files and ids, in `folder`.
    `config_overrides` go to the transformers config. Returns the folder."""
    folder = Path(folder)
    hf_checkpoints.make_tiny_checkpoint(
        folder, "llama", seed=seed, **{**_tokenizer_ids(), **config_overrides}
    )
    _copy_tokenizer(folder)
    return folder


def make_tiny_phi3(folder: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """A tiny random float32 Phi-3 checkpoint (the same shape as `make_tiny_llama`'s; its layers hold fused
    `qkv_proj` and `gate_up_proj`) with the default model's tokenizer, in `folder`. Returns the folder."""
    import transformers

    folder = Path(folder)
    config = transformers.Phi3Config(
        **{
            **hf_checkpoints._SMALL_SHAPE,
            **_tokenizer_ids(),
            "tie_word_embeddings": False,
            **config_overrides,
        }
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        hf_checkpoints._perturb_constant_parameters(model, std=hf_checkpoints._PERTURBED_SCALE)
        with torch.no_grad():
            model.model.norm.weight.mul_(hf_checkpoints._FINAL_NORM_SCALE)
    finally:
        torch.random.set_rng_state(state)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    _copy_tokenizer(folder)
    return folder


def make_peft_adapter(
    base_folder: str | Path,
    adapter_folder: str | Path,
    *,
    target_modules: Sequence[str] | str,
    r: int = 8,
    lora_alpha: float = 16,
    use_rslora: bool = False,
    seed: int = 1,
    init_scale: float = DEFAULT_INIT_SCALE,
    **lora_config: Any,
) -> Path:
    """A PEFT LoRA adapter for the checkpoint in `base_folder`, saved by PEFT itself in `adapter_folder`.

    The base loads in float32 and is wrapped by `peft.get_peft_model(LoraConfig(r, lora_alpha, target_modules,
    use_rslora, lora_dropout=0, **lora_config))` (e.g. `rank_pattern`, `alpha_pattern`); every lora_A and lora_B
    is then set to N(0, init_scale^2) from a generator seeded with `seed` (in module order), so the adapter changes
    the model's outputs. The global RNG is left as it was. Returns the adapter folder."""
    import peft

    model = hf_checkpoints.load_hf_model(base_folder)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        **lora_config,
    )
    state = torch.random.get_rng_state()
    try:  # peft initialises lora_A from the global RNG
        peft_model = peft.get_peft_model(model, config)
    finally:
        torch.random.set_rng_state(state)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * init_scale)
    adapter_folder = Path(adapter_folder)
    peft_model.save_pretrained(adapter_folder)
    return adapter_folder


def merged_model(base_folder: str | Path, adapter_folder: str | Path) -> PreTrainedModel:
    """The float32 base with the adapter merged into its weights by PEFT (`PeftModel.from_pretrained(...)
    .merge_and_unload()`), in eval mode: the reference for greedy outputs under the adapter."""
    import peft

    base = hf_checkpoints.load_hf_model(base_folder)
    merged = peft.PeftModel.from_pretrained(base, str(adapter_folder)).merge_and_unload()
    return merged.eval()


def greedy_reference(
    model: PreTrainedModel, prompt_token_ids: Sequence[int], max_tokens: int
) -> list[int]:
    """transformers' greedy continuation of the prompt on `model` (e.g. `merged_model`'s): exactly `max_tokens`
    tokens, no stop at EOS."""
    return hf_checkpoints.hf_greedy("", list(prompt_token_ids), max_tokens, model)
