"""The registry builds every model, the hash model included, from its `ModelInfo.architecture`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvflow.config import ModelConfig
from kvflow.model_info import resolve_model_info
from kvflow.models.hash_model import HashModel
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.registry import HASH_MODEL_ARCHITECTURE, build_model
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

CPU = torch.device("cpu")


def test_the_hash_model_is_built_through_the_registry() -> None:
    model_info = resolve_model_info("hash")
    assert model_info.architecture == HASH_MODEL_ARCHITECTURE and model_info.is_hash_model
    model = build_model(ModelConfig(model="hash"), model_info, CPU)
    assert isinstance(model, HashModel)
    assert model.vocab_size == model_info.vocab_size
    assert model.samples_own_tokens


def test_a_checkpoint_is_built_by_its_architecture(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    model_info = resolve_model_info(str(checkpoint))
    assert model_info.architecture == "Qwen2ForCausalLM" and not model_info.is_hash_model
    model = build_model(ModelConfig(model=str(checkpoint), dtype="float32"), model_info, CPU)
    assert isinstance(model, LlamaForCausalLM)
    assert not model.samples_own_tokens


def test_an_unknown_architecture_is_refused_by_name() -> None:
    model_info = dataclasses.replace(resolve_model_info("hash"), architecture="GPT2LMHeadModel")
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        build_model(ModelConfig(model="hash"), model_info, CPU)


def test_the_hash_model_has_no_weights_to_load() -> None:
    with pytest.raises(ValueError, match="the hash test model has no weights to update"):
        HashModel().load_weights([], strict=False)
